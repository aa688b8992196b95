"""The decode walk's scores (`decode/walk.py` composes them): a cache's keys read as stored
(un-rotated) and rotated after the gather, a query's candidates split over programs
(`decode_scores_pallas`), then the splits' scores turned into packed importance keys
(`decode_keys_pallas`). Their full-sequence twins: `importance.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.shared.common import NEG_INF, LayerStatic, compiler_params, next_power_of_two, pad_axis, span_candidates
from pallas_kernels.shared.importance import feature_pieces, packed_keys, whole_groups
from pallas_kernels.shared.precision import score_dot, stored_dot
from pallas_kernels.shared.softmax import fold_max_sum


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
        return fold_max_sum(*carry, jnp.where((positions < last_in_norm)[None, :], scores, NEG_INF))

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
        qn, rho = bound.query_norms, bound.radii
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
    # Triton's arrays have power-of-two sizes: a whole group of 48, 80, 96 or 112 heads
    # (3, 5, 6 or 7 virtual heads of 16) takes zero rows up to the next one, which the
    # kernel masks (`st.group`).
    rows = next_power_of_two(scores.shape[3])
    scores, shift = pad_axis(scores, 3, rows), pad_axis(shift, 3, rows)
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
