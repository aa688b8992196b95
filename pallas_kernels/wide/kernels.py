"""Wide groups (G >= 32 heads per kv head: latent attention's 64-128 heads over one
latent key) in kernels of their own: one program per `(b, t, h_kv, head block)` walks
the query's candidate buffer `tile` candidates a step, and every gathered key row feeds
the block's `rows` heads (64 at the MLA shape: the row count that makes a gathered tile
worth its bytes, `tools/probes/mla_sparse_feasibility.py`).

Features come in two parts, scored as two products and never padded as a whole:
- the *latent* part, the `K - R` unrotated features (`R = rope_dim`; 512 at the MLA
  shape), read in power-of-two pieces (`feature_pieces`) straight from the stored layer:
  no rotation, no copy. For bfloat16/float16 inputs both operands are the stored values,
  so its products are exact and one product serves the importance too;
- the *RoPE* part, the `R` rotated features as rotate-half halves (each padded to a
  power of two, at least 16), stored in `tile / r` rotated copies
  (`rope.rotate_phases`'s scheme) so the query is rotated once per step.
Values are their own array, or the first `V` latent features of the keys (DeepSeek's
absorbed form: `v=None`, read from the keys without a copy).

A layer that selects runs two launches: `wide_importance_pallas` (one pass over the
candidates: every row's scores stored, `G * Mp` float32 a query, 512 KB at G=128 and
`top_k=64`, held for one chunk of queries; and each row's max and sum over R), the
group's importance summed from the stored scores in XLA (`combine_importance`), and,
after the shared top-K, `wide_merge_pallas` over the candidates it did not keep, from
the plain scores the importance stored (with the bound, beside its `b`): only the
values' product. A second importance pass that recomputed the scores instead of storing
them cost the bound's importance twice its products, and scoring again in the merge
cost the layer-1 merge 2.6x (H100, 128K; journal, 2026-11-27 (5)). The bottom layer
scores and merges everything and normalises. The top layer runs as any other, its
parents the virtual `0, 1, ...`.

The twin of the whole path is the JAX reference (`tests/test_wide.py`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.shared.common import NEG_INF, LayerStatic, WideBound, compiler_params, span_candidates
from pallas_kernels.shared.importance import importance_shift, keys_from_scores
from pallas_kernels.shared.precision import dot_rows, split_rows, weighted_values
from pallas_kernels.shared.softmax import fold, fold_max_sum, log_sum_exp, normalized


class WideLayer(NamedTuple):
    """One layer as the wide merge and backward launches take it beside the queries:
    `parents`, `n` (as `wide_importance_pallas` takes them), the kept candidates'
    packed `keys [B, Q, H_kv, Mp]` and threshold `tau [B, Q, H_kv, 1]` (merged: valid
    and `keys < tau`; None, None: the bottom layer, every valid candidate), the layer's
    latent keys `lat`, its RoPE copies `rope` as `key_operands` for the merge dots (`()`
    where stored scores are read instead), its `values [B, H_kv, N, Wv]` (None: the first
    `Wv` latent features of `lat`) and `tables = (cos, sin) [Mp, 2 hp]`."""

    parents: Any
    n: Any
    keys: Any
    tau: Any
    lat: Any
    rope: Any
    values: Any
    tables: Any


@dataclasses.dataclass(frozen=True)
class WideStatic:
    """Everything static about one wide launch."""

    r: int
    tile: int  # candidates per step, a multiple of r: one query rotation serves them
    rows: int  # heads per program (a power of two dividing G)
    alpha: float
    importance: str
    strict_causal: bool
    lat_pieces: tuple  # `(start, size)` power-of-two pieces of the latent part
    value_pieces: tuple  # the same for the values (of `v`, or of the latent keys)
    precision: object  # importance dots (RoPE part, radii; the latent part when float32)
    importance_operands: str | None
    merge_precision: object
    merge_operands: str | None
    num_warps: int = 8
    num_stages: int = 1  # the merges'
    importance_stages: int = 1
    importance_tile: int = 0  # the importance kernel's step (a multiple of r dividing `tile`); 0: `tile`


def _dims():
    return (((1,), (1,)), ((), ()))


def latent_dots(q_pieces, k_ref, nodes, pieces, precision):
    """`(sum over pieces of q_piece @ k[nodes, piece].T` `[rows, C]` float32, the
    gathered pieces)`: the latent part (stored values on both sides: exact products for
    16-bit inputs). The merge folds the values from the same tiles when they are the
    latent features (one gather a step, not two)."""
    tiles = [k_ref[nodes, pl.ds(start, size)] for start, size in pieces]
    return latent_product(q_pieces, tiles, precision), tiles


def latent_product(q_pieces, k_tiles, precision):
    """`sum over pieces of q_piece @ k_tile.T` `[rows, C]` float32 (16-bit tiles: exact
    products in their dtype; float32 ones at `precision`)."""
    scores = None
    for q, k in zip(q_pieces, k_tiles):
        prec = precision if k.dtype == jnp.float32 else None
        d = lax.dot_general(q, k.astype(q.dtype), _dims(), preferred_element_type=jnp.float32, precision=prec)
        scores = d if scores is None else scores + d
    return scores


def exact_left_dots(a_pieces, k_refs, nodes, pieces, precision):
    """`a @ (sum of parts)[nodes].T` with `a` exact in the parts' dtype (`|q|` of 16-bit
    queries against `BF16X3`-split radii: two products, float32-grade)."""
    total = None
    for (start, size), a in zip(pieces, a_pieces):
        for k_ref in k_refs:
            k = k_ref[nodes, pl.ds(start, size)]
            prec = precision if k.dtype == jnp.float32 else None
            d = lax.dot_general(a.astype(k.dtype), k, _dims(), preferred_element_type=jnp.float32, precision=prec)
            total = d if total is None else total + d
    return total


def _tile_scores(i, q_lat, q_rope, par_ref, n, lat_ref, rope_refs, cf_ref, sf_ref, ws: WideStatic, precision,
                 operands, tile: int):
    """Scores `[rows, tile]` (alpha applied) of candidate positions `[i*tile, (i+1)*tile)`,
    their validity, positions and nodes, and the gathered latent pieces. `tile` divides
    `ws.tile` (the RoPE copies' span): a step reads copies `0 .. tile/r - 1`."""
    r = ws.r
    p0 = i * tile
    positions, valid, nodes = span_candidates(par_ref, p0, tile, n, r)
    N = rope_refs[0].shape[0] // (ws.tile // r)
    copy = (jnp.arange(tile, dtype=jnp.int32) // r) * N
    angle = jnp.maximum(n - 1 - p0, 0)  # an invalid tile: any row, masked later
    q, q_half = q_rope
    rotated = q * cf_ref[pl.ds(angle, 1), :] + q_half * sf_ref[pl.ds(angle, 1), :]
    scores = dot_rows(split_rows(rotated, precision, operands), tuple(k[nodes + copy, :] for k in rope_refs),
                      precision, operands)
    tiles = []
    if ws.lat_pieces:
        lat_scores, tiles = latent_dots(q_lat, lat_ref, nodes, ws.lat_pieces, precision)
        scores = scores + lat_scores
    return ws.alpha * scores, valid, positions, nodes, tiles


def _query_parts(ql_ref, qr_ref, qh_ref, pieces, dtype):
    q_lat = [ql_ref[:, pl.ds(start, size)].astype(dtype) for start, size in pieces]
    return q_lat, (qr_ref[...].astype(jnp.float32), qh_ref[...].astype(jnp.float32))


def _importance_kernel(ql_ref, qr_ref, qh_ref, par_ref, n_ref, lat_ref, *refs, ws: WideStatic, rope_parts: int,
                       bound_parts: int):
    """One query's head block in one pass: the scores of every valid tile (SPEC 2.2; with
    the bound, SPEC 11's `b`, and the plain scores beside them for the merge) stored, and
    each row's shift (`softmax`: its LSE over R; `shared_max`: its max over R;
    `combine_importance` takes the group's max)."""
    rope_refs, (cf_ref, sf_ref, *refs) = refs[:rope_parts], refs[rope_parts:]
    bound = plain_ref = None
    if bound_parts:
        qnl_ref, qnp_ref, *rho = refs[:-3]
        bound = WideBound(qnl_ref, qnp_ref, rho[:bound_parts], rho[bound_parts:])
        plain_ref = refs[-1]
    scores_ref, shift_ref = refs[-3:-1] if bound_parts else refs[-2:]
    precision, operands = ws.precision, ws.importance_operands
    n = n_ref[0]
    q_lat, q_rope = _query_parts(ql_ref, qr_ref, qh_ref, ws.lat_pieces, ql_ref.dtype)
    if bound is not None:
        qn_lat = [bound.latent_norms[:, pl.ds(start, size)] for start, size in ws.lat_pieces]
        qn_pair = split_rows(bound.pair_norms[...], precision, operands)
    tile = ws.importance_tile or ws.tile
    num_tiles = (n + tile - 1) // tile
    last_in_norm = n - 1 if ws.strict_causal else n  # R: valid positions, less the rightmost when strict

    def step(i, carry):
        scores, _, positions, nodes, _ = _tile_scores(i, q_lat, q_rope, par_ref, n, lat_ref, rope_refs,
                                                      cf_ref, sf_ref, ws, precision, operands, tile)
        if bound is not None:  # SPEC 11: + alpha * sum over feature groups of |q| * rho
            plain_ref[:, pl.ds(i * tile, tile)] = scores
            reach = dot_rows(qn_pair, tuple(k[nodes, :] for k in bound.pair_radii), precision, operands)
            if ws.lat_pieces:
                reach = reach + exact_left_dots(qn_lat, bound.latent_radii, nodes, ws.lat_pieces, precision)
            scores = scores + ws.alpha * reach
        scores_ref[:, pl.ds(i * tile, tile)] = scores
        return fold_max_sum(*carry, jnp.where((positions < last_in_norm)[None, :], scores, NEG_INF))

    init = (jnp.full((ws.rows,), NEG_INF, jnp.float32), jnp.zeros((ws.rows,), jnp.float32))
    m, total = lax.fori_loop(0, num_tiles, step, init)
    shift_ref[...] = m if ws.importance == "shared_max" else importance_shift(m, total, None, ws.rows, "softmax")


def _bound_inputs(bound: WideBound, grid_spec_query, grid_spec_layer):
    qn_lat, qn_pair, rho_lat, rho_pair = bound
    specs = [grid_spec_query(qn_lat), grid_spec_query(qn_pair)] + [grid_spec_layer(x) for x in (*rho_lat, *rho_pair)]
    return specs, (qn_lat, qn_pair, *rho_lat, *rho_pair)


def query_specs(ws: WideStatic):
    """BlockSpec makers for a grid `(B, Q, H_kv, G / rows)`."""
    rows = ws.rows
    query_rows = lambda x: pl.BlockSpec((None, None, None, rows, x.shape[-1]), lambda b, t, h, j: (b, t, h, j, 0))
    per_query = lambda x: pl.BlockSpec((None, None, None, x.shape[-1]), lambda b, t, h, j: (b, t, h, 0))
    layer = lambda x: pl.BlockSpec((None, None) + x.shape[2:], lambda b, t, h, j: (b, h, 0, 0))
    table = lambda x: pl.BlockSpec(x.shape, lambda b, t, h, j: (0, 0))
    row_vec = pl.BlockSpec((None, None, None, rows), lambda b, t, h, j: (b, t, h, j))
    return query_rows, per_query, layer, table, row_vec


@functools.partial(jax.jit, static_argnames=("ws", "interpret"))
def wide_importance_pallas(queries, parents, n, lat, rope_imp, tables, ws: WideStatic, interpret=False, bound=None):
    """Per query `(ranked, shift, scores)`: the scores the importance ranks by, of every
    candidate position `[B, Q, H_kv, G, Mp]` float32 (SPEC 2.2, alpha applied; with
    `bound` SPEC 11's `b`; written where valid, whole steps), each row's shift `[B, Q,
    H_kv, G]` (`softmax`: its LSE over R, 0 where R is empty; `shared_max`: its max over
    R), which `combine_importance` turns into packed keys; and the plain scores for the
    merge (`wide_merge_pallas(scores=...)`: with the bound a second array, else
    `ranked`).

    `queries = (q_lat [B, Q, H_kv, G, Wl], q_rope, rotate_half(q_rope) [B, Q, H_kv, G,
    Wr])` (q_lat stored dtype, the RoPE part un-rotated); `parents [B, Q, H_kv, P]`, `n
    [B, Q, H_kv, 1]`; `lat [B, H_kv, N, Wl]` the stored layer's latent part; `rope_imp`
    its RoPE part's `tile / r` rotated copies as `key_operands` for the importance dots
    `[B, H_kv, copies * N, Wr]`; `tables = (cos, sin) [Mp, Wr]` full width. `bound`
    (SPEC 11): `(|q_lat| [.., G, Wl], pair norms [.., G, Wp], rho_lat parts [B, H_kv, N,
    Wl], rho_pair parts [B, H_kv, N, Wp])`."""
    q_lat, q_rope, q_half = queries
    B, Q, H_kv, G, _ = q_rope.shape
    Mp = tables[0].shape[0]
    query_rows, per_query, layer, table, row_vec = query_specs(ws)
    in_specs = [query_rows(q_lat), query_rows(q_rope), query_rows(q_half), per_query(parents), per_query(n),
                layer(lat), *[layer(x) for x in rope_imp], table(tables[0]), table(tables[1])]
    args = [q_lat, q_rope, q_half, parents, n, lat, *rope_imp, *tables]
    bound_parts = 0
    if bound is not None:
        specs, extra = _bound_inputs(bound, query_rows, layer)
        in_specs += specs
        args += list(extra)
        bound_parts = len(bound.latent_radii)
    score_spec, score_shape = score_rows(ws, Mp), jax.ShapeDtypeStruct((B, Q, H_kv, G, Mp), jnp.float32)
    scores, shift, *plain = pl.pallas_call(
        functools.partial(_importance_kernel, ws=ws, rope_parts=len(rope_imp), bound_parts=bound_parts),
        grid=(B, Q, H_kv, G // ws.rows),
        in_specs=in_specs,
        out_specs=[score_spec, row_vec] + ([score_spec] if bound is not None else []),
        out_shape=[score_shape, jax.ShapeDtypeStruct((B, Q, H_kv, G), jnp.float32)]
        + ([score_shape] if bound is not None else []),
        compiler_params=compiler_params(ws.num_warps, ws.importance_stages),
        interpret=interpret,
    )(*args)
    return scores, shift, (plain[0] if plain else scores)


def score_rows(ws: WideStatic, Mp: int):
    """The BlockSpec of a head block's stored scores `[B, Q, H_kv, G, Mp]` on the grid of
    `query_specs`."""
    return pl.BlockSpec((None, None, None, ws.rows, Mp), lambda b, t, h, j: (b, t, h, j, 0))


def combine_importance(scores, shift, n, st: LayerStatic, export: bool = False):
    """Packed importance keys `[B, Q, H_kv, Mp]` (SPEC 2.3) from `wide_importance_pallas`'s
    scores `[B, Q, H_kv, G, Mp]` and rows' shifts `[B, Q, H_kv, G]` (`shared_max`: the
    group's max over its rows' maxima, 0 where R is empty), in one fused XLA pass over
    the scores (`keys_from_scores`)."""
    if st.importance == "shared_max":
        group_max = jnp.max(shift, axis=-1, keepdims=True)
        shift = jnp.broadcast_to(jnp.where(group_max == NEG_INF, 0.0, group_max), shift.shape)
    return keys_from_scores(scores, shift, n, st, export)


def layer_refs(refs, bottom: bool, rope_parts: int, own_values: bool):
    """A merge-like kernel's layer refs, in the order the wrappers pass them: `(keys,
    tau` (None at the bottom)`, lat, rope parts, values` (`lat` when the values are the
    keys' latent features)`, the remaining refs)`."""
    keys_ref = tau_ref = None
    if not bottom:
        keys_ref, tau_ref, *refs = refs
    lat_ref, *refs = refs
    rope_refs, refs = tuple(refs[:rope_parts]), refs[rope_parts:]
    v_ref = lat_ref
    if own_values:
        v_ref, *refs = refs
    return keys_ref, tau_ref, lat_ref, rope_refs, v_ref, refs


def layer_inputs(keys, tau, lat, rope_parts, values, ws: WideStatic):
    """`(BlockSpecs, arrays)` of a merge-like launch's layer inputs on the grid of
    `query_specs`, in `layer_refs`'s order (`keys=None`: the bottom; `values=None`: the
    keys' latent features)."""
    _, per_query, layer, _, _ = query_specs(ws)
    specs, arrays = [], []
    if keys is not None:
        specs += [per_query(keys), per_query(tau)]
        arrays += [keys, tau]
    specs += [layer(lat), *[layer(x) for x in rope_parts]]
    arrays += [lat, *rope_parts]
    if values is not None:
        specs.append(layer(values))
        arrays.append(values)
    return specs, arrays


def _merge_kernel(ql_ref, qr_ref, qh_ref, par_ref, n_ref, *refs, ws: WideStatic, bottom: bool, rope_parts: int,
                  own_values: bool, return_lse: bool, scored: bool):
    """One query's head block: the candidates this layer merges (every valid one at the
    bottom; else those with `keys < tau`), scored with the merge dots (`scored`: their
    scores read as the importance stored them) and folded into the state; the bottom
    writes `U / S` (and the rows' LSE), the others the state."""
    keys_ref, tau_ref, lat_ref, rope_refs, v_ref, refs = layer_refs(refs, bottom, rope_parts, own_values)
    cf_ref, sf_ref, m_ref, s_ref, u_ref, *out_refs = refs
    stored_ref = None
    if scored:
        stored_ref, *out_refs = out_refs
    precision, operands = ws.merge_precision, ws.merge_operands
    n = n_ref[0]
    if not scored:
        q_lat, q_rope = _query_parts(ql_ref, qr_ref, qh_ref, ws.lat_pieces, ql_ref.dtype)
    num_tiles = (n + ws.tile - 1) // ws.tile
    tau = None if bottom else tau_ref[0]

    def step(i, carry):
        if scored:
            _, valid, nodes = span_candidates(par_ref, i * ws.tile, ws.tile, n, ws.r)
            scores, tiles = stored_ref[:, pl.ds(i * ws.tile, ws.tile)], []
        else:
            scores, valid, _, nodes, tiles = _tile_scores(i, q_lat, q_rope, par_ref, n, lat_ref, rope_refs,
                                                          cf_ref, sf_ref, ws, precision, operands, ws.tile)
        gathered = dict(zip(ws.lat_pieces, tiles)) if not own_values else {}
        merged = valid
        if not bottom:
            merged = merged & (keys_ref[pl.ds(i * ws.tile, ws.tile)] < tau)
        scores = jnp.where(merged[None, :], scores, NEG_INF)

        def weighted(w):  # each value piece, from the gathered key tiles where it is one
            return tuple(weighted_values(w, gathered[piece] if piece in gathered else v_ref[nodes, pl.ds(*piece)],
                                         precision, operands) for piece in ws.value_pieces)

        return fold(carry, [(scores, weighted)])

    acc = tuple(u_ref[:, pl.ds(start, size)] for start, size in ws.value_pieces)
    state = lax.fori_loop(0, num_tiles, step, (m_ref[...], s_ref[...], acc))
    m, total, acc = state
    if bottom:
        o_ref = out_refs[0]
        for (start, size), o in zip(ws.value_pieces, normalized(state)):
            o_ref[:, pl.ds(start, size)] = o.astype(o_ref.dtype)
        if return_lse:
            out_refs[1][...] = log_sum_exp(state)
    else:
        m_out, s_out, u_out = out_refs
        m_out[...] = m
        s_out[...] = total
        for (start, size), a in zip(ws.value_pieces, acc):
            u_out[:, pl.ds(start, size)] = a


@functools.partial(jax.jit, static_argnames=("ws", "interpret", "out_dtype", "return_lse"))
def wide_merge_pallas(queries, layer: WideLayer, state, ws: WideStatic, interpret=False, out_dtype=None,
                      return_lse=False, scores=None):
    """SPEC 2.4 for wide groups: folds `layer`'s merged candidates (`WideLayer`) into
    `state = (m, S [B, Q, H_kv, G], U [B, Q, H_kv, G, Wv])` float32; with `layer.keys =
    None`, the bottom layer (every valid candidate), it returns `o [B, Q, H_kv, G, Wv]`
    in `out_dtype` (and the rows' LSE with `return_lse`). `queries` as for
    `wide_importance_pallas` (`q_lat` in the merge dots' dtype). `scores [B, Q, H_kv, G,
    Mp]` (a layer above the bottom): the plain scores `wide_importance_pallas` stored,
    read instead of scored again: the merge then makes only the values' product
    (nothing of `layer.rope` or the queries read)."""
    parents, n, keys, tau, lat, rope_merge, values, tables = layer
    q_lat, q_rope, q_half = queries
    B, Q, H_kv, G, _ = q_rope.shape
    bottom = keys is None
    query_rows, per_query, layer, table, row_vec = query_specs(ws)
    in_specs = [query_rows(q_lat), query_rows(q_rope), query_rows(q_half), per_query(parents), per_query(n)]
    args = [q_lat, q_rope, q_half, parents, n]
    specs, arrays = layer_inputs(keys, tau, lat, rope_merge, values, ws)
    in_specs += specs
    args += arrays
    in_specs += [table(tables[0]), table(tables[1]), row_vec, row_vec, query_rows(state[2])]
    args += [*tables, *state]
    if scores is not None:
        in_specs.append(score_rows(ws, scores.shape[-1]))
        args.append(scores)
    vec = jax.ShapeDtypeStruct(state[0].shape, jnp.float32)
    if bottom:
        out_specs = [query_rows(state[2])] + ([row_vec] if return_lse else [])
        out_shape = [jax.ShapeDtypeStruct(state[2].shape, out_dtype)] + ([vec] if return_lse else [])
    else:
        out_specs = [row_vec, row_vec, query_rows(state[2])]
        out_shape = [vec, vec, jax.ShapeDtypeStruct(state[2].shape, jnp.float32)]
    out = pl.pallas_call(
        functools.partial(_merge_kernel, ws=ws, bottom=bottom, rope_parts=len(rope_merge),
                          own_values=values is not None, return_lse=return_lse, scored=scores is not None),
        grid=(B, Q, H_kv, G // ws.rows),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(ws.num_warps, ws.num_stages),
        interpret=interpret,
    )(*args)
    return tuple(out) if (not bottom or return_lse) else out[0]


__all__ = ["WideLayer", "WideStatic", "combine_importance", "latent_product", "layer_inputs", "layer_refs", "query_specs",
           "wide_importance_pallas", "wide_merge_pallas"]
