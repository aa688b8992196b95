"""htree under `jax.jit` with batch- and head-sharded inputs (`htree_jax/sharding.py`), on
8 simulated CPU devices: `tests/sharding_check.py` in its own process (XLA_FLAGS must be
set before JAX starts). Each backend: forward, selections and gradients equal the
unsharded run, the output sharded like q, no all-gather in the compiled forward or
gradient; a split GQA group and a sharded T are refused naming the mesh axis."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("backend", ["reference", "pallas_interpret"])
def test_sharded_batch_and_heads_on_simulated_devices(backend):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "sharding_check.py"), backend], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for layout in ("batch", "heads", "batch+heads"):
        assert f"ok {backend} {layout}: forward and gradients equal the unsharded run, no all-gather" in res.stdout
    assert "ok split group refused" in res.stdout and "ok T sharded refused" in res.stdout
    assert "ok split group refused under jit" in res.stdout


def test_sharded_nnx_model_optax_step():
    """The README's "Many devices" example on 8 simulated devices."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "sharding_check.py"), "module"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "ok module step" in res.stdout
