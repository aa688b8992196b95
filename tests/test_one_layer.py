"""A one-layer tree (`T <= top_k * compression_rate`) is causal attention: on the GPU path
it runs as RoPE then `jax.nn.dot_product_attention` (`htree_jax.core.one_layer`), checked
here against the float64 oracle (XLA's dense attention on the CPU: the same function)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import htree_jax
from htree_jax import HTreeConfig
from htree_jax.backends import attend
from htree_jax.core.non_finite import poison_rows
from htree_jax.core.one_layer import dense_eligible, one_layer, one_layer_attention
from htree_jax.core.rope import rope_layout
from pallas_kernels.shared.dead_rows import poison_rows_in_place
from reference_numpy import htree_attention_numpy
from tests.conftest import random_qkv


@pytest.mark.parametrize("T, H, H_kv, K, config", [
    (64, 4, 2, 32, HTreeConfig(compression_rate=4, top_k=16, selection_block=1)),
    (37, 8, 2, 64, HTreeConfig(compression_rate=16, top_k=4, rope_dim=16)),
    (16, 2, 2, 16, HTreeConfig(compression_rate=4, top_k=4, scale=0.3, rope_base=500.0, selection_block=1)),
    (50, 6, 3, 32, HTreeConfig(compression_rate=8, top_k=8, strict_causal=False, selection="mean", selection_block=1)),
])
def test_one_layer_attention_equals_the_oracle(rng, T, H, H_kv, K, config):
    assert one_layer(config, T)
    q, k, v = random_qkv(rng, 2, T, H, H_kv, K, K)
    R = config.partial_rope(K)
    o = one_layer_attention(rope_layout(jnp.asarray(q), R), rope_layout(jnp.asarray(k), R), jnp.asarray(v), config,
                            implementation="xla")
    want = htree_attention_numpy(q, k, v, config)
    np.testing.assert_allclose(np.asarray(o, np.float64), want, rtol=1e-5, atol=1e-5)


def test_the_gpu_path_takes_it_for_one_layer_only(rng):
    """`attend(..., "pallas")` on a one-layer tree of 16-bit inputs: dense attention (it
    runs here, on the CPU, where the kernels would not), no selections, the importance
    export empty, gradients those of the function; a non-finite key poisons the rows the
    reference poisons (SPEC 10)."""
    config = HTreeConfig(compression_rate=4, top_k=16, selection_block=1)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in random_qkv(rng, 1, 64, 4, 2, 32, 32))
    assert dense_eligible(q, k, v) and not dense_eligible(q.astype(jnp.float32), k, v)
    o, selected, exported = attend(q, k, v, config, "pallas", export=True)
    assert selected == [] and exported == []
    want = htree_attention_numpy(*(np.asarray(x, np.float32) for x in (q, k, v)), config)
    np.testing.assert_allclose(np.asarray(o, np.float64), want, rtol=3e-2, atol=3e-2)
    loss = lambda q, k, v: jnp.sum(attend(q, k, v, config, "pallas")[0].astype(jnp.float32) ** 2)
    f32 = lambda q, k, v: jnp.sum(attend(q, k, v, config, "reference")[0] ** 2)
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    want_grads = jax.grad(f32, argnums=(0, 1, 2))(*(x.astype(jnp.float32) for x in (q, k, v)))
    for g, w in zip(grads, want_grads):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.linalg.norm(g - w) <= 3e-2 * np.linalg.norm(w)
    k_bad = k.at[0, 40, 1, 3].set(jnp.nan)
    o_bad = np.asarray(attend(q, k_bad, v, config, "pallas")[0], np.float32)
    want_bad = np.asarray(attend(q, k_bad, v, config, "reference")[0], np.float32)
    np.testing.assert_array_equal(np.isnan(o_bad), np.isnan(want_bad))
    assert np.isnan(o_bad[0, 40:]).any() and np.isfinite(o_bad[0, :40]).all()


@pytest.mark.parametrize("B, S, H, H_kv, V, first", [
    (2, 24, 4, 2, 72, [[5, 2**31 - 1], [30, 17]]),
    (1, 128, 2, 1, 128, [[0]]),
    (1, 37, 3, 3, 16, [[36, 2**31 - 1, 1]]),
])
def test_poisoned_rows_written_in_place_equal_the_guard(B, S, H, H_kv, V, first):
    """`poison_rows_in_place` (the one-layer GPU path's SPEC 10 rows, a kernel, here
    interpreted) equals `poison_rows`, its gradient too; S and V not powers of two."""
    first = jnp.asarray(first, jnp.int32)
    o = jax.random.normal(jax.random.key(S), (B, S, H, V), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), o.shape)
    ours = lambda o: poison_rows_in_place(o, first, True)
    guard = lambda o: poison_rows(o, jnp.arange(S, dtype=jnp.int32), first)
    got, want = (np.asarray(f(o), np.float32) for f in (ours, guard))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(want).any()
    np.testing.assert_array_equal(np.nan_to_num(got, nan=7.0), np.nan_to_num(want, nan=7.0))
    loss = lambda f: lambda o: jnp.sum(jnp.nan_to_num(f(o).astype(jnp.float32)) * w)
    np.testing.assert_array_equal(np.asarray(jax.grad(loss(ours))(o), np.float32),
                                  np.asarray(jax.grad(loss(guard))(o), np.float32))


@pytest.mark.parametrize("K, rope_dim, base", [(32, None, 10000.0), (48, 16, 500.0)])
def test_public_rope_states_the_convention(rng, K, rope_dim, base):
    """`htree_jax.rope` (the caller's feature order) then causal softmax attention equals
    htree at one layer (the float64 oracle), full and partial RoPE; interleaved RoPE
    (pairs (2i, 2i+1)) does not."""
    config = HTreeConfig(compression_rate=4, top_k=16, rope_base=base, rope_dim=rope_dim, selection_block=1)
    T, H, H_kv = 40, 4, 2
    q, k, v = random_qkv(rng, 1, T, H, H_kv, K, K)
    want = htree_attention_numpy(q, k, v, config)
    rotate = lambda x: np.asarray(htree_jax.rope(jnp.asarray(x), base, rope_dim), np.float64)
    dense = lambda qr, kr: np.asarray(jax.nn.dot_product_attention(
        jnp.asarray(qr, jnp.float32), jnp.asarray(kr, jnp.float32), jnp.asarray(v), is_causal=True,
        scale=config.score_scale(K), implementation="xla"), np.float64)
    np.testing.assert_allclose(dense(rotate(q), rotate(k)), want, rtol=1e-5, atol=1e-5)
    # Interleaved pairs: the same rotation applied to (2i, 2i+1) pairs, by reordering.
    R = K if rope_dim is None else rope_dim
    order = np.concatenate([np.arange(K - R), K - R + np.stack([np.arange(R // 2), R // 2 + np.arange(R // 2)], 1).ravel()])
    inter = lambda x: rotate(x[..., order])[..., np.argsort(order)]
    assert np.max(np.abs(dense(inter(q), inter(k)) - want)) > 1e-2
