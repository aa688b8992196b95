"""Block selection's kernels (SPEC 12, `pallas_kernels.block`, interpreted) against the
JAX reference with the same option: selections equal, outputs, gradients and the
importance export to the dtype's tolerance, on multi-layer trees, both sources, both
rules, ragged lengths, padded heads, partial RoPE, a group split over several programs
of one block, and SPEC 10's NaN rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from htree_jax import HTreeConfig, htree_attention
from pallas_kernels.block.merge import block_queries
from tests.conftest import random_qkv

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def block_config(r, top_k, source, selection, **kw):
    return HTreeConfig(compression_rate=r, top_k=top_k, selection=selection, selection_block=r, block_source=source,
                       **kw)


def relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def inputs(rng, B, T, H, H_kv, K, V, dtype):
    return tuple(jnp.asarray(x, dtype) for x in random_qkv(rng, B, T, H, H_kv, K, V))


# (source, selection, r, top_k, T, H, H_kv, K, V, rope_dim, dtype): 3+ layers each.
CASES = [
    ("first", "bound", 4, 4, 150, 4, 2, 32, 32, None, jnp.float32),
    ("previous", "mean", 4, 4, 150, 8, 2, 64, 32, None, jnp.float32),
    ("first", "mean", 8, 2, 257, 3, 1, 48, 40, None, jnp.float32),  # T ragged; G, K, V padded
    ("previous", "bound", 4, 8, 200, 4, 1, 32, 32, None, jnp.bfloat16),
    ("first", "bound", 4, 4, 150, 4, 2, 64, 64, 32, jnp.float32),  # partial RoPE
    ("first", "bound", 4, 4, 90, 64, 1, 32, 32, None, jnp.float32),  # 64 heads: two programs a block
]


@pytest.mark.parametrize("source, selection, r, top_k, T, H, H_kv, K, V, rope_dim, dtype", CASES)
def test_forward_matches_the_reference(rng, source, selection, r, top_k, T, H, H_kv, K, V, rope_dim, dtype):
    config = block_config(r, top_k, source, selection, rope_dim=rope_dim)
    assert config.num_layers(T) >= 3
    q, k, v = inputs(rng, 2, T, H, H_kv, K, V, dtype)
    o, sel, imp = htree_attention(q, k, v, config, backend="pallas_interpret", return_selected=True,
                                  return_importance=True)
    o_ref, sel_ref, imp_ref = htree_attention(q, k, v, config, backend="reference", return_selected=True,
                                              return_importance=True)
    for a, b in zip(sel, sel_ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert relative(o, o_ref) < TOLERANCE[dtype]
    for a, b in zip(imp, imp_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_a_group_of_64_heads_takes_two_programs_a_block():
    assert block_queries(4, 64, 64) == 2 and block_queries(16, 8, 128) == 16 and block_queries(16, 8, 256) == 8


@pytest.mark.parametrize("source, selection", [("first", "bound"), ("previous", "mean")])
def test_gradients_match_the_reference(rng, source, selection):
    config = block_config(4, 4, source, selection)
    q, k, v = inputs(rng, 1, 150, 8, 2, 32, 32, jnp.float32)
    weights = jnp.asarray(rng.standard_normal((1, 150, 8, 32)), jnp.float32)

    def grads(backend):
        loss = lambda q, k, v: jnp.sum(htree_attention(q, k, v, config, backend=backend) * weights)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    for name, a, b in zip("qkv", grads("pallas_interpret"), grads("reference")):
        assert relative(a, b) < 1e-5, name


def test_a_nan_key_poisons_the_rows_the_reference_poisons(rng):
    config = block_config(4, 4, "first", "bound")
    q, k, v = inputs(rng, 1, 150, 4, 2, 32, 32, jnp.float32)
    k = k.at[0, 77, 1, 3].set(jnp.nan)
    nan_rows = lambda backend: np.isnan(np.asarray(htree_attention(q, k, v, config, backend=backend))).any(-1)
    rows = nan_rows("pallas_interpret")
    np.testing.assert_array_equal(rows, nan_rows("reference"))
    assert rows[0, 77:].any() and not rows[0, :77].any()
