"""One test base over every route (issue 102; tokamax's `test_base.py` way): the same
numerical checks on each implementation of `htree_jax.routes.ROUTES` that runs on the
machine at hand, at a shape its plan takes it on (asserted, so a case cannot test
another route by mistake):
- the forward and its selections against the float64 oracle (`reference_numpy`; packed
  rows: each document alone), on the queries the oracle does not flag as near-ties;
- the gradients in q, k and v against the JAX reference's (XLA autodiff), on the kernel
  routes.
Kernel routes run interpreted off a GPU and compiled on one; a route that needs a GPU
(cuDNN's, Mosaic GPU's) is skipped elsewhere, saying so. A new route is one more entry
of `CASES` (`test_every_route_has_a_case` fails until it has one)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from htree_jax import HTreeConfig, htree_attention
from htree_jax.backends import full_sequence_plan
from htree_jax.core.validation import Dims
from htree_jax.routes import ROUTES
from pallas_kernels.block.forward import on_hopper
from tests.conftest import random_qkv
from tests.test_oracle_agreement import assert_matches_oracle
from tests.test_packing import assert_packed_matches_oracle, segments

GPU = jax.default_backend() == "gpu"
PER_QUERY = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)  # 4 layers at T=150
BLOCK = HTreeConfig(compression_rate=4, top_k=4, selection_block=4)
# Each route: (config, (B, T, H, H_kv, K, V), dtype, packed rows' document lengths or None,
# what the machine needs: None, "gpu" or "hopper").
CASES = {
    "reference": (PER_QUERY, (2, 150, 8, 2, 32, 32), "float32", None, None),
    "reference_packed": (PER_QUERY, (2, 150, 8, 2, 32, 32), "float32", [[40, 110], [150]], None),
    "dense": (HTreeConfig(top_k=2**20), (1, 512, 8, 2, 64, 64), "bfloat16", None, "gpu"),
    "gqa": (PER_QUERY, (2, 150, 8, 2, 32, 32), "float32", None, None),
    "wide": (PER_QUERY, (1, 150, 32, 1, 32, 32), "float32", None, None),
    "block_pallas_triton": (BLOCK, (2, 150, 8, 2, 32, 32), "float32", None, None),
    "block_mosaic_gpu": (HTreeConfig(top_k=8, selection_block=16), (1, 600, 16, 2, 64, 64), "bfloat16", None,
                         "hopper"),
}
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}
# The gradients against the reference's: float32 measured 2.8e-7 to 4.7e-7 on the CPU
# (jax 0.12.1, the three interpreted kernel routes); bfloat16 as the other kernel tests.
GRAD_TOLERANCE = {"float32": 2e-6, "bfloat16": 3e-2}


def test_every_route_has_a_case():
    assert set(CASES) == set(ROUTES)


def backend_of(route: str) -> str:
    return "reference" if route.startswith("reference") else "pallas" if GPU else "pallas_interpret"


def relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("route", list(CASES))
def test_each_route_against_the_oracle_and_the_references_gradients(rng, route):
    config, (B, T, H, H_kv, K, V), dtype, documents, needs = CASES[route]
    if needs == "gpu" and not GPU:
        pytest.skip(f"route {route!r} runs on a CUDA GPU only (cuDNN)")
    if needs == "hopper" and not (GPU and on_hopper()):
        pytest.skip(f"route {route!r} runs on a Hopper GPU only (Mosaic GPU: WGMMA, TMA)")
    backend = backend_of(route)
    plan = full_sequence_plan(backend, Dims(B, T, H, H_kv, K, V), config, packed=documents is not None,
                              dtype=jnp.dtype(dtype))
    assert plan.route == route, plan
    q, k, v = (jnp.asarray(x, dtype) for x in random_qkv(rng, B, T, H, H_kv, K, V))
    tolerance = TOLERANCE[dtype]
    if documents is not None:
        assert_packed_matches_oracle(*(np.asarray(x) for x in (q, k, v)), documents, config, backend)
    elif dtype == "float32":
        assert_matches_oracle(*(np.asarray(x) for x in (q, k, v)), config, backend=backend)
    else:  # 16-bit inputs: against the reference on the same inputs, at the dtype's tolerance
        o = htree_attention(q, k, v, config, backend=backend)
        with jax.default_matmul_precision("highest"):
            want = htree_attention(*(x.astype(jnp.float32) for x in (q, k, v)), config, backend="reference")
        assert relative(o, want) < tolerance, relative(o, want)
    if backend == "reference":
        return  # XLA differentiates the reference: its gradients are the ones compared with
    weights = jnp.asarray(rng.standard_normal((B, T, H, V)), jnp.float32)
    ids = {} if documents is None else dict(segment_ids=segments(documents))

    def grads(backend, inputs):
        loss = lambda q, k, v: jnp.sum(htree_attention(q, k, v, config, backend=backend, **ids)
                                       .astype(jnp.float32) * weights)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*inputs)

    with jax.default_matmul_precision("highest"):
        want = grads("reference", tuple(x.astype(jnp.float32) for x in (q, k, v)))
    for name, a, b in zip("qkv", grads(backend, (q, k, v)), want):
        assert relative(a, b) < GRAD_TOLERANCE[dtype], (name, relative(a, b))
