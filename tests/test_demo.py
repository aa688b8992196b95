"""`python -m htree_jax demo`: runs through the public API and reports what it measured."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from htree_jax.__main__ import main
from htree_jax.demo import oracle_agreement

DEMO = [sys.executable, "-m", "htree_jax", "demo"]
SMALL = ["--seq-len", "300", "--top-k", "4", "--compression-rate", "4", "--heads", "4",
         "--kv-heads", "2", "--head-dim", "16", "--repeats", "1", "--oracle-samples", "5"]


def run_in_process(argv, capsys):
    """`python -m htree_jax ARGV` in this process: `(exit code, stdout, stderr)`."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_reports_agreement(out):
    assert "tree     4 layer(s), nodes per layer bottom->top: 300, 75, 19, 5" in out
    same, total, ties = (int(x) for x in re.search(r"identical for (\d+)/(\d+), near-ties (\d+)", out).groups())
    assert total == 10 and same + ties >= total  # every differing query is a flagged near-tie
    assert "AGREES" in out and "DISAGREES" not in out
    assert "dense/htree" in out and "candidates scored per query" in out
    # what takes time is said before it starts, and a CPU's ratio below 1 is explained
    assert out.index("compiling and running htree") < out.index("tree     ")
    assert "below 1 is expected here" in out


def test_demo_command_reports_oracle_agreement():
    res = subprocess.run(DEMO + SMALL, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert_reports_agreement(res.stdout)


def test_demo_bfloat16_shared_max_not_strict(capsys):
    code, out, err = run_in_process(["demo"] + SMALL + ["--dtype", "bfloat16", "--importance", "shared_max",
                                                        "--no-strict-causal"], capsys)
    assert code == 0, err
    assert_reports_agreement(out)


def test_oracle_agreement_waives_only_the_near_tie_query():
    """A near-tie query may differ (selection and output); any other error fails."""
    B, P, H_kv, G, V, top_k = 1, 3, 2, 2, 4, 2
    ref = np.zeros((B, P, H_kv * G, V))
    ref_sel = [np.zeros((B, P, H_kv, top_k), np.int64)]
    fragile = np.zeros((B, P, H_kv), bool)
    fragile[0, 1, 0] = True
    o = ref.copy()
    sel = [x.copy() for x in ref_sel]
    o[0, 1, 0:2] = 1.0  # the fragile query's heads: waived
    sel[0][0, 1, 0] = 7
    agree, same, err = oracle_agreement(o, sel, ref, ref_sel, fragile, tol=1e-4)
    assert agree and err == 0.0 and same.sum() == same.size - 1
    o[0, 2, 3] = 1e-3  # another query's head: not waived
    assert not oracle_agreement(o, sel, ref, ref_sel, fragile, tol=1e-4)[0]
    o[0, 2, 3] = 0.0
    sel[0][0, 0, 1] = 7  # another query's selection: not waived
    assert not oracle_agreement(o, sel, ref, ref_sel, fragile, tol=1e-4)[0]


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
def test_demo_bad_flags_exit_2(capsys, args, message):
    code, _, err = run_in_process(["demo"] + SMALL + args, capsys)
    assert code == 2
    assert message in err


def test_bench_without_gpu_is_a_clear_error(capsys):
    import jax

    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU the benchmark runs; see benchmarks/RESULTS.md")
    code, _, err = run_in_process(["bench", "--sizes", "64"], capsys)
    assert code == 2
    assert "needs a CUDA GPU" in err


def test_demo_packed(capsys):
    """`demo --packed 3`: three documents per row, each sampled position against the
    oracle on its document alone."""
    code, out, err = run_in_process(["demo"] + SMALL + ["--packed", "3", "--oracle-samples", "12"], capsys)
    assert code == 0, err
    assert "packed: 3 documents of 100 tokens per row" in out
    same, total, ties = (int(x) for x in re.search(r"identical for (\d+)/(\d+), near-ties (\d+)", out).groups())
    assert total == 24 and same + ties >= total
    assert "AGREES" in out and "DISAGREES" not in out


def test_every_cli_flag_has_help(capsys):
    """`demo --help` and `bench --help` explain every flag (the README points to them),
    the demo's config fields `--selection` and `--rope-dim` among them."""
    for command in ("demo", "bench"):
        code, out, _ = run_in_process([command, "--help"], capsys)
        assert code == 0
        lines = out.splitlines()
        flags = [(i, m) for i, line in enumerate(lines)
                 if (m := re.match(r"^  (--[a-z-]+)(?: [A-Z_]+| \{[^}]*\})?(\s{2,}\S.*)?$", line))]
        assert len(flags) > 5
        for i, m in flags:
            # argparse puts the help on the flag's line or, for a long flag, the next one
            assert m.group(2) or lines[i + 1].startswith(" " * 10), (command, m.group(1))
    code, out, _ = run_in_process(["demo", "--help"], capsys)
    assert "--selection" in out and "--rope-dim" in out


def test_help_shows_the_defaults(capsys):
    """`demo --help` and `bench --help` show each flag's default; every command-line tool
    in the repository builds its parser with a formatter that shows them."""
    for command in ("demo", "bench"):
        code, out, _ = run_in_process([command, "--help"], capsys)
        assert code == 0
        text = " ".join(out.split())  # argparse wraps long lines
        assert text.count("default") >= 10, (command, text)
    code, out, _ = run_in_process(["demo", "--help"], capsys)
    text = " ".join(out.split())
    assert "batch size B (default: 1)" in text and "random seed of the inputs (default: 0)" in text
    root = pathlib.Path(__file__).resolve().parents[1]
    folders = ("htree_jax", "benchmarks", "benchmarks/profiling", "examples", "tools")
    tools = [p for folder in folders for p in sorted((root / folder).glob("*.py"))
             if "ArgumentParser(" in p.read_text()]
    assert len(tools) > 20
    for path in tools:
        for call in re.findall(r"ArgumentParser\([^)]*\)|add_parser\([^)]*\)", path.read_text()):
            assert "formatter_class=" in call and "DefaultsHelpFormatter" in call, (path.name, call)
