"""`selection="bound"` (docs/SPEC.md section 11) on the JAX reference: the float64 oracle's
radii and bounds, the reference against the oracle (selections exact but for flagged
near-ties, outputs, importance export), multi-layer trees, both importance modes,
partial RoPE, packed rows, B=2, gradients; and what the bound is for: a node holding one
strong token among weak ones is found where its mean key hides it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from htree_jax import HTreeConfig, decode_step, htree_attention, init_cache, prefill
from htree_jax.core.bounds import group_norms, num_groups, tree_radii
from htree_jax.core.rope import rope_layout
from htree_jax.core.tree import build_tree
from reference_numpy import htree_attention_numpy
from reference_numpy.htree_numpy import build_tree_numpy, feature_groups
from reference_numpy.htree_numpy import tree_radii as tree_radii_numpy
from tests.conftest import MULTI_LAYER_CASES, random_qkv
from tests.helpers import assert_mostly_agrees
from tests.test_oracle_agreement import assert_matches_oracle


def test_config_takes_the_two_rules():
    assert HTreeConfig().selection == "bound"  # the default since 2026-11-26 (issue 48)
    assert HTreeConfig(selection="mean", selection_block=1).selection == "mean"
    with pytest.raises(ValueError, match="selection must be one of"):
        HTreeConfig(selection="max", selection_block=1)


@pytest.mark.parametrize("K, rope_dim", [(16, None), (16, 6), (12, 12)])
def test_radii_equal_the_oracle_and_bound_every_token(rng, K, rope_dim):
    """The reference's radii (feature groups in `rope_layout` order) equal the oracle's
    (original order), and every token under a node lies within them of its mean key."""
    config = HTreeConfig(compression_rate=4, top_k=2, rope_dim=rope_dim, selection_block=1)
    _, k, v = random_qkv(rng, 2, 70, 2, 2, K, 4)
    assert config.num_layers(70) == 3
    layers = build_tree_numpy(k, v, config)
    groups = feature_groups(K, rope_dim)
    want = tree_radii_numpy([kl for kl, _ in layers], config, groups)
    keys = [kl for kl, _ in build_tree(rope_layout(jnp.asarray(k), config.partial_rope(K)),
                                       jnp.asarray(v), config)]
    got = tree_radii(keys, config.compression_rate, config.partial_rope(K))
    assert got[1].shape[-1] == num_groups(K, config.partial_rope(K)) == len(groups)
    # The groups in `rope_layout` order ([lo unrotated, hi unrotated, pairs]) are the
    # oracle's in the original order (the unrotated features, then the pairs).
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-6)
    x = rng.standard_normal((3, K))
    np.testing.assert_allclose(np.asarray(group_norms(rope_layout(jnp.asarray(x), config.partial_rope(K)),
                                                      config.partial_rope(K))),
                               np.stack([np.linalg.norm(x[:, g], axis=-1) for g in groups], -1), rtol=1e-6)
    r = config.compression_rate
    for l in (1, 2):
        for i in range(layers[l][0].shape[1]):
            tokens = k[:, i * r**l: (i + 1) * r**l].astype(np.float64)
            for gi, g in enumerate(groups):
                dist = np.linalg.norm(tokens[..., g] - layers[l][0][:, i:i + 1][..., g], axis=-1)  # [B, n, H]
                assert np.all(dist <= want[l][:, i, None, :, gi] * (1 + 1e-6) + 1e-9)


def one_strong_key(seed=0, T=4096, K=32, G=4):
    """What a mean key hides: every 16-token node holds keys moderately aligned with the
    query (decoys), except one whose fifteen keys are neutral and one is strongly aligned.
    The alignment lives in the 30 unrotated features (`rope_dim=2`), so RoPE's positions
    do not blur it. Returns `(q, k, v, position of the strong key)`."""
    rng = np.random.default_rng(seed)
    direction = np.zeros(K)
    direction[:K - 2] = rng.standard_normal(K - 2)
    direction /= np.linalg.norm(direction)
    q = np.tile(4.0 * direction, (1, T, G, 1)).astype(np.float32)
    k = 0.3 * direction + 0.05 * rng.standard_normal((1, T, 1, K))
    hidden = 1234
    node = slice(hidden // 16 * 16, hidden // 16 * 16 + 16)
    k[0, node, 0] = 0.05 * rng.standard_normal((16, K))
    k[0, hidden, 0] = 2.5 * direction
    v = rng.standard_normal((1, T, 1, 8)).astype(np.float32)
    return q, k.astype(np.float32), v, hidden


def test_bound_finds_the_node_the_mean_hides():
    """The float64 oracle, r=16, top_k=8, one strongly aligned key among 4096 keys: the
    mean rule loses the node holding it (its mean, 2.5/16 along the query, ranks below
    the decoys' 0.3); the bound rule keeps it at every layer, so the query merges the key
    itself; the JAX reference agrees."""
    q, k, v, hidden = one_strong_key()
    t = np.array([4095])
    kept = {}
    for rule in ("mean", "bound"):
        config = HTreeConfig(compression_rate=16, top_k=8, selection=rule, rope_dim=2)
        assert config.layer_sizes(4096) == (4096, 256, 16)
        _, selected = htree_attention_numpy(q, k, v, config, return_selected=True, query_positions=t)
        kept[rule] = hidden // 16 in selected[1][0, 0, 0]  # layer 1's kept nodes
        _, got = htree_attention(q, k, v, config, backend="reference", return_selected=True)
        np.testing.assert_array_equal(np.asarray(got[1])[0, 4095, 0], selected[1][0, 0, 0])
    assert kept == {"mean": False, "bound": True}


@pytest.mark.parametrize("r, top_k, T", MULTI_LAYER_CASES)
@pytest.mark.parametrize("importance", ["softmax", "shared_max"])
def test_reference_matches_oracle_with_bound(rng, r, top_k, T, importance):
    config = HTreeConfig(compression_rate=r, top_k=top_k, importance=importance, selection="bound", selection_block=1)
    assert config.num_layers(T) >= 3
    q, k, v = random_qkv(rng, 2, T, 4, 2, 16, 8)
    assert_matches_oracle(q, k, v, config)


@pytest.mark.parametrize("rope_dim, strict_causal", [(6, True), (16, False)])
def test_reference_matches_oracle_with_bound_partial_rope(rng, rope_dim, strict_causal):
    config = HTreeConfig(compression_rate=4, top_k=4, rope_dim=rope_dim, selection="bound",
                         strict_causal=strict_causal, selection_block=1)
    q, k, v = random_qkv(rng, 2, 150, 4, 2, 16, 8)
    assert_matches_oracle(q, k, v, config)


def test_bound_changes_the_selection(rng):
    """Not a no-op: on random inputs the two rules keep different nodes somewhere."""
    q, k, v = random_qkv(rng, 1, 150, 4, 2, 16, 8)
    sel = {rule: htree_attention(q, k, v, HTreeConfig(compression_rate=4, top_k=4, selection=rule, selection_block=1),
                                 backend="reference", return_selected=True)[1] for rule in ("mean", "bound")}
    assert any(np.any(np.asarray(a) != np.asarray(b)) for a, b in zip(sel["mean"], sel["bound"]))


def test_importance_export_with_bound_matches_the_oracle(rng):
    config = HTreeConfig(compression_rate=4, top_k=4, selection="bound", selection_block=1)
    q, k, v = random_qkv(rng, 2, 150, 4, 2, 16, 8)
    _, sel, imp = htree_attention(q, k, v, config, backend="reference", return_selected=True, return_importance=True)
    _, want_sel, want_imp, fragile = htree_attention_numpy(q, k, v, config, return_selected=True,
                                                           return_importance=True, return_fragile=True)
    robust = ~fragile
    for a, b, x, y in zip(sel, want_sel, imp, want_imp):
        np.testing.assert_array_equal(np.asarray(a)[robust], b[robust])
        np.testing.assert_allclose(np.asarray(x)[robust], y[robust], rtol=1e-4, atol=1e-6)


def test_packed_rows_with_bound_equal_each_document_alone(rng):
    config = HTreeConfig(compression_rate=4, top_k=4, selection="bound", selection_block=1)
    T, lengths = 160, [70, 90]
    q, k, v = random_qkv(rng, 1, T, 4, 2, 16, 8)
    segment_ids = np.repeat([0, 1], lengths)[None].astype(np.int32)
    o = np.asarray(htree_attention(q, k, v, config, backend="reference", segment_ids=segment_ids, max_documents=2))
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        want = htree_attention_numpy(q[:, part], k[:, part], v[:, part], config)
        np.testing.assert_allclose(o[:, part], want, rtol=1e-5, atol=1e-5)
        start += n


def test_gradients_with_bound_match_finite_differences_of_the_reference(rng):
    """The bound only chooses (a constant under autodiff): gradients flow through the
    merged scores and values as with the mean rule."""
    config = HTreeConfig(compression_rate=4, top_k=4, selection="bound", selection_block=1)
    q, k, v = (jnp.asarray(x, jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)
               for x in random_qkv(rng, 1, 40, 2, 1, 8, 4))
    w = jnp.asarray(rng.standard_normal((1, 40, 2, 4)), q.dtype)
    loss = lambda q, k, v: jnp.sum(htree_attention(q, k, v, config, backend="reference") * w)
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    eps = 1e-2
    for arg, g in enumerate(grads):
        direction = jnp.asarray(rng.standard_normal(g.shape), q.dtype)
        args = [q, k, v]
        plus, minus = list(args), list(args)
        plus[arg], minus[arg] = args[arg] + eps * direction, args[arg] - eps * direction
        numeric = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(float(jnp.sum(g * direction)), float(numeric), rtol=2e-2, atol=2e-3)


def test_a_cache_made_for_another_rule_is_refused(rng):
    config = HTreeConfig(compression_rate=4, top_k=4, selection="bound", selection_block=1)
    q, k, v = random_qkv(rng, 1, 40, 2, 1, 32, 32)
    cache = init_cache(1, 64, 1, 32, 32, config)
    with pytest.raises(ValueError, match="made for another selection rule"):
        prefill(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), cache,
                HTreeConfig(compression_rate=4, top_k=4, selection="mean", selection_block=1))
    # Another compression_rate (under the same rule) is named as such, not as another rule.
    with pytest.raises(ValueError, match=r"its layers \(64, 16\) are not those of config .*compression_rate=2"):
        decode_step(jnp.asarray(q[:, 0]), jnp.asarray(k[:, 0]), jnp.asarray(v[:, 0]), cache,
                    HTreeConfig(compression_rate=2, top_k=4, selection="bound", selection_block=1))


ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")]


@pytest.mark.parametrize("backend, H, H_kv, rope_dim", [
    ("pallas_interpret", 4, 2, 6), ("pallas_interpret", 32, 1, None),
    pytest.param("pallas", 4, 2, 6, marks=ON_GPU), pytest.param("pallas", 32, 1, None, marks=ON_GPU)])
def test_decode_kernels_with_bound_equal_the_reference(rng, backend, H, H_kv, rope_dim):
    """The Pallas decode walk ranks by the bound (the cache's radii against the query's
    group norms, one more product beside the scores): a prompt and steps, selections
    identical to the reference walk's (float32). `rope_dim=6` at K=32: 29 feature
    groups, read as pieces of 16, 8, 4 and 1; 32 heads over one kv head: virtual kv
    heads of 16. `pallas`: compiled on a GPU."""
    config = HTreeConfig(compression_rate=4, top_k=4, rope_dim=rope_dim, selection="bound", selection_block=1)
    B, T, K, V, prompt = 2, 60, 32, 32, 37
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, B, T, H, H_kv, K, V))
    results = {}
    for name in (backend, "reference"):
        cache = init_cache(B, 100, H_kv, K, V, config)
        o, cache, sel = prefill(q[:, :prompt], k[:, :prompt], v[:, :prompt], cache, config, backend=name,
                                return_selected=True)
        outs, sels = [o], [sel]
        for t in range(prompt, T):
            o, cache, sel = prefill(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], cache, config, backend=name,
                                    return_selected=True)
            outs.append(o)
            sels.append(sel)
        results[name] = (jnp.concatenate(outs, axis=1), [jnp.concatenate(x, axis=1) for x in zip(*sels)])
    (o, sel), (o_ref, sel_ref) = results[backend], results["reference"]
    assert len(sel) == len(sel_ref) == 2
    for a, b in zip(sel, sel_ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tol = 1e-4 if backend == "pallas" else 1e-5
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), rtol=tol, atol=tol)
    # The rule decides something here: the mean rule keeps other nodes somewhere.
    mean = dataclasses.replace(config, selection="mean")
    _, _, sel_mean = prefill(q, k, v, init_cache(B, 100, H_kv, K, V, mean), mean, backend="reference",
                             return_selected=True)
    assert any(np.any(np.asarray(a) != np.asarray(b)) for a, b in zip(sel_ref, sel_mean))


# ---- the Pallas kernels (interpreted) ------------------------------------------------------


# Each shape with one importance mode (both modes at both shapes: 67 s on 2 cores).
@pytest.mark.parametrize("r, top_k, T, importance", [(*MULTI_LAYER_CASES[0], "shared_max"),
                                                     (*MULTI_LAYER_CASES[1], "softmax")])
def test_kernels_match_the_oracle_with_bound(rng, r, top_k, T, importance):
    """The top layer's keys kernel and the per-query scores kernel rank by the bound (the
    bound product beside the score product); selections exact but for flagged near-ties."""
    config = HTreeConfig(compression_rate=r, top_k=top_k, importance=importance, selection="bound", selection_block=1)
    q, k, v = random_qkv(rng, 2, T, 4, 2, 32, 32)
    assert_matches_oracle(q, k, v, config, backend="pallas_interpret")


def test_kernels_with_bound_partial_rope_export_and_bfloat16(rng):
    config = HTreeConfig(compression_rate=4, top_k=4, rope_dim=8, selection="bound")
    q, k, v = random_qkv(rng, 1, 150, 4, 2, 48, 32)
    assert_matches_oracle(q, k, v, config, backend="pallas_interpret")
    _, sel, imp = htree_attention(q, k, v, config, backend="pallas_interpret", return_selected=True,
                                  return_importance=True)
    _, want_sel, want_imp = htree_attention(q, k, v, config, backend="reference", return_selected=True,
                                            return_importance=True)
    for a, b, x, y in zip(sel, want_sel, imp, want_imp):
        same = np.all(np.asarray(a) == np.asarray(b), axis=-1)
        assert same.mean() > 0.99
        np.testing.assert_allclose(np.asarray(x)[same], np.asarray(y)[same], rtol=1e-4, atol=1e-6)
    import ml_dtypes

    qb, kb, vb = (x.astype(ml_dtypes.bfloat16) for x in (q, k, v))
    o, sel = htree_attention(qb, kb, vb, config, backend="pallas_interpret", return_selected=True)
    want, want_sel = htree_attention(qb, kb, vb, config, backend="reference", return_selected=True)
    for a, b in zip(sel, want_sel):
        assert np.mean(np.all(np.asarray(a) == np.asarray(b), axis=-1)) > 0.98


def test_kernels_with_bound_on_packed_rows_and_large_groups(rng):
    config = HTreeConfig(compression_rate=4, top_k=4, selection="bound", selection_block=1)
    T, lengths = 160, [70, 90]
    q, k, v = random_qkv(rng, 1, T, 4, 2, 32, 32)
    segment_ids = np.repeat([0, 1], lengths)[None].astype(np.int32)
    got = htree_attention(q, k, v, config, backend="pallas_interpret", segment_ids=segment_ids, max_documents=2)
    want = htree_attention(q, k, v, config, backend="reference", segment_ids=segment_ids, max_documents=2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # 32 heads over one kv head: virtual kv heads of 16, selections made from the whole group.
    q, k, v = random_qkv(rng, 1, 150, 32, 1, 32, 32)
    assert_matches_oracle(q, k, v, config, backend="pallas_interpret")


# The saved selections (the default); recomputing them in the backward is compared
# bitwise with saving them in test_pallas_backward.
@pytest.mark.parametrize("save_selections", [True])
def test_kernel_gradients_with_bound_equal_the_reference(rng, save_selections):
    from htree_jax import BlockSizes

    config = HTreeConfig(compression_rate=4, top_k=4, selection="bound", selection_block=1)
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, 1, 150, 4, 2, 32, 32))
    w = jnp.asarray(rng.standard_normal((1, 150, 4, 32)), jnp.float32)
    # Saved selections: node lists cut after 8 entries (the spill through the whole
    # backward); recomputed: never cut.
    sizes = BlockSizes(save_selections=save_selections, node_entries=8 if save_selections else 0)

    def grads(backend):
        loss = lambda q, k, v: jnp.sum(htree_attention(q, k, v, config, backend=backend, block_sizes=sizes) * w)
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    for got, want in zip(grads("pallas_interpret"), grads("reference")):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_cache_radii_equal_the_whole_trees(rng):
    """The radii a decode cache keeps, a prompt then token by token, ragged rows, partial
    RoPE and bf16 keys, equal those of the whole tree of each row's tokens bit for bit."""
    config = HTreeConfig(compression_rate=4, top_k=2, rope_dim=6, selection="bound")
    B, H_kv, K = 2, 2, 16
    _, k, v = random_qkv(rng, B, 70, 2, H_kv, K, 4)
    k, v = (jnp.asarray(x, jnp.bfloat16) for x in (k, v))
    lengths = np.array([45, 23])
    cache = init_cache(B, 80, H_kv, K, 4, config, jnp.bfloat16)
    q = jnp.zeros((B, 45, 2, K), jnp.bfloat16)
    _, cache = prefill(q, k[:, :45], v[:, :45], cache, config, lengths=jnp.asarray(lengths))
    for t in range(25):
        rows = np.minimum(lengths + t, 69)
        _, cache = decode_step(jnp.zeros((B, 2, K), jnp.bfloat16), k[np.arange(B), rows], v[np.arange(B), rows],
                               cache, config)
    R = config.partial_rope(K)
    for b in range(B):
        n = int(cache.lengths[b])
        tokens = np.r_[np.arange(lengths[b]), np.minimum(lengths[b] + np.arange(25), 69)][:n]
        layers = build_tree(rope_layout(k[b:b + 1, tokens], R), v[b:b + 1, tokens], config)
        want = tree_radii([kl for kl, _ in layers], config.compression_rate, R)
        for l in range(1, len(want)):
            got = np.asarray(cache.radii[l - 1][b, :want[l].shape[1]])
            np.testing.assert_array_equal(got, np.asarray(want[l][0]))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_compiled_kernels_with_bound_equal_the_reference(rng, dtype):
    """GPU: the compiled kernels rank by the bound as the reference does (3 layers, both
    lower paths: the top layer's keys kernel and the per-query scores kernel)."""
    config = HTreeConfig(compression_rate=16, top_k=16, selection="bound", selection_block=1)
    q, k, v = (jnp.asarray(x, dtype) for x in random_qkv(rng, 1, 8192, 8, 2, 64, 64))
    assert config.num_layers(8192) == 3
    o, sel = htree_attention(q, k, v, config, backend="pallas", return_selected=True)
    o_r, sel_r = htree_attention(q, k, v, config, backend="reference", return_selected=True)
    assert_mostly_agrees(o, sel, o_r, sel_r, 4, tol=1e-5 if dtype == jnp.float32 else 2e-2)
