"""Pallas kernels in interpret mode against their pure-JAX twins, and the whole Pallas
backend against the JAX reference and the float64 oracle (small multi-layer configs).
On a GPU the same kernels run compiled in `tools/check_pallas_gpu.py`."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from htree_jax import HTreeConfig, htree_attention
from htree_jax.core.indexing import top_layer_parents
from htree_jax.core.packing import pack_layout, virtual_length
from htree_jax.core.rope import rope_layout
from pallas_kernels.gqa.forward import htree_forward_pallas
from pallas_kernels.gqa.merge import merge_pallas, merge_scored_pallas, merge_scored_twin, merge_twin
from pallas_kernels.gqa.plan import layout
from pallas_kernels.gqa.top_layer import top_importance_keys_pallas, top_merge_pallas
from pallas_kernels.shared.common import LayerInputs, LayerStatic, TopInputs, pad_axis, pad_nodes, pad_rope_halves
from pallas_kernels.shared.configs import BlockSizes, KernelConfigs
from pallas_kernels.shared.importance import importance_keys_pallas, importance_keys_twin
from pallas_kernels.shared.precision import BF16X3, key_operands
from pallas_kernels.shared.rope import padded_rope_table, rotate_keys, rotate_phases, rotate_queries
from pallas_kernels.shared.top_k import select_top_k_pallas, select_top_k_twin
from pallas_kernels.shared.tree_build import pool_layer_pallas, pool_layer_twin
from pallas_kernels.wide.forward import wide_forward_pallas
from tests.conftest import random_qkv
from tests.test_oracle_agreement import assert_matches_oracle


# Each size once, the dtypes spread over them (all twelve pairs before 2026-11-28 (3)).
@pytest.mark.parametrize("r, N, dtype", [(4, 150, np.float32), (16, 1000, ml_dtypes.bfloat16), (2, 7, np.float16),
                                         (8, 8, np.float32), (4, 150, np.float16)])
def test_pool_kernel_equals_twin(rng, r, N, dtype):
    x = jnp.asarray(rng.standard_normal((2, 3, N, 32)).astype(dtype))
    got = pool_layer_pallas(x, r, interpret=True)
    want = pool_layer_twin(x, r)
    assert got.dtype == x.dtype and got.shape == want.shape == (2, 3, -(-N // r), 32)
    # the same float32 sums in the same order, times the same reciprocals: bit for bit
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("r, top_k", [(4, 4), (2, 8), (16, 16)])
def test_top_k_kernel_equals_twin(rng, r, top_k):
    """The shared top-K kernel on packed keys with ties (equal importance, broken by
    position) and every count of valid candidates, against `lax.top_k` and a sort."""
    config = HTreeConfig(compression_rate=r, top_k=top_k, selection_block=1)
    M, log_n = config.max_candidates, config.log_n
    B, Q, H_kv = 2, 12, 1
    imp = rng.random((B, Q, H_kv, M)).astype(np.float32)
    imp[:, :3] = 0.0  # ties: all equal, broken by position
    imp[:, 3:6] = np.round(imp[:, 3:6], 1)  # many equal values
    mask = (1 << log_n) - 1
    keys = (imp.view(np.int32) & ~mask) | (mask - np.arange(M, dtype=np.int32))
    parents = np.full((B, Q, H_kv, M // r), -1, np.int32)
    n = np.zeros((B, Q, H_kv, 1), np.int32)
    for idx in np.ndindex(B, Q, H_kv):
        count = rng.integers(1, M // r + 1)
        parents[idx][:count] = np.sort(rng.choice(4 * M // r, size=count, replace=False))
        n[idx] = (count - 1) * r + rng.integers(0, r) + 1
    keys = np.where(np.arange(M) < n, keys, -1).astype(np.int32)
    st = LayerStatic(r=r, tile=M, group=1, alpha=1.0, importance="softmax", strict_causal=True, log_n=log_n,
                     top_k=top_k, precision=jax.lax.Precision.HIGHEST)
    args = (jnp.asarray(keys), jnp.asarray(parents), jnp.asarray(n))
    got_next, got_tau = select_top_k_pallas(*args, st, interpret=True)
    want_next, want_tau = select_top_k_twin(*args, st)
    np.testing.assert_array_equal(np.asarray(got_tau), np.asarray(want_tau))
    np.testing.assert_array_equal(np.asarray(got_next)[..., :top_k], np.asarray(want_next)[..., :top_k])
    assert np.all((np.asarray(got_next) >= 0).sum(axis=-1) == np.minimum(top_k, n[..., 0]))


def layer_inputs(rng, config, G, K, V, Q=8, N=None, dtype=np.float32, block_queries=1,
                  block_sizes=BlockSizes()):
    """Random but consistent inputs of one upper layer: ascending parent lists and `n`,
    one per block of `block_queries` queries (which share them)."""
    r = config.compression_rate
    span, tile, P, Mp = layout(config, KernelConfigs.resolve(block_sizes, K, V))
    gp, kp, vp = 16, 32, 32
    B, H_kv = 2, 2
    N = N or r * (config.top_k + 5)
    parents = np.full((B, Q // block_queries, H_kv, P), -1, np.int32)
    n = np.zeros((B, Q // block_queries, H_kv, 1), np.int32)
    for idx in np.ndindex(*n.shape[:3]):
        count = rng.integers(1, config.top_k + 1)
        chosen = np.sort(rng.choice(N // r, size=count, replace=False))
        parents[idx][:count] = chosen
        n[idx] = (count - 1) * r + rng.integers(0, r) + 1
    q = pad_axis(pad_rope_halves(jnp.asarray(rng.standard_normal((B, Q, H_kv, G, K)).astype(dtype)), kp // 2), 3, gp)
    layer_k = pad_rope_halves(jnp.asarray(rng.standard_normal((B, H_kv, N, K)).astype(dtype)), kp // 2)
    layer_v = pad_axis(jnp.asarray(rng.standard_normal((B, H_kv, N, V)).astype(dtype)), -1, vp)
    cos, sin = padded_rope_table(Mp, K, config.rope_base, kp // 2)
    st = LayerStatic(r=r, tile=tile, span=span, group=G, alpha=config.score_scale(K), importance=config.importance,
                     strict_causal=config.strict_causal, log_n=config.log_n, top_k=config.top_k,
                     precision=jax.lax.Precision.HIGHEST, block_queries=block_queries)
    m0 = jnp.asarray(rng.standard_normal((B, Q, H_kv, gp)).astype(np.float32))
    state = (m0, jnp.exp(jnp.asarray(rng.standard_normal((B, Q, H_kv, gp)).astype(np.float32))),
             jnp.asarray(rng.standard_normal((B, Q, H_kv, gp, vp)).astype(np.float32)))
    return dict(q=q, parents=jnp.asarray(parents), n=jnp.asarray(n), layer_k=layer_k, layer_v=layer_v,
                cos=cos, sin=sin, state=state, st=st)


LAYER_CONFIGS = [
    HTreeConfig(compression_rate=4, top_k=4, selection_block=1),
    HTreeConfig(compression_rate=8, top_k=8, importance="shared_max", selection_block=1),
    HTreeConfig(compression_rate=2, top_k=16, strict_causal=False, selection_block=1),
    HTreeConfig(compression_rate=16, top_k=16, selection_block=1),
]


def paired(configs, variants):
    """Each config with one variant, cycling (every config and variant appears; CI time
    rules out the full product of interpreted kernels): `[(config, *variant), ...]`."""
    count = max(len(configs), len(variants))
    return [(configs[i % len(configs)],) + tuple(variants[i % len(variants)]) for i in range(count)]


@pytest.mark.parametrize("config, G, block_queries, block_sizes", paired(LAYER_CONFIGS, [
    (1, 1, BlockSizes()), (3, 1, BlockSizes(span=16, tile=32)), (2, 4, BlockSizes(span=32, tile=64))]), ids=str)
def test_layer_kernels_equal_twins(rng, config, G, block_queries, block_sizes):
    a = layer_inputs(rng, config, G=G, K=24, V=20, block_queries=block_queries, block_sizes=block_sizes)
    st = a["st"]
    phases = rotate_phases(a["layer_k"], a["cos"], a["sin"], st)
    k_rot = key_operands(phases, st.precision)
    layer = lambda k, keys=None, tau=None, v=None: LayerInputs(a["parents"], a["n"], keys, tau, k, v, a["cos"], a["sin"])
    keys = importance_keys_pallas(a["q"], layer(k_rot), st, True)
    keys_twin = importance_keys_twin(a["q"], a["parents"], a["n"], a["layer_k"], a["cos"], a["sin"], st)
    # The exact selection is checked via the same keys below.
    _assert_same_keys(keys, keys_twin, st.log_n)
    # 3xTF32 products (bf16 inputs' default) read the keys split into hi and lo.
    st_high = dataclasses.replace(st, precision=jax.lax.Precision.HIGH)
    k_high = key_operands(phases, st_high.precision)
    assert len(k_high) == 2
    keys_high = importance_keys_pallas(a["q"], layer(k_high), st_high, True)
    _assert_same_keys(keys_high, keys_twin, st.log_n)
    # ... or as bfloat16 pairs (BF16X3, ~4e-6 relative).
    st_x3 = dataclasses.replace(st_high, importance_operands=BF16X3)
    k_x3 = key_operands(phases, st_x3.precision, BF16X3)
    assert len(k_x3) == 2 and k_x3[0].dtype == jnp.bfloat16
    keys_x3 = importance_keys_pallas(a["q"], layer(k_x3), st_x3, True)
    _assert_same_keys(keys_x3, keys_twin, st.log_n)

    per_query = lambda x: jnp.repeat(x, block_queries, axis=1)
    nxt, tau = select_top_k_pallas(keys, per_query(a["parents"]), per_query(a["n"]), st, True)
    nxt_t, tau_t = select_top_k_twin(keys, per_query(a["parents"]), per_query(a["n"]), st)
    np.testing.assert_array_equal(np.asarray(tau), np.asarray(tau_t))
    np.testing.assert_array_equal(np.asarray(nxt)[..., : st.top_k], np.asarray(nxt_t)[..., : st.top_k])

    args = (a["q"], layer(a["layer_k"], keys, tau, a["layer_v"]), a["state"], st)
    # The merge from the scores the importance pass stored (what the forward runs above
    # the bottom): against the twin on the same scores, and against scoring afresh.
    _, scores = importance_keys_pallas(a["q"], layer(k_rot), st, True, return_scores=True)
    scored = merge_scored_pallas(scores, a["parents"], a["n"], keys, tau, a["layer_v"], a["state"], st, True)
    scored_twin = merge_scored_twin(scores, a["parents"], a["n"], keys, tau, a["layer_v"], a["state"], st)
    # The kernel rotates the query once per span (relative RoPE), the twin each key by
    # its position: scores differ by ~1e-7 relative, and U, a sum of many signed terms,
    # can cancel to ~1e-2 (seen: 1.07e-5 absolute on 0.0195), hence atol 5e-5 there.
    for got, same, want in zip(scored, scored_twin, merge_twin(*args)):
        # Same scores, another summation order (U cancels, as above).
        np.testing.assert_allclose(np.asarray(got), np.asarray(same), rtol=1e-5, atol=3e-5)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=5e-5)

    # The bottom layer: every valid candidate merged, scored in the kernel, normalised.
    bottom = (a["q"], layer(a["layer_k"], v=a["layer_v"]), a["state"], st)
    o = merge_pallas(a["q"], layer(k_rot, v=a["layer_v"]), a["state"], st, interpret=True)
    o_t = merge_twin(*bottom)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_t), rtol=1e-5, atol=1e-5)
    # bfloat16 dot operands and keys stored rotated in bfloat16 (the default for bf16
    # inputs): output precision only.
    st_bf16 = dataclasses.replace(st, merge_operands="bfloat16", merge_precision=jax.lax.Precision.DEFAULT)
    k_bf16 = key_operands(phases, st_bf16.merge_precision, "bfloat16")
    o = merge_pallas(a["q"], layer(k_bf16, v=a["layer_v"]), a["state"], st_bf16, interpret=True)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_t), rtol=3e-2, atol=3e-2)
    assert not np.allclose(np.asarray(o), np.asarray(o_t), rtol=1e-6, atol=1e-6)  # it did round


def _assert_same_keys(got, want, log_n):
    """Packed keys may differ in the last float32 bits kept (summation order): compare
    validity and positions exactly and the importance they encode to one bucket."""
    mask = (1 << log_n) - 1
    kp, kt = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(kp < 0, kt < 0)
    np.testing.assert_array_equal(kp & mask, kt & mask)
    imp_p = (np.where(kp < 0, 0, kp) & ~mask).view(np.float32)
    imp_t = (np.where(kt < 0, 0, kt) & ~mask).view(np.float32)
    np.testing.assert_allclose(imp_p, imp_t, rtol=2e-3)  # one bucket of 10 mantissa bits


def top_layer_inputs(rng, config, G):
    """`layer_inputs` cut to a top layer (`N <= Mp` nodes, virtual parents): `(a, layer_k,
    layer_v, n, parents, q)`, every query with its own `n`, `q` with `next_power_of_two(G)`
    rows."""
    a = layer_inputs(rng, config, G=G, K=24, V=20, Q=16)
    Mp = a["cos"].shape[0]
    N = min(a["layer_k"].shape[2], Mp)
    n = jnp.asarray(rng.integers(1, N + 1, size=a["n"].shape[:3] + (1,)).astype(np.int32))
    n = n.at[0, :3].set(1).at[1, 3].set(N)  # a lone candidate (rightmost only), and all of them
    n = jnp.broadcast_to(n[:, :, :1], n.shape) if G == 3 else n  # heads of a query share n
    # The top layer's virtual parents of a query with n candidates (t = n - 1 at L = 1).
    parents = top_layer_parents(n[..., 0] - 1, config.compression_rate, 1, Mp // config.compression_rate)
    q = a["q"][:, :, :, : 1 << (G - 1).bit_length()]
    return a, a["layer_k"][:, :, :N], a["layer_v"][:, :, :N], n, parents, q


@pytest.mark.parametrize("config, G, block_queries, top_tile",
                         paired(LAYER_CONFIGS, [(1, 16, 16), (3, 4, 32), (8, 2, 16)]), ids=str)
def test_top_layer_kernels_equal_twins(rng, config, G, block_queries, top_tile):
    """The top layer's block kernels against the per-query twins with virtual parents;
    every query of a block has its own `n` (as at L = 1, or blocks across top nodes)."""
    a, layer_k, layer_v, n, parents, q = top_layer_inputs(rng, config, G)
    st, Mp = a["st"], a["cos"].shape[0]
    top_tile = min(top_tile, Mp)
    st_top = dataclasses.replace(st, block_queries=block_queries, tile=top_tile)
    q_rot = rotate_queries(q, n, a["cos"], a["sin"])
    rotated = rotate_keys(layer_k, a["cos"], a["sin"], top_tile)
    k_rot = key_operands(rotated, st.precision)

    # first=None: one document per row (no per-document loop); zeros: the packed form.
    for first in (None, jnp.zeros_like(n)):
        top = lambda k, keys=None, tau=None, v=None, first=first: TopInputs(n, first, keys, tau, k, v)
        keys = top_importance_keys_pallas(q_rot, top(k_rot), Mp, st_top, interpret=True)
        keys_twin = importance_keys_twin(q, parents, n, layer_k, a["cos"], a["sin"], st)
        _assert_same_keys(keys, keys_twin, st.log_n)
        st_high = dataclasses.replace(st_top, precision=jax.lax.Precision.HIGH)
        keys_high = top_importance_keys_pallas(q_rot, top(key_operands(rotated, st_high.precision)), Mp, st_high,
                                               interpret=True)
        _assert_same_keys(keys_high, keys_twin, st.log_n)
        st_x3 = dataclasses.replace(st_high, importance_operands=BF16X3)
        keys_x3 = top_importance_keys_pallas(q_rot, top(key_operands(rotated, st_high.precision, BF16X3)), Mp, st_x3,
                                             interpret=True)
        _assert_same_keys(keys_x3, keys_twin, st.log_n)

        _, tau = select_top_k_twin(keys, parents, n, st)
        state = tuple(x[:, :, :, : q.shape[3]] for x in a["state"])
        twin_layer = lambda keys=None, tau=None: LayerInputs(parents, n, keys, tau, layer_k, layer_v, a["cos"], a["sin"])
        got = top_merge_pallas(q_rot, top(k_rot, keys, tau, pad_nodes(layer_v, top_tile)), state, st_top, interpret=True)
        want = merge_twin(q, twin_layer(keys, tau), state, st)
        for x, y in zip(got, want):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)

        o = top_merge_pallas(q_rot, top(k_rot, v=pad_nodes(layer_v, top_tile)), state, st_top, interpret=True)
        o_t = merge_twin(q, twin_layer(), state, st)
        np.testing.assert_allclose(np.asarray(o), np.asarray(o_t), rtol=1e-5, atol=1e-5)
        st_bf16 = dataclasses.replace(st_top, merge_operands="bfloat16", merge_precision=jax.lax.Precision.DEFAULT)
        k_bf16 = key_operands(rotated, st_bf16.merge_precision, "bfloat16")
        o = top_merge_pallas(q_rot, top(k_bf16, v=pad_nodes(layer_v, top_tile)), state, st_bf16, interpret=True)
        np.testing.assert_allclose(np.asarray(o), np.asarray(o_t), rtol=3e-2, atol=3e-2)


BACKEND_CASES = [
    # (r, top_k, T, G, importance, strict_causal)
    (4, 4, 150, 4, "shared_max", False),
    (8, 8, 200, 4, "shared_max", True),
    (2, 4, 77, 2, "softmax", True),
]


@pytest.mark.parametrize("r, top_k, T, G, importance, strict_causal", BACKEND_CASES)
def test_pallas_backend_equals_reference_and_oracle(rng, r, top_k, T, G, importance, strict_causal):
    config = HTreeConfig(compression_rate=r, top_k=top_k, importance=importance, strict_causal=strict_causal, selection_block=1)
    assert config.num_layers(T) >= 2
    q, k, v = random_qkv(rng, 2, T, 2 * G, 2, 40, 36)  # non-power-of-two dims: padded inside
    o, sel = htree_attention(q, k, v, config, backend="pallas_interpret", return_selected=True)
    o_ref, sel_ref = htree_attention(q, k, v, config, backend="reference", return_selected=True)
    for a, b in zip(sel, sel_ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), rtol=1e-5, atol=1e-5)
    assert_matches_oracle(q, k, v, config, backend="pallas_interpret")


@pytest.mark.parametrize("G", [2, 8])
def test_pallas_backend_eight_query_rows(rng, G):
    """A group padded to 8 product rows below the top layer (`BlockSizes.min_query_rows`)
    instead of 16, through a 3-layer tree: the same selections and output."""
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    assert config.num_layers(150) >= 3
    q, k, v = random_qkv(rng, 1, 150, 2 * G, 2, 32, 32)
    o, sel = htree_attention(q, k, v, config, backend="pallas_interpret", return_selected=True,
                             block_sizes=BlockSizes(min_query_rows=8))
    o_ref, sel_ref = htree_attention(q, k, v, config, backend="reference", return_selected=True)
    for a, b in zip(sel, sel_ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="min_query_rows must be 8 or 16"):
        BlockSizes(min_query_rows=4)


def test_pallas_backend_bfloat16(rng):
    config = HTreeConfig(compression_rate=16, top_k=4, selection_block=1)
    q, k, v = random_qkv(rng, 1, 300, 4, 2, 32, 32, dtype=ml_dtypes.bfloat16)
    o = htree_attention(q, k, v, config, backend="pallas_interpret")
    assert o.dtype == q.dtype
    assert_matches_oracle(q, k, v, config, rtol=2e-2, atol=2e-2, backend="pallas_interpret")


@pytest.mark.parametrize(
    "shape, match",
    [
        (dict(K=16), "head dim K in \\[32, 576\\]"),
        (dict(K=578), "head dim K in \\[32, 576\\]"),
        (dict(V=8), "value dim V in \\[32, 512\\]"),
        (dict(G=24), "at most 16 query heads per kv head, or a multiple of 16 up to 128"),
    ],
)
def test_pallas_backend_rejects_unsupported_dims(monkeypatch, shape, match):
    import pallas_kernels.gqa.attention as fwd

    monkeypatch.setattr(fwd, "htree_forward_pallas", lambda *a, **k: pytest.fail("launched"))
    dims = dict(K=32, V=32, G=2) | shape
    q = np.ones((1, 8, dims["G"], dims["K"]), np.float32)
    k = np.ones((1, 8, 1, dims["K"]), np.float32)
    v = np.ones((1, 8, 1, dims["V"]), np.float32)
    with pytest.raises(ValueError, match=match):
        htree_attention(q, k, v, backend="pallas_interpret")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU error")
def test_pallas_without_gpu_says_how_to_interpret():
    q, k, v = (np.ones((1, 8, 2, 32), np.float32) for _ in range(3))
    with pytest.raises(ValueError, match="pallas_interpret"):
        htree_attention(q, k[:, :, :1], v[:, :, :1], backend="pallas")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
def test_pallas_compiled_equals_reference_on_gpu(rng):
    config = HTreeConfig(compression_rate=16, top_k=16, selection_block=1)
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, 1, 4096, 8, 2, 64, 64))
    o, sel = htree_attention(q, k, v, config, backend="pallas", return_selected=True)
    o_ref, sel_ref = htree_attention(q, k, v, config, backend="reference", return_selected=True)
    for a, b in zip(sel, sel_ref):
        assert np.mean(np.all(np.asarray(a) == np.asarray(b), axis=-1)) >= 0.999
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("B, T, G, r, top_k", [(1, 1, 2, 4, 4), (3, 2, 2, 2, 2), (1, 5, 16, 2, 2), (2, 40, 16, 4, 2)])
def test_pallas_backend_edge_sizes(rng, B, T, G, r, top_k):
    """T = 1, tiny T, B = 3 and the largest group (G = 16), down to 3-layer trees."""
    config = HTreeConfig(compression_rate=r, top_k=top_k, selection_block=1)
    q, k, v = random_qkv(rng, B, T, G * (2 if T == 40 else 1), 2 if T == 40 else 1, 32, 32)
    o, sel = htree_attention(q, k, v, config, backend="pallas_interpret", return_selected=True)
    o_ref, sel_ref = htree_attention(q, k, v, config, backend="reference", return_selected=True)
    for a, b in zip(sel, sel_ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family, G, selection, packed, export", [
    ("gqa", 2, "mean", False, True), ("gqa", 16, "bound", False, False), ("gqa", 32, "mean", False, True),
    ("gqa", 4, "bound", True, True), ("wide", 32, "bound", False, True), ("wide", 32, "mean", False, False)])
def test_the_ranking_pass_selects_as_the_forward_does(rng, family, G, selection, packed, export):
    """`selections_only=True` (block selection's ranking pass, `routes.block_selections`)
    runs no merge and returns the forward's selections and importance bit for bit:
    3-layer trees, queries at some positions or packed rows, split heads (G = 32 on the
    GQA kernels), the wide kernels; `return_lse` beside it is refused."""
    config = HTreeConfig(compression_rate=4, top_k=4, selection=selection, selection_block=1)
    q, k, v = random_qkv(rng, 2, 100, G, 1, 64, 32)
    R = config.partial_rope(64)
    q, k, v = rope_layout(jnp.asarray(q), R), rope_layout(jnp.asarray(k), R), jnp.asarray(v)
    forward = htree_forward_pallas if family == "gqa" else wide_forward_pallas
    places = {}
    if packed:
        segments = jnp.asarray([[0] * 60 + [1] * 40, [0] * 100])
        places["packing"] = pack_layout(segments, config, virtual_length(config, 100, 2))
    else:
        places["positions"] = jnp.arange(30, 100, dtype=jnp.int32)
        q = q[:, 30:]
    run = lambda only: forward(q, k, v, config=config, block_sizes=BlockSizes(), interpret=True,
                               return_importance=export, selections_only=only, **places)
    full, ranked = run(False), run(True)
    assert ranked[0] is None and full[0].shape == q.shape[:3] + (32,)
    assert len(ranked[1]) == len(full[1]) == 2
    for a, b in zip(jax.tree.leaves(ranked[1:]), jax.tree.leaves(full[1:])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="return_lse"):
        forward(q, k, v, config=config, interpret=True, return_lse=True, selections_only=True, **places)
