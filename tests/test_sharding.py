"""htree under `jax.jit` with sharded inputs (`htree_jax/sharding.py`), on 8 simulated
CPU devices: `tests/sharding_check.py` in its own process (XLA_FLAGS must be set before
JAX starts). Each backend, sharded along B, the heads, T (context parallelism) and
pairs of them: forward, selections and gradients equal the unsharded run, outputs and
gradients sharded like their inputs; no all-gather in the compiled batch- and
head-sharded forward or gradient, and along T only k, v gathered and dk, dv
reduce-scattered; a split GQA group and an indivisible T are refused naming the axis."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from htree_jax import HTreeConfig
from htree_jax.sharding import context_backend

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_check(mode: str) -> subprocess.CompletedProcess:
    """`tests/sharding_check.py mode` in its own process on 8 simulated CPU devices,
    asserted to succeed (the finished process: its output in `.stdout`)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "sharding_check.py"), mode], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


@pytest.mark.parametrize("backend", ["reference", "pallas_interpret"])
def test_sharded_batch_and_heads_on_simulated_devices(backend):
    res = run_check(backend)
    every = backend == "reference"  # the kernels: `sharding_check.KERNEL_LAYOUTS` and the bound's decode
    for layout in ("batch+heads",) if every else ():
        assert f"ok {backend} {layout}: forward and gradients equal the unsharded run, no all-gather" in res.stdout
    for layout in ("tokens", "batch+tokens", "tokens+heads") if every else ("tokens+heads",):
        assert f"ok {backend} {layout}: forward and gradients equal the unsharded run, k and v gathered" in res.stdout
    assert f"ok {backend} decode (bound): sharded cache (batch, heads) equals unsharded, no all-gather" in res.stdout
    if every:
        assert "ok reference packed: sharded rows equal the unsharded packed call" in res.stdout
        assert "ok reference values from the keys: sharded (batch, heads) equals the unsharded call" in res.stdout
        assert "ok reference decode: sharded cache (batch, heads) equals unsharded, no all-gather" in res.stdout
        assert "ok reference decode (values from the keys): sharded cache (batch, heads) equals unsharded" in res.stdout
        fp8 = "ok reference decode (fp8 tokens): sharded cache (batch, heads) equals unsharded, no all-gather"
        assert fp8 in res.stdout
    assert "ok split group refused" in res.stdout and "ok T indivisible refused" in res.stdout
    assert "ok split group refused under jit" in res.stdout


def test_the_gates_two_device_cases_run_on_simulated_devices():
    """`tools/gpu_gate.py`'s two-device case (a call split along T over two devices
    against the same call on one, at the default) at a small size on the interpreted
    kernels (`sharding_check.gate_devices_check`)."""
    assert "ok gate two-device case (first): agree 1.0000" in run_check("gate").stdout


def test_sharded_nnx_model_optax_step():
    """docs/sharding.md's "Batch and heads" example on 8 simulated devices."""
    assert "ok module step" in run_check("module").stdout


def test_memory_plan_of_context_parallelism_falls_with_the_device_count():
    """`htree_jax.memory_plan` on 8 simulated devices, `T` sharded over 1, 2 and 8."""
    out = run_check("memory").stdout
    assert "ok memory plan: each device's share falls with the device count along T" in out
    assert "ok memory plan: block selection's kernels along T" in out


def test_block_selection_shards_its_tokens_and_its_cache():
    """Block selection (SPEC 12) with T split so that blocks straddle the shards' edges,
    and its decode cache split along the batch and the kv heads (`sharding_check.block_selection_check`)."""
    out = run_check("blocks").stdout
    for source, layout in (("first", "tokens"), ("previous", "tokens+heads")):
        assert f"ok block selection ({source}) {layout}: forward and gradients equal the unsharded run" in out
    for impl in ("reference", "pallas_interpret"):  # the kernels walk each shard's rows
        assert f"ok block selection (previous) decode on {impl}: sharded cache (batch, heads) equals unsharded" in out
    assert "ok block selection: a shard shorter than 2 * selection_block refused" in out
    assert ("ok block selection kernels batch+heads: forward and gradients equal the unsharded kernels, no "
            "all-gather") in out
    for sums in ("", ", partial sums"):
        assert (f"ok block selection kernels (previous) tokens+heads{sums}: forward and gradients equal the unsharded "
                "kernels") in out
    assert "ok block selection kernels: a context shard of part of a block refused on a kernel backend" in out


def test_a_context_shard_of_part_of_a_block_takes_the_reference_under_auto():
    """`sharding.context_backend`: block selection's kernels take context shards of whole
    blocks, so a shard of part of one runs on what `backend="auto"` asks (the
    reference) or is refused naming the axis; the per-query kernels, the unsplit calls
    and shards of whole blocks keep theirs."""
    block, per_query = HTreeConfig(selection_block=16), HTreeConfig(selection_block=1)
    assert context_backend("pallas", block, "seq", "reference", 40) == "reference"
    assert context_backend("pallas", block, "seq", None, 64) == "pallas"
    assert context_backend("pallas", block, None, None, 40) == "pallas"
    assert context_backend("pallas", per_query, "seq", None, 40) == "pallas"
    assert context_backend("reference", block, "seq", None, 40) == "reference"
    with pytest.raises(ValueError, match="mesh axis 'seq' shards T"):
        context_backend("pallas_interpret", block, "seq", None, 40)
