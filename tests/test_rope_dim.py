"""Partial RoPE (SPEC 7, `HTreeConfig(rope_dim=)`): RoPE on the last `rope_dim` features
only. Every backend against the float64 oracle (which rotates those features literally,
where the implementations rotate a permuted layout, `htree_jax.core.rope.rope_layout`), with
K != V; `rope_dim=None` and `rope_dim=K` are today's function bit for bit; the Pallas
backward against the reference's gradients; decoding against the full sequence; errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from htree_jax import HTreeConfig, decode_step, htree_attention, init_cache, prefill
from htree_jax.core.rope import rope_layout, rope_permutation
from reference_numpy import htree_attention_numpy
from tests.conftest import random_qkv
from tests.test_oracle_agreement import assert_matches_oracle

K, V = 64, 32


@pytest.mark.parametrize("backend, G", [("reference", 8), ("pallas_interpret", 8), ("reference", 32),
                                        ("reference", 64)])
@pytest.mark.parametrize("rope_dim, importance", [(32, "softmax"), (2, "shared_max")])
def test_partial_rope_matches_oracle(rng, backend, G, importance, rope_dim):
    config = HTreeConfig(compression_rate=4, top_k=4, importance=importance, rope_dim=rope_dim, selection_block=1)
    T = 150 if G <= 8 else 70  # 3 and 2 layers
    q, k, v = random_qkv(rng, 2 if G <= 8 else 1, T, G, 1, K, V)
    assert_matches_oracle(q, k, v, config, backend=backend)


@pytest.mark.parametrize("head_dim, rope_dim", [(576, 64), (64, 32), (64, 64), (96, 2)])
def test_rope_layout_is_the_permutation_and_its_gradient_no_scatter(rng, head_dim, rope_dim):
    """`rope_layout` equals indexing by `rope_permutation`, and its transpose is slices,
    not a scatter-add over all of q (743 ms at the MLA shape, T=131072, H200)."""
    x = jnp.asarray(rng.standard_normal((2, 3, head_dim)), jnp.float32)
    K, R = head_dim, rope_dim
    order = np.r_[0:(K - R) // 2, K - R:K - R // 2, (K - R) // 2:K - R, K - R // 2:K]  # [nope_lo, rope_lo, nope_hi, rope_hi]
    np.testing.assert_array_equal(rope_permutation(K, R), order)
    np.testing.assert_array_equal(np.asarray(rope_layout(x, rope_dim)),
                                  np.asarray(x)[..., rope_permutation(head_dim, rope_dim)])
    grad = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(rope_layout(x, rope_dim) * jnp.arange(head_dim))))(x)
    assert "scatter" not in str(grad)


@pytest.mark.parametrize("backend", ["reference", "pallas_interpret"])
def test_rope_dim_k_and_none_are_todays_function(rng, backend):
    q, k, v = random_qkv(rng, 1, 150, 4, 2, K, V)
    outs = [htree_attention(q, k, v, HTreeConfig(compression_rate=4, top_k=4, rope_dim=R, selection_block=1), backend=backend)
            for R in (None, K)]
    np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(outs[1]))
    partial = htree_attention(q, k, v, HTreeConfig(compression_rate=4, top_k=4, rope_dim=32), backend=backend)
    assert not np.allclose(np.asarray(partial), np.asarray(outs[0]))


def test_partial_rope_oracle_rotates_only_the_last_features(rng):
    """The oracle's own rule, checked directly: with rope_dim = 2, queries and keys that
    differ only in their first K-2 features give the same scores at any position shift."""
    from reference_numpy.htree_numpy import rope

    x = rng.standard_normal((1, 3, K))
    rotated = rope(x, np.array([0, 5, 9]), 10000.0, rope_dim=2)
    np.testing.assert_array_equal(rotated[..., :K - 2], x[..., :K - 2])
    assert not np.allclose(rotated[0, 1:, K - 2:], x[0, 1:, K - 2:])


def test_pallas_gradients_with_partial_rope_equal_the_reference(rng):
    config = HTreeConfig(compression_rate=4, top_k=4, rope_dim=32)
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, 1, 150, 8, 2, K, V))
    w = jnp.asarray(rng.standard_normal((1, 150, 8, V)), jnp.float32)
    grads = [jax.grad(lambda q, k, v: jnp.sum(htree_attention(q, k, v, config, backend=b) * w), argnums=(0, 1, 2))(
        q, k, v) for b in ("reference", "pallas_interpret")]
    for a, b in zip(*grads):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "pallas_interpret"])
def test_decoding_with_partial_rope_equals_the_full_sequence(rng, backend):
    config = HTreeConfig(compression_rate=4, top_k=4, rope_dim=32)
    T = 60
    q, k, v = random_qkv(rng, 1, T, 8, 2, K, V)
    full = np.asarray(htree_attention(q, k, v, config, backend="reference"))
    cache = init_cache(1, T, 2, K, V, config, jnp.float32)
    o, cache = prefill(q[:, :40], k[:, :40], v[:, :40], cache, config, backend=backend)
    got = [np.asarray(o)]
    for t in range(40, T):
        o_t, cache = decode_step(q[:, t], k[:, t], v[:, t], cache, config, backend=backend)
        got.append(np.asarray(o_t)[:, None])
    np.testing.assert_allclose(np.concatenate(got, axis=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rope_dim, match", [(3, "positive even"), (0, "positive even"), (-2, "positive even"),
                                             (2.0, "positive even"), (True, "positive even")])
def test_bad_rope_dim_in_the_config(rope_dim, match):
    with pytest.raises(ValueError, match=match):
        HTreeConfig(rope_dim=rope_dim, selection_block=1)


def test_rope_dim_above_k_is_refused_before_any_work(rng):
    q, k, v = random_qkv(rng, 1, 8, 2, 1, 8, 8)
    config = HTreeConfig(rope_dim=16)
    with pytest.raises(ValueError, match="rope_dim must be at most the head dim K = 8"):
        htree_attention(q, k, v, config)
    with pytest.raises(ValueError, match="rope_dim must be at most the head dim K = 8"):
        init_cache(1, 8, 1, 8, 8, config, jnp.float32)  # the bound's radii need the feature groups
    mean = HTreeConfig(rope_dim=16, selection="mean")
    cache = init_cache(1, 8, 1, 8, 8, mean, jnp.float32)
    with pytest.raises(ValueError, match="rope_dim must be at most the head dim K = 8"):
        prefill(q, k, v, cache, mean)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
def test_partial_rope_compiled_kernels_match_the_reference(rng):
    """GPU: the compiled forward and backward with rope_dim=32 (K=64, V=32) against the
    reference, float32 (exact float32 products); selections identical but at near-ties:
    a query whose selections differ must be one the float64 oracle flags as fragile, and
    the outputs are compared where every layer agrees."""
    config = HTreeConfig(compression_rate=4, top_k=16, rope_dim=32)  # M = 64: 3 layers at T=2048
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, 1, 2048, 8, 2, K, V))
    o, sel = htree_attention(q, k, v, config, backend="pallas", return_selected=True)
    o_ref, sel_ref = htree_attention(q, k, v, config, backend="reference", return_selected=True)
    agree = np.ones((1, 2048, 2), bool)  # [B, T, H_kv]: every layer's parent list identical
    for a, b in zip(sel, sel_ref):
        agree &= np.all(np.asarray(a) == np.asarray(b), axis=-1)
    assert agree.mean() > 0.999
    _, t_idx, _ = np.nonzero(~agree)
    if len(t_idx):
        picked = np.unique(t_idx)
        _, fragile = htree_attention_numpy(np.asarray(q), np.asarray(k), np.asarray(v), config,
                                           query_positions=picked, return_fragile=True)
        assert np.all(fragile[~agree[:, picked]]), "a selection differs at a query that is not a near-tie"
    heads = np.repeat(agree, 4, axis=2)
    np.testing.assert_allclose(np.asarray(o)[heads], np.asarray(o_ref)[heads], rtol=1e-4, atol=1e-4)
    # The loss leaves out the queries whose selections differ: every gradient comparable.
    w = jnp.asarray(rng.standard_normal((1, 2048, 8, V)) * heads[..., None], jnp.float32)
    grads = [jax.grad(lambda q, k, v: jnp.sum(htree_attention(q, k, v, config, backend=b) * w), argnums=(0, 1, 2))(
        q, k, v) for b in ("pallas", "reference")]
    for a, b in zip(*grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-3)
