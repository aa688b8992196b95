"""`python -m htree_jax demo`: runs through the public API and reports what it measured."""

from __future__ import annotations

import subprocess
import sys

import pytest

DEMO = [sys.executable, "-m", "htree_jax", "demo"]
SMALL = ["--seq-len", "300", "--top-k", "4", "--compression-rate", "4", "--heads", "4",
         "--kv-heads", "2", "--head-dim", "16", "--repeats", "1", "--oracle-samples", "5"]


def run(args):
    return subprocess.run(DEMO + args, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("extra", [[], ["--dtype", "bfloat16", "--importance", "shared_max", "--no-strict-causal"]])
def test_demo_reports_oracle_agreement(extra):
    res = run(SMALL + extra)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "tree     4 layer(s), nodes per layer bottom->top: 300, 75, 19, 5" in out
    assert "selections identical for 10/10" in out or "near-ties" in out
    assert "AGREES" in out and "DISAGREES" not in out
    assert "dense/htree" in out and "candidates scored per query" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--top-k", "6"], "top_k must be a positive power of two"),
        (["--heads", "3", "--kv-heads", "2"], "multiple of H_kv"),
        (["--head-dim", "7"], "must be even"),
        (["--seq-len", "0"], "--seq-len must be >= 1"),
        (["--importance", "max"], "importance must be one of"),
        (["--backend", "tpu"], "backend must be one of"),
        (["--dtype", "int8"], "invalid choice"),
        (["--no-such-flag"], "unrecognized arguments"),
    ],
)
def test_demo_bad_flags_exit_2(args, message):
    res = run(SMALL + args)
    assert res.returncode == 2
    assert message in res.stderr


def test_bench_without_gpu_is_a_clear_error():
    import jax

    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU the benchmark runs; see benchmarks/RESULTS.md")
    res = subprocess.run([sys.executable, "-m", "htree_jax", "bench", "--sizes", "64"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    assert "needs a CUDA GPU" in res.stderr
