"""Run by tests/test_multiprocess.py: htree's context parallelism across processes, on
the CPU. `single OUT`: one process, 4 simulated devices; `multi OUT PORT ID`: one of two
processes on localhost (`jax.distributed.initialize`, CPU collectives through gloo), 2
simulated devices each, the same 4-device mesh. Both run the same forward and gradients
with q, k, v sharded along T (`P(None, "seq", None, None)`) on each backend and write
them, gathered, to OUT (`.npz`; process 0 writes for the pair). Prints one line per
backend; exits non-zero on a failure."""

from __future__ import annotations

import os
import sys

MODE = sys.argv[1]
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={4 if MODE == 'single' else 2}")

import jax  # noqa: E402

if MODE == "multi":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{sys.argv[3]}", num_processes=2, process_id=int(sys.argv[4]),
                               initialization_timeout=120)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from htree_jax import HTreeConfig, htree_attention  # noqa: E402

CONFIG = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)  # 3 layers at T=152
B, T, H, H_KV, K, V = 2, 152, 8, 4, 32, 32
BACKENDS = ("reference", "pallas_interpret")


def main() -> int:
    assert jax.device_count() == 4, jax.devices()
    rng = np.random.default_rng(0)  # the same inputs in every process
    q = rng.standard_normal((B, T, H, K)).astype(np.float32)
    k = rng.standard_normal((B, T, H_KV, K)).astype(np.float32)
    v = rng.standard_normal((B, T, H_KV, V)).astype(np.float32)
    w = rng.standard_normal((B, T, H, V)).astype(np.float32)
    mesh = jax.make_mesh((4,), ("seq",), axis_types=(AxisType.Auto,))
    along_t = NamedSharding(mesh, P(None, "seq", None, None))
    # Each process builds only its own shards of the global arrays.
    args = [jax.make_array_from_callback(x.shape, along_t, lambda index, x=x: x[index]) for x in (q, k, v)]
    gather = lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))
    out = {}
    for backend in BACKENDS:
        def loss(q, k, v, backend=backend):
            return jnp.sum(htree_attention(q, k, v, CONFIG, backend=backend) * w)

        o = jax.jit(lambda q, k, v, backend=backend: htree_attention(q, k, v, CONFIG, backend=backend))(*args)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
        for name, x in zip(("o", "dq", "dk", "dv"), (o, *grads)):
            if not x.sharding.is_equivalent_to(along_t, 4):
                print(f"FAIL {backend} {name}: sharded {x.sharding}, not along T", flush=True)
                return 1
            out[f"{backend} {name}"] = gather(x)
        print(f"ok {backend}: forward and gradients along T over {jax.process_count()} process(es), "
              f"{jax.device_count()} devices", flush=True)
    if jax.process_index() == 0:
        np.savez(sys.argv[2], **out)
    return 0


if __name__ == "__main__":
    code = main()
    if MODE == "multi":
        jax.distributed.shutdown()
    sys.exit(code)
