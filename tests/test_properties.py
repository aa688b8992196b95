"""SPEC section 3: properties every implementation must show (JAX reference here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from htree_jax import HTreeConfig, build_tree, htree_attention
from htree_jax.core.rope import rope_absolute
from tests.conftest import MULTI_LAYER_CASES, random_qkv
from tests.helpers import leaf_set, softmax_over_leaves


@pytest.mark.parametrize("T, G", [(1, 1), (7, 2), (64, 4), (128, 1)])
@pytest.mark.parametrize("dtype, tol", [(np.float32, 2e-5), (ml_dtypes.bfloat16, 2e-2)])
def test_exact_attention_when_short(rng, T, G, dtype, tol):
    """T <= M: htree is causal softmax attention with RoPE at absolute positions."""
    config = HTreeConfig(compression_rate=8, top_k=16, selection_block=1)  # M = 128
    assert T <= config.max_candidates and config.num_layers(T) == 1
    H_kv, K = 2, 32
    q, k, v = random_qkv(rng, 2, T, G * H_kv, H_kv, K, K, dtype=dtype)  # dense needs V = K
    o, selected = htree_attention(q, k, v, config, return_selected=True)
    assert selected == []
    # Full-precision dots: on GPU the default f32 matmul is TF32 (~1e-3 relative).
    with jax.default_matmul_precision("highest"):
        dense = jax.nn.dot_product_attention(
            rope_absolute(jnp.asarray(q), config.rope_base),
            rope_absolute(jnp.asarray(k), config.rope_base),
            jnp.asarray(v, jnp.float32),
            is_causal=True,
            scale=config.score_scale(K),
        )
    assert o.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(dense), rtol=tol, atol=tol)


@pytest.mark.parametrize("r, top_k, T", MULTI_LAYER_CASES)
@pytest.mark.parametrize("importance", ["softmax", "shared_max"])
def test_tree_cut_partitions_the_past(rng, r, top_k, T, importance):
    """Merged nodes of every query partition [0, t]; those merged above the bottom lie
    wholly before t. Checked for every query, from the selections the reference returns."""
    config = HTreeConfig(compression_rate=r, top_k=top_k, importance=importance, selection_block=1)
    q, k, v = random_qkv(rng, 1, T, 2, 1, 8, 4)
    _, selected = htree_attention(q, k, v, config, return_selected=True)
    selected = [np.asarray(s) for s in selected]
    for t in range(T):
        covered = np.zeros(t + 1, int)
        for l, j, _, _ in leaf_set(t, [s[0, t, 0] for s in selected], config, T):
            start, stop = j * r**l, min((j + 1) * r**l, T)
            if l > 0:
                assert stop <= t, f"t={t}: node ({l}, {j}) merged above the bottom reaches t"
            assert stop <= t + 1
            covered[start:stop] += 1
        np.testing.assert_array_equal(covered, 1, err_msg=f"t={t}: merged nodes do not partition [0, t]")


@pytest.mark.parametrize("r, top_k, T", MULTI_LAYER_CASES[:2])
@pytest.mark.parametrize("importance", ["softmax", "shared_max"])
def test_output_is_softmax_over_leaf_set_shared_by_group(rng, r, top_k, T, importance):
    """SPEC 3 'Equivalence' and 'GQA sharing': every head of a group attends over the
    same leaf set (the one its kv head's selections define), with plain softmax."""
    config = HTreeConfig(compression_rate=r, top_k=top_k, importance=importance, selection_block=1)
    G, H_kv = 4, 2
    q, k, v = random_qkv(rng, 1, T, G * H_kv, H_kv, 8, 4)
    o, selected = htree_attention(q, k, v, config, return_selected=True)
    o, selected = np.asarray(o), [np.asarray(s) for s in selected]
    tree = build_tree(k, v, config)
    for h_kv in range(H_kv):
        k_layers = [np.asarray(kl[0, :, h_kv]) for kl, _ in tree]
        v_layers = [np.asarray(vl[0, :, h_kv]) for _, vl in tree]
        for t in rng.choice(T, size=12, replace=False):
            leaves = leaf_set(t, [s[0, t, h_kv] for s in selected], config, T)
            want = softmax_over_leaves(q[0, t, h_kv * G : (h_kv + 1) * G], k_layers, v_layers, leaves, config)
            np.testing.assert_allclose(o[0, t, h_kv * G : (h_kv + 1) * G], want, rtol=1e-5, atol=1e-5)


def test_gqa_selection_is_a_function_of_the_whole_group(rng):
    """Permuting the heads within a group permutes the outputs and leaves the (shared)
    selections unchanged; MHA (G = 1) runs."""
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    G, H_kv, T = 4, 2, 150
    q, k, v = random_qkv(rng, 1, T, G * H_kv, H_kv, 16, 8)
    perm = np.concatenate([h * G + rng.permutation(G) for h in range(H_kv)])
    o, sel = htree_attention(q, k, v, config, return_selected=True)
    o_p, sel_p = htree_attention(q[:, :, perm], k, v, config, return_selected=True)
    for a, b in zip(sel, sel_p):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(np.asarray(o)[:, :, perm], np.asarray(o_p), rtol=1e-6, atol=1e-6)
    # A group of one head selects for itself: changing another head's query changes
    # nothing in MHA, but does change the shared selection when G > 1.
    q_mha, k_mha, v_mha = random_qkv(rng, 1, T, 2, 2, 16, 8)
    q_other = q_mha.copy()
    q_other[:, :, 1] = rng.standard_normal(q_other[:, :, 1].shape)
    o1 = np.asarray(htree_attention(q_mha, k_mha, v_mha, config))
    o2 = np.asarray(htree_attention(q_other, k_mha, v_mha, config))
    np.testing.assert_array_equal(o1[:, :, 0], o2[:, :, 0])


def test_group_shares_selection_so_other_heads_matter(rng):
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    q, k, v = random_qkv(rng, 1, 150, 2, 1, 16, 8)  # one group of two heads
    _, sel = htree_attention(q, k, v, config, return_selected=True)
    q2 = q.copy()
    q2[:, :, 1] = rng.standard_normal(q2[:, :, 1].shape)
    _, sel2 = htree_attention(q2, k, v, config, return_selected=True)
    assert any(np.any(np.asarray(a) != np.asarray(b)) for a, b in zip(sel, sel2))


@pytest.mark.parametrize("r, top_k, T, importance",
                         [case + (mode,) for case, mode in zip(MULTI_LAYER_CASES, ["softmax", "shared_max"] * 2)])
def test_strict_causality(rng, r, top_k, T, importance):
    """strict_causal=True: o[:t+1] ignores k, v after t; a prefix run (fewer layers)
    gives the same outputs and selections."""
    config = HTreeConfig(compression_rate=r, top_k=top_k, importance=importance, selection_block=1)
    q, k, v = random_qkv(rng, 1, T, 4, 2, 16, 8)
    o, sel = htree_attention(q, k, v, config, return_selected=True)
    o = np.asarray(o)
    for t in [0, 1, T // 3, T // 2 + 1, T - 2]:
        k2, v2 = k.copy(), v.copy()
        k2[:, t + 1 :] = 5 * rng.standard_normal(k2[:, t + 1 :].shape)
        v2[:, t + 1 :] = rng.standard_normal(v2[:, t + 1 :].shape)
        o2, sel2 = htree_attention(q, k2, v2, config, return_selected=True)
        np.testing.assert_array_equal(np.asarray(o2)[:, : t + 1], o[:, : t + 1])
        for a, b in zip(sel, sel2):
            np.testing.assert_array_equal(np.asarray(a)[:, : t + 1], np.asarray(b)[:, : t + 1])
    prefix = T // 2
    o3, sel3 = htree_attention(q[:, :prefix], k[:, :prefix], v[:, :prefix], config, return_selected=True)
    np.testing.assert_allclose(np.asarray(o3), o[:, :prefix], rtol=1e-6, atol=1e-6)
    # The prefix tree may have fewer layers: compare the bottom-most common ones.
    for a, b in zip(sel3[::-1], sel[::-1]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[:, :prefix])


def test_non_strict_causal_may_depend_on_the_future(rng):
    """strict_causal=False puts the rightmost node (a mean over tokens after t) into the
    importance normaliser, so future keys can change the selection and the output at t.
    The same change leaves strict_causal=True outputs untouched."""
    loose = HTreeConfig(compression_rate=4, top_k=4, strict_causal=False, selection_block=1)
    strict = HTreeConfig(compression_rate=4, top_k=4, strict_causal=True, selection_block=1)
    T, t = 150, 70  # t = 70 sits early in its layer-1 and layer-2 nodes (64..79, 64..127)
    changed = 0
    for _ in range(5):
        q, k, v = random_qkv(rng, 1, T, 4, 1, 16, 8)
        k2 = k.copy()
        # Future keys aligned with head 0's query make the rightmost node dominate its
        # normaliser, which reweights the group's importance towards the other heads.
        k2[:, t + 1 :, 0] = 8 * q[:, t, 0][:, None, :]
        o_a = np.asarray(htree_attention(q, k, v, loose))[:, t]
        o_b = np.asarray(htree_attention(q, k2, v, loose))[:, t]
        changed += int(np.abs(o_a - o_b).max() > 1e-4)
        s_a = np.asarray(htree_attention(q, k, v, strict))[:, t]
        s_b = np.asarray(htree_attention(q, k2, v, strict))[:, t]
        np.testing.assert_array_equal(s_a, s_b)
    assert changed > 0


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("importance", ["softmax", "shared_max"])
def test_dtypes_and_huge_scores(rng, dtype, importance):
    """Output dtype = input dtype; scores of ~1e4 give finite outputs inside the
    convex hull of the values (a softmax average)."""
    config = HTreeConfig(compression_rate=4, top_k=4, importance=importance, selection_block=1)
    q, k, v = random_qkv(rng, 2, 150, 4, 2, 16, 8, dtype=dtype)
    o = htree_attention(q, k, v, config)
    assert o.dtype == dtype and o.shape == (2, 150, 4, 8)
    q_big, k_big = (100 * q.astype(np.float32)).astype(dtype), (100 * k.astype(np.float32)).astype(dtype)
    # 16 products of ~1e4 each, times alpha = 1/4: scores around 1e4.
    o_big = np.asarray(htree_attention(q_big, k_big, v, config)).astype(np.float32)
    assert np.all(np.isfinite(o_big))
    vf = v.astype(np.float32)
    lo, hi = vf.min(axis=(1, 2))[:, None, None, :], vf.max(axis=(1, 2))[:, None, None, :]
    assert np.all(o_big >= lo - 1e-2) and np.all(o_big <= hi + 1e-2)


def test_jit_and_vmap(rng):
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    q, k, v = random_qkv(rng, 3, 60, 4, 2, 8, 4)
    eager = np.asarray(htree_attention(q, k, v, config))
    jitted = jax.jit(lambda a, b, c: htree_attention(a, b, c, config))
    np.testing.assert_allclose(np.asarray(jitted(q, k, v)), eager, rtol=1e-6, atol=1e-6)
    # vmap over the batch axis, each call seeing B = 1.
    mapped = jax.vmap(lambda a, b, c: htree_attention(a[None], b[None], c[None], config)[0])
    np.testing.assert_allclose(np.asarray(mapped(q, k, v)), eager, rtol=1e-6, atol=1e-6)


def test_query_chunking_does_not_change_results(rng):
    from htree_jax.reference import htree_attention_reference

    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, 1, 150, 4, 2, 8, 4))
    o_all, s_all = htree_attention_reference(q, k, v, config, query_chunk=150)
    o_7, s_7 = htree_attention_reference(q, k, v, config, query_chunk=7)  # ragged last chunk
    np.testing.assert_allclose(np.asarray(o_7), np.asarray(o_all), rtol=1e-6, atol=1e-6)
    for a, b in zip(s_all, s_7):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
