"""Beyond one process (issue 86, `docs/sharding.md`, "Several hosts"): two processes on
this machine (`jax.distributed.initialize` on localhost, CPU collectives through gloo)
run the context-parallel forward and gradients (T sharded over 4 devices, 2 a process)
on the reference and on the kernels (interpreted), equal to one process's on the same
4-device mesh (outputs and `dq` bit for bit; `dk`, `dv`, reduce-scattered, to float32's
rounding): `tests/multiprocess_check.py`, each process its own interpreter."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHECK = str(ROOT / "tests" / "multiprocess_check.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_equal_one_on_the_same_mesh(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    single, multi = tmp_path / "single.npz", tmp_path / "multi.npz"
    port = str(free_port())
    # The one-process run beside the pair (its processes wait on each other's collectives).
    run = lambda *a: subprocess.Popen([sys.executable, CHECK, *a], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
    one, pair = run("single", str(single)), [run("multi", str(multi), port, str(i)) for i in range(2)]
    outputs = []
    try:
        for p in (one, *pair):
            outputs.append(p.communicate(timeout=900)[0])
    finally:
        for p in (one, *pair):
            p.kill()
    assert one.returncode == 0, outputs[0][-4000:]
    for p, text in zip(pair, outputs[1:]):
        assert p.returncode == 0, text[-4000:]
        for backend in ("reference", "pallas_interpret"):
            assert f"ok {backend}: forward and gradients along T over 2 process(es), 4 devices" in text
    want, got = np.load(single), np.load(multi)
    assert sorted(want.files) == sorted(got.files) and len(want.files) == 8
    for name in want.files:
        if name.endswith((" o", " dq")):  # each device computes its own rows: the same bits
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        else:  # dk, dv are reduce-scattered: gloo sums the shards in an order of its own
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6, err_msg=name)
