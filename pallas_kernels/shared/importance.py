"""SPEC 2.2-2.3 in a kernel: the candidates' scores and packed importance keys of a
layer below the top, one program per `(b, t, h_kv)` walking its candidate buffer in
tiles; the pure-JAX twin is `importance_keys_twin`.

The scores kernel stores every candidate's scores (`G` floats each) and each row's
running max and sum over the normaliser set R; `keys_from_scores` (one fused XLA pass)
turns them into packed keys. The merge of the same layer then reads the stored scores
(`gqa.merge.merge_scored_pallas`) instead of gathering and scoring the keys again.

Layouts (padded by `gqa.plan.prepare`):
  q        `[B, Q, H_kv, Gp, Kp]`  un-rotated, halves padded apart (`pad_rope_halves`)
  parents  `[B, Q/BQ, H_kv, P]` int32  ascending, `-1` padded; `P * r = Mp`; one row per
           block of BQ queries that share them (the forward uses BQ = 1 here)
  n        `[B, Q/BQ, H_kv, 1]` int32  valid candidates (SPEC 2.1)
  k_phases the layer's keys in `span/r` rotated copies (`rope.rotate_phases`), as
           `precision.key_operands` prepares them for the importance dots
  cos, sin `[Mp, Kp/2]` float32  RoPE at candidate positions (`rope.padded_rope_table`)
  keys     `[B, Q, H_kv, Mp]` int32 packed importance, `-1` where invalid
  scores   `[B, Q, H_kv, Gp, Mp]` float32 (real heads' rows of valid tiles written)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from htree_jax.core.config import FORCED_IMPORTANCE
from htree_jax.core.indexing import candidate_nodes as nodes_of_positions
from htree_jax.core.indexing import pack_importance
from htree_jax.core.rope import apply_rope
from htree_jax.core.softmax import importance
from pallas_kernels.shared.common import (
    NEG_INF,
    LayerInputs,
    LayerStatic,
    block_specs,
    layer_params,
    per_query,
    real_heads,
    shared_shift,
    span_candidates,
)
from pallas_kernels.shared.precision import check_key_parts, dot_rows, key_parts, score_dot, split_rows
from pallas_kernels.shared.rope import full_width_inputs
from pallas_kernels.shared.softmax import fold_max_sum


def score_span(p0, q_parts, par_ref, k_refs, cf_ref, sf_ref, n, st: LayerStatic, precision, operands=None):
    """Scores of the candidate positions `[p0, p0 + span)`: `(scores [rows, span],
    valid, positions, nodes)`, `p0` a multiple of the span.

    Position `p = s*r + c` holds node `parents[s]*r + c`; `k_refs` (`key_operands`)
    hold the layer's keys in `span / r` rotated copies (`rotate_phases`), so every key
    row goes from memory straight into the product, already rotated by `p - p0`, and
    the query is rotated once, by `n - 1 - p0`.
    """
    r, span = st.r, st.span
    versions = span // r
    N = k_refs[0].shape[0] // versions
    q, q_half = q_parts  # [rows, Kp] float32: the query and rotate_half(query)
    positions, valid, nodes = span_candidates(par_ref, p0, span, n, r)
    copy = (jnp.arange(span, dtype=jnp.int32) // r) * N
    keys = tuple(k_ref[nodes + copy, :] for k_ref in k_refs)
    angle = jnp.maximum(n - 1 - p0, 0)  # an invalid span: any row, masked later
    c, s = cf_ref[pl.ds(angle, 1), :], sf_ref[pl.ds(angle, 1), :]
    scores = score_dot(q * c + q_half * s, keys, precision, operands)
    return st.alpha * scores, valid, positions, nodes


def score_tile(i, q_parts, par_ref, k_refs, cf_ref, sf_ref, n, st: LayerStatic, precision, operands=None):
    """`score_span` of every span of candidate tile `i` (unrolled: their loads are
    issued together)."""
    return [score_span(i * st.tile + u * st.span, q_parts, par_ref, k_refs, cf_ref, sf_ref, n, st, precision,
                       operands)
            for u in range(st.tile // st.span)]


def query_rows(q_ref, qh_ref):
    """A block's queries and `rotate_half` of them as `[BQ*Gp, Kp]` float32 rows."""
    bq, gp, kp = q_ref.shape
    return (q_ref[...].astype(jnp.float32).reshape(bq * gp, kp), qh_ref[...].astype(jnp.float32).reshape(bq * gp, kp))


def importance_shift(m, total, real_head, group_rows: int, importance: str, log=jnp.log):
    """Per row, what the importance subtracts from scores (SPEC 2.3): the row's LSE over
    R (`softmax`), or the max over the real heads of its query's group (`shared_max`);
    0 where R is empty. `m, total [rows]` from `softmax.fold_max_sum`, rows grouped by query
    in blocks of `group_rows` (`log=jnp.log2` for scores in base 2)."""
    if importance == "softmax":
        return jnp.where(total > 0, m + log(jnp.where(total > 0, total, 1.0)), 0.0)
    queries = m.shape[0] // group_rows
    group_max = jnp.max(jnp.where(real_head, m, NEG_INF).reshape(queries, group_rows), axis=1)
    shift = jnp.broadcast_to(group_max[:, None], (queries, group_rows)).reshape(m.shape[0])
    return jnp.where(shift == NEG_INF, 0.0, shift)


def write_key_tiles(keys_ref, num_tiles, write_keys, st: LayerStatic):
    """Runs `write_keys` over the first `num_tiles` tiles and marks the rest invalid."""

    def write_invalid(i, carry):
        keys_ref[:, pl.ds(i * st.tile, st.tile)] = jnp.full((keys_ref.shape[0], st.tile), -1, jnp.int32)
        return carry

    # Loops that only store carry nothing (a constant carry does not lower to Triton).
    lax.fori_loop(0, num_tiles, write_keys, ())
    lax.fori_loop(num_tiles, keys_ref.shape[1] // st.tile, write_invalid, ())


def _scores_kernel(q_ref, qh_ref, par_ref, n_ref, *refs, st: LayerStatic, bound_parts: int = 0):
    """One pass over the candidates: their scores, stored (`[BQ, Gp, Mp]`, only the
    real heads' rows of the first `ceil(n / tile)` tiles written), and each row's
    importance shift. Storing
    them (G floats per candidate) costs far less than gathering and scoring the keys
    again (a key row is K values, in two parts), which a second pass would.
    `bound_parts > 0` (SPEC 11): the tables are followed by the query rows' feature-group
    norms and the layer's radii (that many parts); the bound scores are stored too (a
    second output before the shifts) and the shifts are theirs: the importance ranks by
    the bound, the merge reads the scores."""
    outputs = 3 if bound_parts else 2
    refs, (s_ref, *b_ref, shift_ref) = refs[:-outputs], refs[-outputs:]
    bound = None
    if bound_parts:
        refs, qn_ref, rho_refs = refs[:-bound_parts - 1], refs[-bound_parts - 1], refs[-bound_parts:]
        bq, gp, gn = qn_ref.shape
        bound = split_rows(qn_ref[...].reshape(bq * gp, gn), st.precision, st.importance_operands)
    *k_refs, cf_ref, sf_ref = refs
    bq, gp, _ = q_ref.shape
    rows = bq * gp
    n = n_ref[0]
    q_parts = query_rows(q_ref, qh_ref)
    num_tiles = (n + st.tile - 1) // st.tile
    real_head = jnp.arange(rows, dtype=jnp.int32) % gp < st.group
    # R, the normaliser set: valid positions, less the rightmost one when strict.
    last_in_norm = n - 1 if st.strict_causal else n

    # Only the real heads' rows are stored: the padding rows are never read.
    store_rows = jnp.broadcast_to((jnp.arange(gp, dtype=jnp.int32) < st.group)[None, :, None], (bq, gp, st.span))

    def scores_of_tile(i, carry):
        units = score_tile(i, q_parts, par_ref, k_refs, cf_ref, sf_ref, n, st, st.precision, st.importance_operands)
        for u, (scores, _, positions, nodes) in enumerate(units):
            span = pl.ds(i * st.tile + u * st.span, st.span)
            plgpu.store(s_ref.at[:, :, span], scores.reshape(bq, gp, st.span), mask=store_rows)
            if bound is not None:  # + alpha * sum over feature groups of |q| * rho: one more product
                reach = dot_rows(bound, tuple(rho_ref[nodes, :] for rho_ref in rho_refs), st.precision,
                                 st.importance_operands)
                scores = scores + st.alpha * reach
                plgpu.store(b_ref[0].at[:, :, span], scores.reshape(bq, gp, st.span), mask=store_rows)
            in_norm = positions < last_in_norm
            carry = fold_max_sum(*carry, jnp.where(in_norm[None, :], scores, NEG_INF))
        return carry

    init = (jnp.full((rows,), NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32))
    m, total = lax.fori_loop(0, num_tiles, scores_of_tile, init)
    shift_ref[...] = importance_shift(m, total, real_head, gp, st.importance).reshape(shift_ref.shape)


def keys_from_scores(scores, shift, n, st: LayerStatic, export: bool = False):
    """Packed importance keys `[B, Q, H_kv, Mp]` (SPEC 2.3) from stored scores `[B, Q,
    H_kv, Gp, Mp]` (read only where valid) and the rows' shifts `[B, Q, H_kv, Gp]`, per
    query `n [B, Q, H_kv, 1]`: one fused XLA pass over the scores."""
    # Only the real heads' rows were stored.
    scores, shift = scores[..., : st.group, :], shift[..., : st.group]
    Mp = scores.shape[-1]
    positions = jnp.arange(Mp, dtype=jnp.int32)
    valid = positions < n  # [B, Q, H_kv, Mp]
    weights = jnp.where(valid[..., None, :], jnp.exp(scores - shift[..., None]), 0.0)
    return packed_keys(jnp.sum(weights, axis=-2), n, st.strict_causal, st.log_n, export)


def packed_keys(imp, n, strict_causal: bool, log_n: int, export: bool = False, positions=None):
    """SPEC 2.3's packed keys `[..., Mp]` int32 from the candidates' importance `imp
    [..., Mp]` (read where valid) and `n [..., 1]`: 0 where R is empty, the rightmost
    forced in, `-1` where invalid; with `export` also the importance (SPEC 8: the formula
    value everywhere valid, the rightmost's included; 0 elsewhere). `positions`: those
    of `imp`'s last axis (None: `0 .. Mp - 1`)."""
    if positions is None:
        positions = jnp.arange(imp.shape[-1], dtype=jnp.int32)
    valid = positions < n
    imp = jnp.where(valid & ((n - 1 if strict_causal else n) > 0), imp, 0.0)
    keys = jnp.where(valid, pack_importance(jnp.where(positions == n - 1, FORCED_IMPORTANCE, imp), positions, log_n),
                     -1)
    return (keys, imp) if export else keys


def whole_groups(scores, shift, n, st: LayerStatic, split: int):
    """Virtual kv heads `[B, Q, H_kv * split, Gp, ...]` (`gqa.plan.split_heads`, every row a
    real head) as their real kv heads: `(scores [B, Q, H_kv, split * Gp, Mp], shifts
    (shared_shift), n, the static with the whole group)`."""
    if split == 1:
        return scores, shift, n, st
    whole = scores.reshape(scores.shape[:2] + (scores.shape[2] // split, split * scores.shape[3]) + scores.shape[4:])
    return (whole, shared_shift(shift, split, st.importance), real_heads(n, split),
            dataclasses.replace(st, group=split * st.group))


def group_keys_from_scores(scores, shift, n, st: LayerStatic, split: int = 1, export: bool = False):
    """`keys_from_scores` of the real kv heads where the kv heads are virtual
    (`whole_groups`): each kv head's `split * Gp` rows taken as one group, `n` as a
    virtual layout's."""
    if split > 1:
        scores, shift, n, st = whole_groups(scores, shift, n, st, split)
    return keys_from_scores(scores, shift, n, st, export)


@functools.partial(jax.jit, static_argnames=("st", "interpret", "return_scores", "export", "split"))
def importance_keys_pallas(q, layer: LayerInputs, st: LayerStatic, interpret=False, return_scores=False, export=False,
                           split=1, bound=None):
    """Packed importance keys `[B, Q, H_kv, Mp]` int32 of every candidate position: the
    scores kernel, then `keys_from_scores`. With `return_scores`, `(keys, scores)`:
    the scores `[B, Q, H_kv, Gp, Mp]` float32 (scaled by alpha; only the real heads'
    rows of the valid tiles are written) for `merge_scored_pallas`.

    `q [B, Q, H_kv, Gp, Kp]`; `layer` (`common.LayerInputs`; its keys, tau and values
    not read): `parents [B, Q/BQ, H_kv, P]` and `n [B, Q/BQ, H_kv, 1]` one row per block
    of `BQ = st.block_queries` queries that share them; `k` the layer's keys from
    `rotate_phases`, as `key_operands(..., st.precision, st.importance_operands)`. Holds `B * Q * H_kv * Gp * Mp` float32 scores meanwhile.
    `split > 1`: the kv heads are virtual, `split` per real one (`gqa.plan.split_heads`,
    `Gp = st.group` rows each): the keys (and importance) are those of the real kv heads,
    `[B, Q, H_kv / split, Mp]`, from the whole group's scores; the scores stay virtual.
    `bound` (SPEC 11, `selection="bound"`): `common.Bound(qn [B, Q, H_kv, Gp, Gn] float32, rho)`, the
    query rows' feature-group norms and `key_operands` of the layer's radii `[B, H_kv, N,
    Gn]`: the keys rank by the bound scores (stored meanwhile beside the scores); the
    scores returned are still the plain ones, for the merge.
    """
    parents, n, k_phases, cos, sin = layer.parents, layer.n, layer.k, layer.cos, layer.sin
    check_key_parts(k_phases, (key_parts(st.precision, st.importance_operands),))
    B, Q, H_kv, gp = q.shape[:4]
    Mp = cos.shape[0]
    sp = block_specs(st, gp, q.shape[-1], Mp, parents, k_phases, None)
    queries, tables = full_width_inputs(q, cos, sin)
    score_shape = jax.ShapeDtypeStruct((B, Q, H_kv, gp, Mp), jnp.float32)
    extra_specs, extra, extra_out = [], (), []
    if bound is not None:
        qn, rho = bound.query_norms, bound.radii
        bound_specs = block_specs(st, gp, qn.shape[-1], Mp, parents, rho, None)
        extra_specs, extra, extra_out = [bound_specs["q"], *bound_specs["k"]], (qn, *rho), [score_shape]
    scores, *bounds, shift = pl.pallas_call(
        functools.partial(_scores_kernel, st=st, bound_parts=0 if bound is None else len(bound.radii)),
        grid=(B, Q // st.block_queries, H_kv),
        in_specs=[sp["q"], sp["q"], sp["parents"], sp["n"], *sp["k"], sp["table"], sp["table"], *extra_specs],
        out_specs=[sp["scores"]] * (1 + len(extra_out)) + [sp["vec"]],
        out_shape=[score_shape, *extra_out, jax.ShapeDtypeStruct((B, Q, H_kv, gp), jnp.float32)],
        compiler_params=layer_params(st),
        interpret=interpret,
    )(*queries, parents, n, *k_phases, *tables, *extra)
    keys = group_keys_from_scores(bounds[0] if bounds else scores, shift, per_query(n, st), st, split, export)
    if export:  # `((keys, importance), scores)` or `(keys, importance)`
        return (keys, scores) if return_scores else keys
    return (keys, scores) if return_scores else keys



# ---------------------------------------------------------------------------------------
# Pure-JAX twins, written with the reference's SPEC steps.


def gather_nodes(layer, idx):
    """`layer [B, H_kv, N, D]`, `idx [B, Q, H_kv, M]` -> `[B, Q, H_kv, M, D]`."""
    per_head = jax.vmap(lambda lh, ih: lh[ih], in_axes=(0, 1), out_axes=1)
    return jax.vmap(per_head)(layer, idx)


def scores_twin(q, parents, n, layer_k, cos, sin, st: LayerStatic):
    """`[B, Q, H_kv, Gp, Mp]` scores, valid `[B, Q, H_kv, Mp]`, nodes, positions."""
    parents, n = per_query(parents, st), per_query(n, st)
    Mp = cos.shape[0]
    positions = jnp.arange(Mp, dtype=jnp.int32)
    nodes = nodes_of_positions(parents, positions, st.r)
    valid = positions < n
    gathered = gather_nodes(layer_k, jnp.where(valid, nodes, 0)).astype(jnp.float32)
    k_rot = apply_rope(gathered, cos, sin)
    qpos = n - 1  # [B, Q, H_kv, 1]
    q_rot = apply_rope(q.astype(jnp.float32), cos[qpos], sin[qpos])
    scores = st.alpha * jnp.einsum("bqhgk,bqhmk->bqhgm", q_rot, k_rot, precision=lax.Precision.HIGHEST)
    return scores, valid, nodes, positions, n


def importance_keys_twin(q, parents, n, layer_k, cos, sin, st: LayerStatic):
    B, Q, H_kv, gp, _ = q.shape
    scores, valid, _, positions, n = scores_twin(q, parents, n, layer_k, cos, sin, st)
    flat = lambda x: x.reshape((B * Q * H_kv,) + x.shape[3:])
    rightmost = positions == n - 1
    in_norm = valid & ~rightmost if st.strict_causal else valid
    imp = importance(flat(scores)[:, : st.group], flat(in_norm), st.importance)
    imp = jnp.where(flat(rightmost), FORCED_IMPORTANCE, imp)
    keys = jnp.where(flat(valid), pack_importance(imp, positions[None], st.log_n), -1)
    return keys.reshape(B, Q, H_kv, -1)


def feature_pieces(width: int) -> tuple:
    """`(start, size)` power-of-two pieces covering `[0, width)`, largest first."""
    pieces, start = [], 0
    for bit in reversed(range(width.bit_length())):
        if width & (1 << bit):
            pieces.append((start, 1 << bit))
            start += 1 << bit
    return tuple(pieces)
