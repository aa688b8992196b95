"""Pallas backward kernels (interpret mode) against their autodiff twins, and the Pallas
backend's gradients against the JAX reference's."""

from __future__ import annotations

import dataclasses

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from htree_jax import HTreeConfig, htree_attention
from htree_jax.core.rope import apply_rope
from pallas_kernels.gqa.backward import htree_backward_pallas
from pallas_kernels.gqa.forward import htree_forward_pallas
from pallas_kernels.gqa.layer_backward import layer_backward_pallas, layer_backward_twin
from pallas_kernels.gqa.node_backward import layer_node_grads_pallas
from pallas_kernels.gqa.top_backward import (
    MAX_SEGMENTS,
    top_backward_queries,
    top_backward_statics,
    top_dq_pallas,
    top_node_grads_pallas,
)
from pallas_kernels.gqa.top_layer import top_importance_keys_pallas
from pallas_kernels.shared.common import (LayerInputs, LayerStatic, RowStats, TopInputs, next_power_of_two, pad_nodes,
                                         zeros_after)
from pallas_kernels.shared.configs import UNIT_ENTRIES, BlockSizes, LayerConfig, TopBackwardConfig
from pallas_kernels.shared.importance import importance_keys_pallas
from pallas_kernels.shared.node_index import UNIT, node_buffers, node_gradient, node_index, spill_segments
from pallas_kernels.shared.precision import BF16X3, key_operands
from pallas_kernels.shared.rope import rotate_keys, rotate_phases, rotate_queries
from pallas_kernels.shared.top_k import select_top_k_pallas, select_top_k_twin
from pallas_kernels.shared.tree_backward import kept_keys
from tests.conftest import random_qkv
from tests.test_pallas_kernels import LAYER_CONFIGS, layer_inputs, paired, top_layer_inputs


def _row_stats(rng, shape, vp):
    """`lse, delta [.., Gp]` and `do [.., Gp, Vp]` like a forward's (lse around the
    scores' scale so that the weights are O(1))."""
    lse = jnp.asarray(rng.standard_normal(shape).astype(np.float32) + 2.0)
    delta = jnp.asarray(rng.standard_normal(shape).astype(np.float32))
    do = jnp.asarray(rng.standard_normal(shape + (vp,)).astype(np.float32))
    return lse, delta, do


def _assert_gradients_close(got, want, atol=5e-5):
    """Sums of signed terms in another order: the error scales with the largest
    gradient (CI: 4.1e-5 on an entry of 0.08 where the largest was 17). `atol`: the
    floor (more where the sums were added to accumulators of order 1 and taken back
    out, which rounds them to float32 steps of those)."""
    for g, w in zip(got, want):
        scale = float(np.max(np.abs(np.asarray(w))))
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=max(atol, 1e-5 * scale))


# r = 32: a parent's children span two units of the node kernels.
NODE_CONFIGS = LAYER_CONFIGS + [HTreeConfig(compression_rate=32, top_k=4, selection_block=1)]


@pytest.mark.parametrize("config, G, block_sizes, entries_per_step, entries_per_program", paired(NODE_CONFIGS, [
    (1, BlockSizes(), None, UNIT_ENTRIES), (3, BlockSizes(span=16, tile=32), 4, 3), (2, BlockSizes(), None, 8)]),
    ids=str)
def test_layer_backward_equals_twin(rng, config, G, block_sizes, entries_per_step, entries_per_program):
    """The layer's gradients against the twin: `dq` from the per-query kernel, `dk`, `dv`
    from the node kernel (per unit of nodes, through the inverse index; with few
    `entries_per_program`, most units' lists spill into segments summed apart)."""
    a = layer_inputs(rng, config, G=G, K=24, V=20, block_sizes=block_sizes)
    st = a["st"]
    B, Q, H_kv, gp, kp = a["q"].shape
    N, vp = a["layer_k"].shape[2], a["layer_v"].shape[-1]
    lse, delta, do = _row_stats(rng, (B, Q, H_kv, gp), vp)
    phases = key_operands(rotate_phases(a["layer_k"], a["cos"], a["sin"], st), st.precision)
    layer = lambda k, keys=None, tau=None: LayerInputs(a["parents"], a["n"], keys, tau, k, a["layer_v"], a["cos"],
                                                       a["sin"])
    keys = importance_keys_pallas(a["q"], layer(phases), st, True)
    _, tau = select_top_k_pallas(keys, a["parents"], a["n"], st, True)
    gt = next_power_of_two(G)
    index = node_index(a["parents"], a["n"], st.r, -(-N // UNIT), entries_per_program)
    if entries_per_program < UNIT_ENTRIES:
        assert int(jnp.max(index.segments[..., 3])) > 0  # the case is the split's
    for k_, t_ in [(keys, tau), (None, None)]:
        dq = layer_backward_pallas(a["q"], layer(phases, k_, t_), RowStats(lse, do, delta), st, True)
        # The node kernel adds to what the accumulators hold (earlier chunks' sums).
        before = _random_accumulators(rng, node_buffers(B, H_kv, N, kp, vp))
        dk_acc, dv_acc = layer_node_grads_pallas(
            a["q"][:, :, :, :gt], layer(phases, k_, t_), RowStats(lse[..., :gt], do[..., :gt, :], delta[..., :gt]),
            index, before, st, True, entries_per_step)
        dk_acc, dv_acc = dk_acc - before[0], dv_acc - before[1]
        want = layer_backward_twin(a["q"], layer(a["layer_k"], k_, t_), RowStats(lse, do, delta), st)
        dk = node_gradient(dk_acc, N, a["cos"], a["sin"], st.r)
        _assert_gradients_close((dq, dk, dv_acc[:, :, :N]), want, atol=1e-5 * 8)
        assert float(jnp.max(jnp.abs(want[1]))) > 0 and float(jnp.max(jnp.abs(want[0]))) > 0
        assert not np.any(np.asarray(dk_acc[:, :, N:])) and not np.any(np.asarray(dv_acc[:, :, N:]))


def test_spill_segments_cover_each_unit_once_in_order(rng):
    """Every unit's entries: its first `size`, then its segments of `size` in order,
    each entry once; the segments past the used ones empty."""
    size = 3
    counts = rng.integers(0, 12, size=(2, 3, 7)).astype(np.int32)
    end = np.cumsum(counts, axis=-1, dtype=np.int32)
    begin = end - counts
    total = int(counts.sum(axis=-1).max())
    bounds, spill, segments = (np.asarray(x) for x in spill_segments(jnp.asarray(begin), jnp.asarray(end), size,
                                                                     total // size))
    for b, h in np.ndindex(2, 3):
        for u in range(7):
            walked = list(range(*bounds[b, h, u]))
            assert len(walked) == min(size, counts[b, h, u])
            for x in range(*spill[b, h, u]):
                assert segments[b, h, x, 0] == u and 0 < segments[b, h, x, 2] - segments[b, h, x, 1] <= size
                walked += range(segments[b, h, x, 1], segments[b, h, x, 2])
            assert walked == list(range(begin[b, h, u], end[b, h, u]))
        unused = segments[b, h, spill[b, h, -1, 1]:]
        assert np.all(unused[:, 1] == unused[:, 2])


@pytest.mark.parametrize("bad", [-1, 2.5])
def test_node_entries_must_be_a_count(bad):
    with pytest.raises(ValueError, match="node_entries must be an int >= 0"):
        BlockSizes(node_entries=bad)


@pytest.mark.parametrize("family, field, bad, rule", [
    (TopBackwardConfig, "dq_rows", 0, "int >= 1"), (TopBackwardConfig, "dkv_programs", 1.5, "int >= 1"),
    (TopBackwardConfig, "dkv_warps", 3, "power of two"), (LayerConfig, "node_num_warps", 0, "power of two"),
    (BlockSizes, "num_warps", 3, "power of two"), (BlockSizes, "tile", 0, "int >= 1")])
def test_kernel_configs_are_checked(family, field, bad, rule):
    with pytest.raises(ValueError, match=f"{family.__name__}.{field} must be .*{rule}"):
        family(**{field: bad})


def _random_accumulators(rng, zeros):
    """Accumulators holding earlier sums: values of order 1 (exactly representable
    differences after adding gradients of order 1, to within float32 rounding)."""
    return tuple(jnp.asarray(rng.integers(-4, 5, size=x.shape).astype(np.float32)) for x in zeros)


@pytest.mark.parametrize("config, G, dq_launch, dkv_launch, documents",
                         paired(LAYER_CONFIGS, [(1, (16, 16), (4, 32, 1), False), (3, (4, 32), (8, 16, 3), True),
                                                (8, (2, 16), (1, 16, 2), False)]), ids=str)
def test_top_backward_equals_twin(rng, config, G, dq_launch, dkv_launch, documents):
    """The top layer's dq and node kernels (`(block_queries, tile)`; the node kernel's
    also its query segments per tile) against the per-query twin with virtual parents;
    every query of a block has its own `n`. `documents`: `first` given (zeros: the
    packed form's per-document pass)."""

    a, layer_k, layer_v, n, parents, q = top_layer_inputs(rng, config, G)
    st, Mp, N = a["st"], a["cos"].shape[0], layer_k.shape[2]
    launch = lambda bq, tile: dataclasses.replace(st, block_queries=bq, tile=min(tile, Mp))
    st_dq, st_dkv = launch(*dq_launch), launch(*dkv_launch[:2])
    segments = dkv_launch[2]
    pad = max(st_dq.tile, st_dkv.tile)
    q_rot = rotate_queries(q, n, a["cos"], a["sin"])
    k_rot = key_operands(rotate_keys(layer_k, a["cos"], a["sin"], pad), st.precision)
    v = pad_nodes(layer_v, pad)
    first = jnp.zeros_like(n)
    keys = top_importance_keys_pallas(q_rot, TopInputs(n, first, None, None, k_rot, None), Mp, st_dq, interpret=True)
    _, tau = select_top_k_twin(keys, parents, n, st)
    lse, delta, do = _row_stats(rng, q.shape[:4], v.shape[-1])
    q_ops, documents = top_backward_queries(q_rot, st), first if documents else None
    for k_, t_ in [(keys, tau), (None, None)]:
        top, stats = TopInputs(n, documents, k_, t_, k_rot, v), RowStats(lse, do, delta)
        dq_rot = top_dq_pallas(q_ops, top, stats, st_dq, interpret=True)
        before = _random_accumulators(rng, (k_rot[0], v))
        dk_acc, dv_acc = top_node_grads_pallas(q_ops, top, stats, before, st_dkv, interpret=True, segments=segments)
        dk_acc, dv_acc = dk_acc - before[0], dv_acc - before[1]
        position = n - 1
        dq = apply_rope(dq_rot, a["cos"][position], -a["sin"][position])
        dk = apply_rope(dk_acc[:, :, :N], a["cos"][:N], -a["sin"][:N])
        want = layer_backward_twin(q, LayerInputs(parents, n, k_, t_, layer_k, layer_v, a["cos"], a["sin"]), stats, st)
        _assert_gradients_close((dq, dk, dv_acc[:, :, :N]), want, atol=1e-5 * 8)
        assert not np.any(np.asarray(dv_acc[:, :, N:]))  # padding nodes get nothing


GRADIENT_CASES = [
    # (B, T, r, top_k, G, importance, strict_causal): 1, 2 and 3+ layer trees
    (2, 12, 4, 4, 2, "softmax", True),
    (2, 200, 8, 8, 2, "softmax", False),
    (1, 77, 2, 4, 2, "shared_max", True),  # 77 -> 39 -> 20 -> 10: 4 layers
]


def _loss_grads(q, k, v, config, backend, weights):

    def loss(q, k, v):
        return jnp.sum(htree_attention(q, k, v, config, backend=backend).astype(jnp.float32) * weights)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.parametrize("B, T, r, top_k, G, importance, strict_causal", GRADIENT_CASES)
def test_pallas_gradients_equal_reference(rng, B, T, r, top_k, G, importance, strict_causal):

    config = HTreeConfig(compression_rate=r, top_k=top_k, importance=importance, strict_causal=strict_causal, selection_block=1)
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, B, T, 2 * G, 2, 40, 36))  # padded dims inside
    weights = jnp.asarray(rng.standard_normal((B, T, 2 * G, 36)).astype(np.float32))
    got = _loss_grads(q, k, v, config, "pallas_interpret", weights)
    want = _loss_grads(q, k, v, config, "reference", weights)
    for name, a, b in zip("qkv", got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        scale = float(jnp.max(jnp.abs(b)))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * scale, err_msg=name)


@pytest.mark.parametrize("r, top_k, T", [(4, 4, 150)])  # 3 layers (2 layers in float32: GRADIENT_CASES)
def test_pallas_gradients_bfloat16(rng, r, top_k, T):
    """bfloat16 inputs: products in bfloat16 with float32 accumulation, as flash
    attention's backward; within bf16 tolerance of the float32 reference's gradients.
    The 3-layer tree has a layer the forward merges from its importance scores."""
    import ml_dtypes


    config = HTreeConfig(compression_rate=r, top_k=top_k, selection_block=1)
    assert config.num_layers(T) == (2 if r == 16 else 3)
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, 1, T, 4, 2, 32, 32, dtype=ml_dtypes.bfloat16))
    weights = jnp.asarray(rng.standard_normal((1, T, 4, 32)).astype(np.float32))
    got = _loss_grads(q, k, v, config, "pallas_interpret", weights)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = _loss_grads(*f32, config, "reference", weights)
    # What bfloat16 costs the reference itself (bf16 output, so bf16 `delta`, and bf16
    # gradients): the Pallas gradients may be no worse than twice that.
    ref_bf16 = _loss_grads(q, k, v, config, "reference", weights)
    rel = lambda a, b: float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))
    for name, a, b, c in zip("qkv", got, want, ref_bf16):
        assert a.dtype == jnp.bfloat16, name
        assert rel(a, b) < max(2 * rel(c, b), 1e-2) and rel(a, b) < 0.1, (name, rel(a, b), rel(c, b))


def test_middle_layer_backward_error_from_mixed_precisions_is_bounded(rng):
    """bfloat16 inputs, a layer between the top and the bottom: the forward merges it from
    the importance pass's stored scores (`BF16X3`, float32-grade), the backward scores it
    again with bfloat16 operands, so `p = exp(s_bwd - lse_fwd)` mixes two precisions.
    Bounded here at large scores (~10, where bf16 operands err by ~3e-2): `dq` against the
    twin with `lse` from the stored scores stays within a few bfloat16 steps."""

    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    a = layer_inputs(rng, config, G=2, K=24, V=20)
    q, layer_k = 3.0 * a["q"], 3.0 * a["layer_k"]
    st = dataclasses.replace(a["st"], precision=jax.lax.Precision.HIGH, importance_operands=BF16X3,
                             merge_precision=jax.lax.Precision.DEFAULT, merge_operands="bfloat16")
    phases = rotate_phases(layer_k, a["cos"], a["sin"], st)
    k_imp, k_merge = key_operands(phases, st.precision, BF16X3), key_operands(phases, st.merge_precision, "bfloat16")
    args = (a["parents"], a["n"])
    layer = lambda k, keys=None, tau=None: LayerInputs(*args, keys, tau, k, a["layer_v"], a["cos"], a["sin"])
    keys, scores = importance_keys_pallas(q, layer(k_imp), st, True, return_scores=True)
    _, tau = select_top_k_pallas(keys, *args, st, True)
    # The rows' log-sum-exp of this layer's merged candidates, from the stored scores.
    Mp = scores.shape[-1]
    merged = (jnp.arange(Mp) < a["n"]) & (keys < tau)  # [B, Q, H_kv, Mp]
    lse = jax.nn.logsumexp(jnp.where(merged[..., None, :], scores, -jnp.inf), axis=-1)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    _, delta, do = _row_stats(rng, lse.shape, a["layer_v"].shape[-1])
    want = layer_backward_twin(q, layer(layer_k, keys, tau), RowStats(lse, do, delta), st)[0]
    got = layer_backward_pallas(q, layer(k_merge, keys, tau), RowStats(lse, do, delta), st, True)
    real = (slice(None),) * 3 + (slice(0, 2),)
    rel = float(jnp.linalg.norm((got - want)[real]) / jnp.linalg.norm(want[real]))
    assert rel < 0.08, rel  # measured 0.012-0.025 over six seeds (a bf16 step is 2^-8 = 0.004)


def test_pallas_grad_of_a_small_model_jits_without_nan(rng):
    """`jax.jit(jax.grad(loss))` of a Flax-free model (projections, htree, output), for
    T = 1 and a multi-layer T: finite gradients."""

    config = HTreeConfig(compression_rate=4, top_k=2, selection_block=1)
    D, H, H_kv, K = 16, 4, 2, 32
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    params = dict(wq=jax.random.normal(keys[0], (D, H * K)) * 0.3, wk=jax.random.normal(keys[1], (D, H_kv * K)) * 0.3,
                  wv=jax.random.normal(keys[2], (D, H_kv * K)) * 0.3, wo=jax.random.normal(keys[3], (H * K, D)) * 0.1)

    def loss(params, x):
        B, T, _ = x.shape
        q = (x @ params["wq"]).reshape(B, T, H, K)
        k = (x @ params["wk"]).reshape(B, T, H_kv, K)
        v = (x @ params["wv"]).reshape(B, T, H_kv, K)
        o = htree_attention(q, k, v, config, backend="pallas_interpret").reshape(B, T, H * K)
        return jnp.mean((o @ params["wo"] - x) ** 2)

    step = jax.jit(jax.value_and_grad(loss))
    for T in (1, 40):
        x = jnp.asarray(rng.standard_normal((2, T, D)).astype(np.float32))
        value, grads = step(params, x)
        assert np.isfinite(float(value))
        for name, g in grads.items():
            assert np.all(np.isfinite(np.asarray(g))), (T, name)
            # At T = 1 the one key gets weight 1 whatever its score: the gradients of wq
            # and wk are zero in exact arithmetic (rounding may leave a trace, or not).
            if T > 1 or name in ("wv", "wo"):
                assert float(jnp.max(jnp.abs(g))) > 0, (T, name)


# A 4-layer tree in bfloat16, 3 heads a group (the two float32 cases ran too until
# 2026-11-28 (3); the gradients themselves are compared in GRADIENT_CASES).
@pytest.mark.parametrize("B, T, r, top_k, G, dtype", [(1, 77, 2, 4, 3, "bfloat16")])
def test_backward_with_saved_selections_equals_recomputing_them_bitwise(rng, B, T, r, top_k, G, dtype):
    """The backward given the forward's selections (`BlockSizes.save_selections`, what
    `htree_attention` runs) marks the same merged candidates as the one that runs the
    importance and top-K kernels again: bitwise the same gradients (2- to 5-layer trees,
    several chunks, non-finite rows masked)."""

    config = HTreeConfig(compression_rate=r, top_k=top_k, selection_block=1)
    assert config.num_layers(T) >= 2
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, B, T, 2 * G, 2, 32, 32))
    if dtype == "bfloat16":
        q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    small = BlockSizes(chunk_budget_bytes=1 << 16)  # several chunks
    o, sel, lse = htree_forward_pallas(q, k, v, config=config, block_sizes=small, interpret=True, return_lse=True)
    do = jnp.asarray(rng.standard_normal(o.shape).astype(np.float32)).astype(o.dtype)
    dead = jnp.zeros(o.shape[:3], bool).at[:, T // 3].set(True)
    run = lambda s: htree_backward_pallas(q, k, v, o, lse, do, config=config, block_sizes=small, interpret=True,
                                           dead_rows=dead, selections=s)
    for a, b in zip(run(sel), run(None)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_kept_keys_mark_the_selected_positions():

    parents = jnp.asarray([[[[2, 5, 9, -1]]]], jnp.int32)  # [1, 1, 1, P], r = 4
    selected = jnp.asarray([[[[9, 21, 38, -1]]]], jnp.int32)  # nodes 2*4+1, 5*4+1, 9*4+2
    keys = np.asarray(kept_keys(parents, selected, 16, 4))[0, 0, 0]
    assert keys.tolist() == [0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0]
    top = np.asarray(kept_keys(None, jnp.asarray([[[[0, 3, -1]]]], jnp.int32), 8, 4))[0, 0, 0]
    assert top.tolist() == [1, 0, 0, 1, 0, 0, 0, 0]


def test_top_backward_launches():
    """The top layer's backward launches (`top_backward_statics`): the node kernel's
    programs per tile fill `top_dkv_programs` at most, capped by `MAX_SEGMENTS` and the
    chunk's query blocks; float32 inputs take half the rows and one stage; tiles divide
    the padded nodes and the keys' width; blocks divide the forward's."""

    st_top = LayerStatic(r=16, tile=64, group=8, alpha=0.1, importance="softmax", strict_causal=True, log_n=13,
                         top_k=512, precision=None, block_queries=16)
    bs = TopBackwardConfig()
    st_dq, st_dkv, segments = top_backward_statics(st_top, bs, 2, 128, 128, 8192, 8192, 4, 8192)
    assert (st_dq.block_queries, st_dq.tile, st_dq.num_warps, st_dq.num_stages) == (8, 64, 4, 2)
    assert (st_dkv.block_queries, st_dkv.tile) == (8, 64)
    assert segments == bs.dkv_programs // (4 * 8192 // 64) == 8
    _, _, segments = top_backward_statics(st_top, bs, 2, 128, 128, 512, 8192, 4, 8192)
    assert segments == MAX_SEGMENTS  # 8 tiles a head: 4096 / 32 wanted
    _, _, segments = top_backward_statics(st_top, bs, 2, 128, 128, 128, 128, 1, 24)
    assert segments == 24 // 8  # the chunk's blocks
    st_dq, st_dkv, _ = top_backward_statics(st_top, bs, 4, 128, 128, 8192, 8192, 4, 8192)
    assert (st_dq.block_queries, st_dq.num_stages, st_dkv.block_queries, st_dkv.num_stages) == (4, 1, 4, 1)
    st_dq, st_dkv, _ = top_backward_statics(st_top, TopBackwardConfig(dq_tile=256, dkv_tile=256), 2, 256, 128,
                                            384, 8192, 4, 8192)
    assert (st_dq.tile, st_dkv.tile, st_dq.num_stages) == (128, 128, 1)  # 384 = 3 x 128


def test_zeros_after_waits_for_its_anchor():
    """`zeros_after`: zeros of the shape and dtype, made from a zero that passes an
    optimization barrier with the anchor (so XLA cannot make the buffer before the
    anchor exists), and the backward's accumulators and dq's chunks are made that way."""
    anchor = jnp.arange(5.0)
    zeros = zeros_after((3, 4), jnp.bfloat16, anchor)
    assert zeros.shape == (3, 4) and zeros.dtype == jnp.bfloat16 and not np.any(np.asarray(zeros, np.float32))
    barrier = [e for e in jax.make_jaxpr(lambda a: zeros_after((3, 4), jnp.float32, a))(anchor).eqns
               if e.primitive.name == "optimization_barrier"]
    assert len(barrier) == 1 and barrier[0].invars[1].aval.shape == (5,)
    B, T, H, K = 1, 64, 2, 32
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (B, T, h, K), jnp.float32) for i, h in enumerate((H, 1, 1)))
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    o, _, lse = htree_forward_pallas(q, k, v, config=config, interpret=True, return_lse=True)
    text = str(jax.make_jaxpr(lambda lse: htree_backward_pallas(q, k, v, o, lse, o, config=config, interpret=True))(lse))
    # the top layer's two accumulators, two per layer below it, and dq's chunks
    assert text.count("optimization_barrier") >= 2 + 2 * (config.num_layers(T) - 1) + 1


def _scans(jaxpr):
    """Every `scan` equation of a jaxpr, nested ones included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _scans(sub)


def test_backward_chunk_loop_indexes_by_xs():
    """The backward's loop over query chunks takes the chunk index from its `xs`, not a
    counter in its carry (a `fori_loop`): with a counter XLA made the loop's per-chunk
    slices async on other streams, a wait per chunk (journal, 2026-11-27 (9))."""
    B, T, H, K = 1, 64, 2, 32
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (B, T, h, K), jnp.float32) for i, h in enumerate((H, 1, 1)))
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    o, _, lse = htree_forward_pallas(q, k, v, config=config, interpret=True, return_lse=True)
    jaxpr = jax.make_jaxpr(lambda lse: htree_backward_pallas(q, k, v, o, lse, o, config=config,
                                                             interpret=True))(lse).jaxpr
    chunk_loops = [e for e in _scans(jaxpr) if "pallas_call" in str(e.params["jaxpr"])]
    assert chunk_loops, "no scan over chunks holds the backward's kernels"
    for e in chunk_loops:  # xs come last; a fori_loop's last operand is its carry's last
        index = e.invars[-1].aval
        assert index.shape == (e.params["length"],) and index.dtype == jnp.int32, "the chunk index must be xs"

