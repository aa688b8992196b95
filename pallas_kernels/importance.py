"""SPEC 2.2-2.3 in a kernel: the candidates' scores and packed importance keys of a
layer below the top, one program per `(b, t, h_kv)` walking its candidate buffer in
tiles; the pure-JAX twin is `importance_keys_twin`.

The scores kernel stores every candidate's scores (`G` floats each) and each row's
running max and sum over the normaliser set R; `keys_from_scores` (one fused XLA pass)
turns them into packed keys. The merge of the same layer then reads the stored scores
(`merge.merge_scored_pallas`) instead of gathering and scoring the keys again.

Layouts (padded by `plan.prepare`):
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
from pallas_kernels.common import (
    NEG_INF,
    LayerStatic,
    block_specs,
    compiler_params,
    layer_params,
    per_query,
    real_heads,
    shared_shift,
    span_candidates,
)
from pallas_kernels.precision import check_key_parts, dot_rows, key_parts, score_dot, split_rows, stored_dot
from pallas_kernels.rope import full_width_inputs


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


def online_max_sum(m, total, scores, exp=jnp.exp):
    """Fold `scores [R, tile]` (-inf where excluded) into a running max and sum (`exp`:
    `jnp.exp2` for scores in base 2, `log2(e)` times the natural ones)."""
    m_new = jnp.maximum(m, jnp.max(scores, axis=1))
    m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
    total = total * exp(m - m_safe) + jnp.sum(exp(scores - m_safe[:, None]), axis=1)
    return m_new, total


def importance_shift(m, total, real_head, group_rows: int, importance: str, log=jnp.log):
    """Per row, what the importance subtracts from scores (SPEC 2.3): the row's LSE over
    R (`softmax`), or the max over the real heads of its query's group (`shared_max`);
    0 where R is empty. `m, total [rows]` from `online_max_sum`, rows grouped by query
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
            carry = online_max_sum(*carry, jnp.where(in_norm[None, :], scores, NEG_INF))
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
    """Virtual kv heads `[B, Q, H_kv * split, Gp, ...]` (`plan.split_heads`, every row a
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
    return keys_from_scores(*whole_groups(scores, shift, n, st, split), export)


@functools.partial(jax.jit, static_argnames=("st", "interpret", "return_scores", "export", "split"))
def importance_keys_pallas(q, parents, n, k_phases, cos, sin, st: LayerStatic, interpret=False,
                           return_scores=False, export=False, split=1, bound=None):
    """Packed importance keys `[B, Q, H_kv, Mp]` int32 of every candidate position: the
    scores kernel, then `keys_from_scores`. With `return_scores`, `(keys, scores)`:
    the scores `[B, Q, H_kv, Gp, Mp]` float32 (scaled by alpha; only the real heads'
    rows of the valid tiles are written) for `merge_scored_pallas`.

    `q [B, Q, H_kv, Gp, Kp]`; `parents [B, Q/BQ, H_kv, P]` and `n [B, Q/BQ, H_kv, 1]`
    one row per block of `BQ = st.block_queries` queries that share them; `k_phases` the
    layer's keys from `rotate_phases`, as `key_operands(..., st.precision,
    st.importance_operands)`. Holds `B * Q * H_kv * Gp * Mp` float32 scores meanwhile.
    `split > 1`: the kv heads are virtual, `split` per real one (`plan.split_heads`,
    `Gp = st.group` rows each): the keys (and importance) are those of the real kv heads,
    `[B, Q, H_kv / split, Mp]`, from the whole group's scores; the scores stay virtual.
    `bound` (SPEC 11, `selection="bound"`): `(qn [B, Q, H_kv, Gp, Gn] float32, rho)`, the
    query rows' feature-group norms and `key_operands` of the layer's radii `[B, H_kv, N,
    Gn]`: the keys rank by the bound scores (stored meanwhile beside the scores); the
    scores returned are still the plain ones, for the merge.
    """
    check_key_parts(k_phases, (key_parts(st.precision, st.importance_operands),))
    B, Q, H_kv, gp = q.shape[:4]
    Mp = cos.shape[0]
    sp = block_specs(st, gp, q.shape[-1], Mp, parents, k_phases, None)
    queries, tables = full_width_inputs(q, cos, sin)
    score_shape = jax.ShapeDtypeStruct((B, Q, H_kv, gp, Mp), jnp.float32)
    extra_specs, extra, extra_out = [], (), []
    if bound is not None:
        qn, rho = bound
        bound_specs = block_specs(st, gp, qn.shape[-1], Mp, parents, rho, None)
        extra_specs, extra, extra_out = [bound_specs["q"], *bound_specs["k"]], (qn, *rho), [score_shape]
    scores, *bounds, shift = pl.pallas_call(
        functools.partial(_scores_kernel, st=st, bound_parts=0 if bound is None else len(bound[1])),
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



# ---------------------------------------------------------------------------------------
# The decode walk's scores (`pallas_kernels/decode.py`): a cache's keys read as stored
# (un-rotated) and rotated after the gather; a query's candidates split over programs.


def feature_pieces(width: int) -> tuple:
    """`(start, size)` power-of-two pieces covering `[0, width)`, largest first."""
    pieces, start = [], 0
    for bit in reversed(range(width.bit_length())):
        if width & (1 << bit):
            pieces.append((start, 1 << bit))
            start += 1 << bit
    return tuple(pieces)


def half_pieces(half: int, latent: int) -> tuple:
    """`(start, size, rotated)` power-of-two pieces of a RoPE half `[0, half)` whose first
    `latent` features do not rotate (SPEC 7's partial RoPE in `rope_layout` order): those
    read as stored and scored without a rotation, when both parts split into pieces a
    dot takes (multiples of 16); else every piece rotated (the unrotated features by the
    tables' angle 0, an identity)."""
    if 0 < latent < half and latent % 16 == 0 and (half - latent) % 16 == 0:
        return (tuple((a, size, False) for a, size in feature_pieces(latent))
                + tuple((latent + a, size, True) for a, size in feature_pieces(half - latent)))
    return tuple((a, size, True) for a, size in feature_pieces(half))


def cache_span_scores(p0, q_lo, q_hi, par_ref, k_ref, cos_ref, sin_ref, n, st: LayerStatic, precision, operands,
                      k_scale_ref=None):
    """Scores `[Gp, span]` of candidate positions `[p0, p0 + span)` (`p0` a multiple of
    the span), their validity, positions, nodes and the unrotated key tiles as gathered
    (`{start in the row: [span, size]}`, which a merge of values read from the keys folds
    again). Keys are gathered un-rotated; the rotated pieces are rotated here by
    `p - p0`, the query's by `n - 1 - p0`; the unrotated ones (`st.latent_half`) are
    scored as stored (`stored_dot`). `k_scale_ref` (FP8 keys, `[N]` float32 row scales):
    the gathered rows are widened to the query's dtype (exact: every e4m3 value is a
    bfloat16 and a float16), and each candidate's score is scaled by its row's scale."""
    r, span = st.r, st.span
    half = cos_ref.shape[-1]
    positions, valid, nodes = span_candidates(par_ref, p0, span, n, r)
    angle = jnp.maximum(n - 1 - p0, 0)  # an invalid span: any row, masked by the caller
    scores, tiles = None, {}
    widen = (lambda x, like: x.astype(like.dtype)) if k_scale_ref is not None else (lambda x, like: x)
    for (start, size, rotated), q_lo, q_hi in zip(half_pieces(half, st.latent_half), q_lo, q_hi):
        k_lo, k_hi = widen(k_ref[nodes, pl.ds(start, size)], q_lo), widen(k_ref[nodes, pl.ds(half + start, size)], q_hi)
        if not rotated:
            tiles[start], tiles[half + start] = k_lo, k_hi
            piece = stored_dot(q_lo, k_lo, precision, operands) + stored_dot(q_hi, k_hi, precision, operands)
        else:
            k_lo, k_hi = k_lo.astype(jnp.float32), k_hi.astype(jnp.float32)
            kc, ks = cos_ref[pl.ds(0, span), pl.ds(start, size)], sin_ref[pl.ds(0, span), pl.ds(start, size)]
            k_lo, k_hi = k_lo * kc - k_hi * ks, k_lo * ks + k_hi * kc
            c, s = cos_ref[pl.ds(angle, 1), pl.ds(start, size)], sin_ref[pl.ds(angle, 1), pl.ds(start, size)]
            r_lo, r_hi = q_lo * c - q_hi * s, q_lo * s + q_hi * c
            piece = score_dot(r_lo, (k_lo,), precision, operands) + score_dot(r_hi, (k_hi,), precision, operands)
        scores = piece if scores is None else scores + piece
    if k_scale_ref is not None:
        scores = scores * k_scale_ref[nodes][None, :]
    return st.alpha * scores, valid, positions, nodes, tiles


def stored_tile_starts(half: int, latent: int) -> set:
    """`(start, size)` of the key tiles `cache_span_scores` gathers as stored (both RoPE
    halves' unrotated pieces)."""
    return {(h + a, size) for a, size, rotated in half_pieces(half, latent) if not rotated for h in (0, half)}


def held_query_rows(q_pieces, keep):
    """The query's stored (16-bit) pieces through a select on `keep`, a scalar the
    compiler cannot fold (always true where it is used). Without it two pipeline stages
    of the MLA step's scores do not fit (237824 B of shared memory asked of 232448, as
    much as two key tiles, the query rows and the rotated RoPE operands take); with it
    they do, so the rows are then presumably not held in shared memory for the whole
    loop (not verified); the two stages ran faster (journal, 2026-11-25 (8)). The bottom
    merge does without it (`merge._cache_merge_kernel`)."""
    return [x if x.dtype == jnp.float32 else jnp.where(keep, x, jnp.zeros_like(x)) for x in q_pieces]


def cache_split_spans(n, st: LayerStatic):
    """`(start, count)`: the first position of this program's split and how many of its
    spans hold valid candidates."""
    start = pl.program_id(3) * st.tile
    count = jnp.clip((n - start + st.span - 1) // st.span, 0, st.tile // st.span)
    return start, count


def cache_query_halves(q_ref, st: LayerStatic):
    """The query's RoPE halves, each as its `half_pieces`: the rotated ones float32, the
    unrotated ones as stored (`q_ref`'s dtype)."""
    half = q_ref.shape[-1] // 2
    pieces = half_pieces(half, st.latent_half)
    load = lambda a, size, rotated: q_ref[:, pl.ds(a, size)].astype(jnp.float32 if rotated else q_ref.dtype)
    return ([load(a, size, rotated) for a, size, rotated in pieces],
            [load(half + a, size, rotated) for a, size, rotated in pieces])


def cache_specs(gp: int, Mp: int, st: LayerStatic, layer_n: int, K: int | None = None, V: int | None = None,
           heads_per_layer_head: int = 1, value_width: int | None = None):
    """BlockSpecs of a grid `(B, Q, H_kv, splits)`; those of the keys, queries and RoPE
    tables need `K`, those of the values and states `V` (the layer the values are read
    from `value_width` features wide, `None`: `V`). `heads_per_layer_head > 1`:
    the grid's kv heads are virtual, that many per kv head of the layers
    (`plan.split_heads`), which are read in place, not repeated."""
    per = heads_per_layer_head
    W = st.tile
    query = lambda *tail: pl.BlockSpec((None, None, None) + tail, lambda b, i, h, s: (b, i, h) + (0,) * len(tail))
    split = lambda *tail: pl.BlockSpec((None, None, None) + tail[:-1] + (W,),
                                       lambda b, i, h, s: (b, i, h) + (0,) * (len(tail) - 1) + (s,))
    partial = lambda *tail: pl.BlockSpec((None, None, None, None) + tail,
                                         lambda b, i, h, s: (b, i, h, s) + (0,) * len(tail))
    layer = lambda D: pl.BlockSpec((None, layer_n, None, D), lambda b, i, h, s: (b, 0, h // per, 0))
    specs = dict(parents=query(Mp // st.r), n=query(1), tau=query(1), keys=split(Mp), scores=split(gp, Mp),
                 vec=partial(gp))
    if K is not None:
        specs.update(q=query(gp, K), k=layer(K), table=pl.BlockSpec((Mp, K // 2), lambda b, i, h, s: (0, 0)))
    if V is not None:
        specs.update(v=layer(value_width or V), mat=partial(gp, V))
    return specs


def partial_shapes(B, Q, H_kv, splits, gp, V=None):
    vec = jax.ShapeDtypeStruct((B, Q, H_kv, splits, gp), jnp.float32)
    return [vec, vec] if V is None else [vec, vec, jax.ShapeDtypeStruct((B, Q, H_kv, splits, gp, V), jnp.float32)]


def cache_bound_reach(qn_ref, rho_ref, nodes, st: LayerStatic):
    """SPEC 11's `sum over groups of ||q[group]|| * rho[node, group]` `[Gp, span]` for the
    gathered `nodes`: `qn [Gp, n_groups]` float32 (the query rows' group norms), `rho
    [N, n_groups]` float32 the layer's radii as the cache stores them. Groups in
    power-of-two pieces; those under a dot's least width (16) column by column."""
    reach = None
    for start, size in feature_pieces(qn_ref.shape[-1]):
        if size >= 16:
            piece = score_dot(qn_ref[:, pl.ds(start, size)], (rho_ref[nodes, pl.ds(start, size)],), st.precision,
                              st.importance_operands)
        else:
            piece = None
            for c in range(start, start + size):
                column = qn_ref[:, c][:, None] * rho_ref[nodes, c][None, :]
                piece = column if piece is None else piece + column
        reach = piece if reach is None else reach + piece
    return reach


def _cache_scores_kernel(q_ref, par_ref, n_ref, k_ref, cos_ref, sin_ref, *refs, st: LayerStatic, bound: bool):
    """One split of a selecting layer: its candidates' scores (stored, real heads' rows)
    and its rows' running max and sum of `exp` over R (SPEC 2.3). With `bound` (SPEC 11)
    the query rows' group norms and the layer's radii follow the tables, and the bound
    scores are stored beside the scores: the max and sum are the bound's (the
    importance ranks by it), the merge reads the scores."""
    if bound:
        qn_ref, rho_ref, s_ref, b_ref, m_ref, t_ref = refs
    else:
        s_ref, m_ref, t_ref = refs
    gp = q_ref.shape[0]
    n = n_ref[0]
    q_lo, q_hi = cache_query_halves(q_ref, st)
    start, count = cache_split_spans(n, st)
    last_in_norm = n - 1 if st.strict_causal else n
    real_rows = jnp.broadcast_to((jnp.arange(gp, dtype=jnp.int32) < st.group)[:, None], (gp, st.span))

    def score_span(j, carry):
        lo, hi = q_lo, q_hi
        if st.num_stages > 1:
            lo, hi = held_query_rows(q_lo, j < count), held_query_rows(q_hi, j < count)
        scores, _, positions, nodes, _ = cache_span_scores(start + j * st.span, lo, hi, par_ref, k_ref, cos_ref,
                                                           sin_ref, n, st, st.precision, st.importance_operands)
        plgpu.store(s_ref.at[:, pl.ds(j * st.span, st.span)], scores, mask=real_rows)
        if bound:
            scores = scores + st.alpha * cache_bound_reach(qn_ref, rho_ref, nodes, st)
            plgpu.store(b_ref.at[:, pl.ds(j * st.span, st.span)], scores, mask=real_rows)
        return online_max_sum(*carry, jnp.where((positions < last_in_norm)[None, :], scores, NEG_INF))

    init = (jnp.full((gp,), NEG_INF, jnp.float32), jnp.zeros((gp,), jnp.float32))
    m, total = lax.fori_loop(0, count, score_span, init)
    m_ref[...] = m
    t_ref[...] = total


@functools.partial(jax.jit, static_argnames=("st", "interpret"))
def decode_scores_pallas(q, parents, n, layer_k, cos, sin, st: LayerStatic, interpret: bool = False, bound=None):
    """`(scores [B, Q, H_kv, Gp, Mp], m, total [B, Q, H_kv, splits, Gp])` of a selecting
    layer: the stored scores and each split's running max / sum over R. `bound` (SPEC
    11): `(qn [B, Q, H_kv, Gp, n_groups], rho [B, N, H_kv, n_groups])` float32, the query
    rows' group norms and the layer's radii; then `(scores, bound scores, m, total)`,
    the max and sum the bound scores'."""
    B, Q, H_kv, gp, K = q.shape
    Mp = cos.shape[0]
    splits = Mp // st.tile
    per = H_kv // layer_k.shape[2]
    sp = cache_specs(gp, Mp, st, layer_k.shape[1], K=K, heads_per_layer_head=per)
    score_shape = jax.ShapeDtypeStruct((B, Q, H_kv, gp, Mp), jnp.float32)
    extra, extra_specs, extra_out = (), [], []
    if bound is not None:
        qn, rho = bound
        groups = qn.shape[-1]
        extra = (qn, rho)
        extra_specs = [pl.BlockSpec((None, None, None, gp, groups), lambda b, i, h, s: (b, i, h, 0, 0)),
                       pl.BlockSpec((None, rho.shape[1], None, groups), lambda b, i, h, s: (b, 0, h // per, 0))]
        extra_out = [score_shape]
    return pl.pallas_call(
        functools.partial(_cache_scores_kernel, st=st, bound=bound is not None),
        grid=(B, Q, H_kv, splits),
        in_specs=[sp["q"], sp["parents"], sp["n"], sp["k"], sp["table"], sp["table"], *extra_specs],
        out_specs=[sp["scores"]] * (1 + len(extra_out)) + [sp["vec"], sp["vec"]],
        out_shape=[score_shape, *extra_out] + partial_shapes(B, Q, H_kv, splits, gp),
        compiler_params=compiler_params(st.num_warps, st.num_stages),
        interpret=interpret,
    )(q, parents, n, layer_k, cos, sin, *extra)


def _cache_keys_kernel(s_ref, shift_ref, n_ref, keys_ref, *, st: LayerStatic):
    """`keys_from_scores` of one tile of candidates: the real rows' `exp(score - shift)`
    summed, packed (SPEC 2.3). Rows `>= st.group` and positions `>= n` were never stored
    (read, then masked); a tile wholly past `n` reads nothing (the top layer's buffer is
    half empty at T=131072)."""
    n = n_ref[0]
    rows, tile = s_ref.shape
    first = pl.program_id(3) * tile

    @pl.when(first < n)
    def _():
        positions = first + jnp.arange(tile, dtype=jnp.int32)
        take = (jnp.arange(rows, dtype=jnp.int32) < st.group)[:, None] & (positions < n)[None, :]
        weights = jnp.where(take, jnp.exp(s_ref[...] - shift_ref[...][:, None]), 0.0)
        keys_ref[...] = packed_keys(jnp.sum(weights, axis=0), n, st.strict_causal, st.log_n, positions=positions)

    @pl.when(first >= n)
    def _():
        keys_ref[...] = jnp.full((tile,), -1, jnp.int32)


# Candidates per program of `decode_keys_pallas` (128 rows of float32 scores: 32 KiB).
KEYS_TILE = 64


@functools.partial(jax.jit, static_argnames=("st", "split", "interpret"))
def decode_keys_pallas(scores, shift, n, st: LayerStatic, split: int = 1, interpret: bool = False):
    """`group_keys_from_scores` in a kernel: packed keys `[B, Q, H_kv / split, Mp]` of the
    stored scores `[B, Q, H_kv, Gp, Mp]`, shifts `[B, Q, H_kv, Gp]` and `n [B, Q, H_kv,
    1]` (kv heads virtual, `split` per kv head, as `group_keys_from_scores`). XLA's
    fusion put the heads minor first (a transpose of every score; journal, 2026-11-25 (8))."""
    scores, shift, n, st = whole_groups(scores, shift, n, st, split)
    B, Q, H_kv, rows, Mp = scores.shape
    tile = min(KEYS_TILE, Mp)
    grid = (B, Q, H_kv, Mp // tile)
    return pl.pallas_call(
        functools.partial(_cache_keys_kernel, st=st),
        grid=grid,
        in_specs=[pl.BlockSpec((None, None, None, rows, tile), lambda b, i, h, c: (b, i, h, 0, c)),
                  pl.BlockSpec((None, None, None, rows), lambda b, i, h, c: (b, i, h, 0)),
                  pl.BlockSpec((None, None, None, 1), lambda b, i, h, c: (b, i, h, 0))],
        out_specs=pl.BlockSpec((None, None, None, tile), lambda b, i, h, c: (b, i, h, c)),
        out_shape=jax.ShapeDtypeStruct(grid[:3] + (Mp,), jnp.int32),
        compiler_params=compiler_params(4, 1),
        interpret=interpret,
    )(scores, shift, n)


def combine_max_sum(m, total):
    """Per-split running `(max, sum of exp)` `[..., splits, rows]` -> the rows' `(max, sum)`."""
    m_all = jnp.max(m, axis=-2)
    m_safe = jnp.where(m_all == NEG_INF, 0.0, m_all)
    return m_all, jnp.sum(total * jnp.exp(m - m_safe[..., None, :]), axis=-2)
