"""A one-layer tree (`T <= top_k * compression_rate`) is causal attention: on the GPU path
it runs as RoPE then `jax.nn.dot_product_attention` (`htree_jax.core.one_layer`), checked
here against the float64 oracle (XLA's dense attention on the CPU: the same function)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import htree_jax
from htree_jax import HTreeConfig, reference
from htree_jax import attention as htree_attention_module
from htree_jax import decode as decode_module
from htree_jax.backends import attend
from htree_jax.core.non_finite import poison_rows
from htree_jax.core.one_layer import dense_eligible, fitted_to_length, one_layer, one_layer_attention
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


@pytest.mark.parametrize("T, H, H_kv, K, V, config", [
    (64, 4, 2, 32, 32, HTreeConfig(compression_rate=4, top_k=16, selection_block=1)),
    (37, 8, 2, 64, 48, HTreeConfig(compression_rate=16, top_k=4, rope_dim=16)),
    (50, 6, 3, 32, 32, HTreeConfig(compression_rate=8, top_k=8, scale=0.3, rope_base=500.0)),
])
def test_the_reference_computes_a_one_layer_tree_as_causal_attention(rng, monkeypatch, T, H, H_kv, K, V, config):
    """The reference's one-layer path (`causal_attention_reference`, in query chunks: a
    budget of 3 queries' scores here) equals the oracle, and its gradients the walk's
    (`reference_forward`, which pays for every candidate of the buffer); queries at
    given positions (a context shard's) read the keys up to theirs."""
    assert one_layer(config, T)
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, 2, T, H, H_kv, K, V))
    monkeypatch.setenv(reference.CHUNK_BUDGET_ENV, str(3 * 12 * 2 * H * T))
    want = htree_attention_numpy(q, k, v, config)
    q, k = (rope_layout(x, config.partial_rope(K)) for x in (q, k))  # as the reference takes them
    o, selected = reference.htree_attention_reference(q, k, v, config)
    assert selected == []
    np.testing.assert_allclose(np.asarray(o, np.float64), want, rtol=1e-5, atol=1e-5)
    w = jnp.asarray(rng.standard_normal((2, T, H, V)), jnp.float32)
    fast = lambda q, k, v: jnp.sum(reference.htree_attention_reference(q, k, v, config)[0] * w)
    walk = lambda q, k, v: jnp.sum(reference.reference_forward(q, k, v, config, 8)[0] * w)
    for name, a, b in zip("qkv", jax.grad(fast, argnums=(0, 1, 2))(q, k, v), jax.grad(walk, argnums=(0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5, err_msg=name)
    positions = jnp.asarray([3, 20, T - 1], jnp.int32)
    o_at, _ = reference.htree_attention_reference(q[:, positions], k, v, config, positions=positions)
    np.testing.assert_allclose(np.asarray(o_at), np.asarray(reference.htree_attention_reference(q, k, v, config)[0])[
        :, np.asarray(positions)], rtol=1e-6, atol=1e-6)


def test_a_one_layer_tree_costs_its_tokens_not_top_k(rng, monkeypatch):
    """`top_k=2**20` (a buffer of 2**24 candidates) at T=512 returns at once on every
    backend, as the causal attention a one-layer tree is (`fitted_to_length`: the
    smallest `top_k` whose layer holds the sequence); a tree of more layers keeps its
    config."""
    config = HTreeConfig(top_k=2 ** 20)
    assert fitted_to_length(config, 512) == dataclasses.replace(config, top_k=32)
    assert fitted_to_length(config, 512 * 16 + 1) == dataclasses.replace(config, top_k=1024)
    assert fitted_to_length(HTreeConfig(top_k=4), 100) == HTreeConfig(top_k=4)  # 3 layers
    assert fitted_to_length(HTreeConfig(compression_rate=4, top_k=1), 3) == HTreeConfig(compression_rate=4, top_k=1)
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, 1, 512, 4, 2, 32, 32))
    want = jax.nn.dot_product_attention(htree_jax.rope(q), htree_jax.rope(k), v, is_causal=True)
    seen = []
    monkeypatch.setattr(htree_attention_module, "attend", lambda q, k, v, config, *a, **kw: seen.append(config)
                        or attend(q, k, v, config, *a, **kw))
    for backend in ("reference", "pallas_interpret"):
        o = htree_jax.htree_attention(q, k, v, config, backend=backend)
        np.testing.assert_allclose(np.asarray(o), np.asarray(want), rtol=2e-5, atol=2e-5, err_msg=backend)
    assert [c.top_k for c in seen] == [32, 32]  # what the backends were given


def test_a_candidate_buffer_no_device_holds_is_refused_before_any_work(monkeypatch):
    """A tree of several layers whose one query's buffer (`M = top_k * compression_rate`
    candidates, every batch row and kv head) exceeds the device's memory: a ValueError
    naming `top_k` and `compression_rate`, at trace time."""
    assert reference.memory_limit_bytes() > 2**30  # the host's memory on a CPU
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    need = reference.chunk_bytes_per_query(config, 2, 2, 2, 16, 16)
    shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((2, 150, 4, 16), (2, 150, 2, 16), (2, 150, 2, 16))]
    monkeypatch.setattr(reference, "memory_limit_bytes", lambda: need - 1)
    with pytest.raises(ValueError, match=r"top_k \* compression_rate = 4 \* 4 = 16 candidates a query: the "
                                         r"reference needs .* GiB for one query position \(B = 2, H_kv = 2\), more "
                                         r"than the .* lower top_k or compression_rate"):
        jax.eval_shape(lambda q, k, v: htree_jax.htree_attention(q, k, v, config, backend="reference"), *shapes)
    monkeypatch.setattr(reference, "memory_limit_bytes", lambda: need)
    jax.eval_shape(lambda q, k, v: htree_jax.htree_attention(q, k, v, config, backend="reference"), *shapes)


@pytest.mark.parametrize("backend", ["reference", "pallas_interpret"])
def test_a_one_layer_cache_decodes_whatever_top_k_is(rng, monkeypatch, backend):
    """A cache whose `max_len` a single layer holds is sized by its tokens: `top_k=2**20`
    decodes at once (the steps are given `top_k=4`, 64 tokens' worth), a prefill then
    steps equal to the full sequence."""
    config = HTreeConfig(top_k=2**20)
    B, T, H, H_kv, K = 1, 40, 4, 2, 32
    seen, steps_of = [], decode_module._prefill
    monkeypatch.setattr(decode_module, "_prefill", lambda *a: seen.append(a[5].top_k) or steps_of(*a))
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, B, T, H, H_kv, K, K))
    cache = htree_jax.init_cache(B, 64, H_kv, K, K, config, num_heads=H)
    o, cache = htree_jax.prefill(q[:, :36], k[:, :36], v[:, :36], cache, config, backend=backend)
    assert seen == [4]
    steps = [o]
    for t in range(36, T):
        o_t, cache = htree_jax.decode_step(q[:, t], k[:, t], v[:, t], cache, config, backend=backend)
        steps.append(o_t[:, None])
    want = htree_jax.htree_attention(q, k, v, config, backend="reference")
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, axis=1)), np.asarray(want), rtol=2e-5, atol=2e-5)
    assert seen == [4] * 5
