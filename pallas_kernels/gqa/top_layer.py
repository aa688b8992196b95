"""Top-layer kernels (SPEC 2 for `l = L-1`), shaped like flash attention.

On the top layer the parents are virtual (`0, 1, ...`), so candidate position `p` holds
node `p` itself and the valid candidates of query `t` are the contiguous nodes
`[0, n)`, `n = floor(t / r^(L-1)) + 1`. Two consequences make this layer a dense,
block-causal attention instead of a gather:
- the key at position `p` is rotated by `p`, the same for every query, so the layer's
  keys are rotated once (`rope.rotate_keys`, float32) and read as contiguous tiles;
- neighbouring queries differ only in `n`, so one program serves a block of `BQ`
  queries (`BQ * Gt` rows, `Gt = next_power_of_two(G)`), each row masked by its own `n`
  (its query is rotated by its own `n - 1` beforehand, `rope.rotate_queries`). One key tile
  feeds one `[BQ*Gt, K] x [K, tile]` product; no gathers, no RoPE tables in the kernel.
With `L = 1` (`T <= M`) the top layer is the bottom one and `top_merge_pallas(...,
keys=None)` is causal softmax attention with RoPE at absolute positions.

Packed sequences (`htree_jax.core.packing`): a query's candidates are its document's top
nodes, rows `first + p` of the layer for candidate position `p < n` (`first [B, Q,
H_kv, 1]`, 0 without packing), keys rotated by `p` (their place inside the document).
A block of queries may straddle documents: each key tile is scored once per distinct
`first` in the block (`_scores_by_document`; one pass without packing), each row taking
the pass of its own document. Packed importance keys stay document-local (position `p`).

Layouts (padded by `pallas_kernels/gqa/plan.py`):
  q_rot    `[B, Q, H_kv, Gt, Kp]` float32, `rope.rotate_queries` (each query by its `n - 1`)
  n        `[B, Q, H_kv, 1]` int32  valid candidates per query
  first    `[B, Q, H_kv, 1]` int32  the layer row of each query's candidate 0
  k_rot    `[B, H_kv, Np, Kp]` float32, `rope.rotate_keys` of the layer (`Np` a multiple of the tile;
           a tile more than the nodes when packed, for tiles read from an unaligned `first`)
  v        `[B, H_kv, Np, Vp]` stored dtype, zero rows past the layer (`common.pad_nodes`)
  keys     `[B, Q, H_kv, width]` int32 packed importance, `-1` where invalid
  state    m, S `[B, Q, H_kv, Gt]`, U `[B, Q, H_kv, Gt, Vp]` float32

The pure-JAX twins are `importance.importance_keys_twin` / `merge.merge_twin` with the
virtual parents (`htree_jax.reference.top_layer_parents`); the tests compare the two.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from htree_jax.core.config import FORCED_IMPORTANCE
from htree_jax.core.indexing import pack_importance
from pallas_kernels.gqa.merge import merge_outputs, merged_tile, read_state, write_merged
from pallas_kernels.shared.common import (NEG_INF, Bound, LayerStatic, TopInputs, compiler_params, layer_refs,
                                         merge_score_precision)
from pallas_kernels.shared.importance import importance_shift, write_key_tiles
from pallas_kernels.shared.precision import check_key_parts, dot_rows, key_parts, split_rows
from pallas_kernels.shared.softmax import fold, fold_max_sum


def block_rows(q_ref, n_ref, first_ref):
    """The block's rotated queries `[BQ*Gt, Kp]` (row `b*Gt + g`), `n` and `first` per
    query `[BQ]` (`first` None: one document per row)."""
    bq, gt, kp = q_ref.shape
    first = None if first_ref is None else first_ref[...].reshape(bq)
    return q_ref[...].reshape(bq * gt, kp), n_ref[...].reshape(bq), first


def query_refs(refs, documents: bool):
    """`((q_ref, n_ref, first_ref), rest)` of a top-layer kernel's refs; `first_ref` is
    None where each row holds one document (no `first` input)."""
    if documents:
        return tuple(refs[:3]), refs[3:]
    return (refs[0], refs[1], None), refs[2:]


def per_row(x, gt: int):
    """A per-query `[BQ]` value repeated for the `Gt` rows of each query."""
    return jnp.broadcast_to(x[:, None], (x.shape[0], gt)).reshape(x.shape[0] * gt)


_NO_DOCUMENT = 2**30
# The kernels score in base 2: `alpha * log2(e)` folded into the queries, `exp2` for
# `exp` (one multiply less per score, where the exponentials are half the work).
BASE2 = math.log2(math.e)


def by_document(first_q, body, init):
    """`body(f, carry)` once per distinct value `f` of `first_q [BQ]`, ascending: a while
    loop, so a block inside one document pays one pass. `first_q=None` (one document
    per row): `body(0, init)`, no loop; a loop around the tile's loads keeps Triton from
    pipelining them."""
    if first_q is None:
        return body(0, init)

    def step(c):
        f, carry = c
        carry = body(f, carry)
        return jnp.min(jnp.where(first_q > f, first_q, _NO_DOCUMENT)), carry

    return lax.while_loop(lambda c: c[0] < _NO_DOCUMENT, step, (jnp.min(first_q), init))[1]


def tile_rows(i, f, refs, st: LayerStatic):
    """Tile `i` of the candidates of a document whose candidate 0 is row `f`."""
    return tuple(ref[pl.ds(f + i * st.tile, st.tile), :] for ref in refs)


def _scores_by_document(i, q_parts, first_q, k_refs, st: LayerStatic, precision, operands=None, bound=None):
    """Scores `[BQ*Gt, tile]` of candidate positions `[i*tile, (i+1)*tile)` of each row's
    own document (in the units of `q_parts`: the kernels fold `alpha * log2(e)` into the
    queries), and those positions `[tile]`. `bound`: a `common.Bound` of the query group
    norms prepared by `split_rows`, scaled likewise, and the layer's radii refs: the bound scores of SPEC 11 instead."""
    rows_first = None if first_q is None else per_row(first_q, q_parts[0].shape[0] // first_q.shape[0])

    def one(f, scores):
        s = dot_rows(q_parts, tile_rows(i, f, k_refs, st), precision, operands)
        if bound is not None:  # + sum over feature groups of |q| * rho: one more product
            s = s + dot_rows(bound.query_norms, tile_rows(i, f, bound.radii, st), precision, operands)
        return s if rows_first is None else jnp.where((rows_first == f)[:, None], s, scores)

    scores = by_document(first_q, one, jnp.zeros((q_parts[0].shape[0], st.tile), jnp.float32))
    return scores, i * st.tile + jnp.arange(st.tile, dtype=jnp.int32)


def _top_keys_kernel(*refs, st: LayerStatic, documents: bool, export: bool = False,
                     with_shift: bool = False, bound_parts: int = 0):
    """Packed importance keys of a block's queries; with `export`, also every valid
    position's importance (SPEC 8: the formula value, the rightmost's included), and
    with `with_shift` the rows' importance shifts `[BQ, Gt]` (`importance_shift`).
    `bound_parts > 0`: the key refs are followed by the query rows' feature-group norms
    and the layer's radii (that many parts), and the importance is the bound's (SPEC 11)."""
    (q_ref, n_ref, first_ref), refs = query_refs(refs, documents)
    outputs = 1 + export + with_shift
    refs, (keys_ref, *out_refs) = refs[:-outputs], refs[-outputs:]
    imp_ref = out_refs[0] if export else None
    shift_ref = out_refs[-1] if with_shift else None
    bound = None
    if bound_parts:
        refs, qn_ref, rho_refs = refs[:-bound_parts - 1], refs[-bound_parts - 1], refs[-bound_parts:]
        bq, gt, _ = qn_ref.shape
        bound = Bound(split_rows(BASE2 * st.alpha * qn_ref[...].reshape(bq * gt, qn_ref.shape[-1]), st.precision,
                                 st.importance_operands), rho_refs)
    k_refs = refs
    bq, gt, _ = q_ref.shape
    rows = bq * gt
    q, n_q, first_q = block_rows(q_ref, n_ref, first_ref)
    n_rows = per_row(n_q, gt)
    q_parts = split_rows(BASE2 * st.alpha * q, st.precision, st.importance_operands)
    num_tiles = (jnp.max(n_q) + st.tile - 1) // st.tile
    real_head = jnp.arange(rows, dtype=jnp.int32) % gt < st.group
    # R, the normaliser set, per row: valid positions, less the rightmost when strict.
    norm_end = n_rows - 1 if st.strict_causal else n_rows
    has_norm = (n_q - 1 if st.strict_causal else n_q) > 0  # [BQ]

    def scored(i):
        return _scores_by_document(i, q_parts, first_q, k_refs, st, st.precision, st.importance_operands, bound)

    def norm_stats(i, carry):
        scores, positions = scored(i)
        in_norm = positions[None, :] < norm_end[:, None]
        return fold_max_sum(*carry, jnp.where(in_norm, scores, NEG_INF), exp=jnp.exp2)

    init = (jnp.full((rows,), NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32))
    m, total = lax.fori_loop(0, num_tiles, norm_stats, init)
    shift = importance_shift(m, total, real_head, gt, st.importance, log=jnp.log2)
    if with_shift:  # in natural units, as the scores of SPEC 2.3
        shift_ref[...] = (shift / BASE2).reshape(bq, gt)

    def write_keys(i, carry):
        scores, positions = scored(i)
        in_norm = positions[None, :] < norm_end[:, None]
        # Rows' weights outside R may overflow; they are never kept (masked below).
        weights = jnp.where(real_head[:, None] & in_norm, jnp.exp2(scores - shift[:, None]), 0.0)
        imp = jnp.sum(weights.reshape(bq, gt, st.tile), axis=1)  # [BQ, tile]
        imp = jnp.where(has_norm[:, None], imp, 0.0)
        valid = positions[None, :] < n_q[:, None]
        if export:  # the rightmost's own value, not the forced one
            rightmost = jnp.where(real_head[:, None] & (positions[None, :] == n_rows[:, None] - 1),
                                  jnp.exp2(scores - shift[:, None]), 0.0)
            exported = imp + jnp.sum(rightmost.reshape(bq, gt, st.tile), axis=1) if st.strict_causal else imp
            imp_ref[:, pl.ds(i * st.tile, st.tile)] = jnp.where(valid & has_norm[:, None], exported, 0.0)
        imp = jnp.where(positions[None, :] == n_q[:, None] - 1, FORCED_IMPORTANCE, imp)
        keys_ref[:, pl.ds(i * st.tile, st.tile)] = jnp.where(valid, pack_importance(imp, positions, st.log_n), -1)
        return carry

    write_key_tiles(keys_ref, num_tiles, write_keys, st)


def _top_merge_kernel(*refs, st: LayerStatic, bottom: bool, documents: bool):
    """Online-softmax merge of the candidates not kept (all valid ones at the bottom)."""
    score_precision, operands = merge_score_precision(st), st.merge_operands
    leading, keys_ref, tau_ref, k_refs, (v_ref, m_ref, s_ref, u_ref, *out_refs) = layer_refs(
        refs, 2 + documents, st, bottom)
    (q_ref, n_ref, first_ref), _ = query_refs(leading, documents)
    bq, gt, _ = q_ref.shape
    rows = bq * gt
    q, n_q, first_q = block_rows(q_ref, n_ref, first_ref)
    n_rows = per_row(n_q, gt)
    rows_first = None if first_q is None else per_row(first_q, gt)
    num_tiles = (jnp.max(n_q) + st.tile - 1) // st.tile
    if not bottom:
        tau = tau_ref[...]  # [BQ, 1]
    q_parts = split_rows(BASE2 * st.alpha * q, score_precision, operands)

    def merge_tile(i, carry):
        positions = i * st.tile + jnp.arange(st.tile, dtype=jnp.int32)
        if bottom:
            merged = positions[None, :] < n_rows[:, None]
        else:
            kept = keys_ref[:, pl.ds(i * st.tile, st.tile)] >= tau  # [BQ, tile]
            merged_q = (positions[None, :] < n_q[:, None]) & ~kept
            merged = jnp.broadcast_to(merged_q[:, None, :], (bq, gt, st.tile)).reshape(rows, st.tile)

        def fold_document(f, state):  # rows of other documents fold nothing (all -inf)
            k = tile_rows(i, f, k_refs, st)
            scores = dot_rows(q_parts, k, score_precision, operands)
            values = v_ref[pl.ds(f + i * st.tile, st.tile), :]
            mine = merged if rows_first is None else merged & (rows_first == f)[:, None]
            return fold(state, [merged_tile(jnp.where(mine, scores, NEG_INF), values, score_precision, operands)],
                        exp=jnp.exp2)

        return by_document(first_q, fold_document, carry)

    m, total, acc = read_state(m_ref, s_ref, u_ref)
    m, total, acc = lax.fori_loop(0, num_tiles, merge_tile, (BASE2 * m, total, acc))
    write_merged((m / BASE2, total, acc), out_refs, bottom)


def top_specs(st: LayerStatic, q, k_parts, v, width: int):
    bq = st.block_queries
    gt, kp = q.shape[3], q.shape[4]
    Np = k_parts[0].shape[2]
    queries = lambda *tail: pl.BlockSpec((None, bq, None) + tail, lambda b, i, h: (b, i, h) + (0,) * len(tail))
    head = lambda d: pl.BlockSpec((None, None, Np, d), lambda b, i, h: (b, h, 0, 0))
    vp = v.shape[-1] if v is not None else None
    return dict(q=queries(gt, kp), n=queries(1), first=queries(1), keys=queries(width), tau=queries(1), k=[head(kp)] * len(k_parts),
                v=head(vp),
                vec=queries(gt), mat=queries(gt, vp))


def check_top_inputs(st: LayerStatic, q, k_parts, width: int, expected_parts: tuple, rotated_dtype=jnp.float32):
    """The shapes the top-layer kernels tile, the keys' parts, and `q` rotated in
    `rotated_dtype` (float32: `rotate_queries`; the backward's `top_backward_queries`
    may cast it to the merge operands')."""
    check_key_parts(k_parts, expected_parts)
    if q.shape[1] % st.block_queries or k_parts[0].shape[2] % st.tile or width % st.tile:
        raise ValueError(f"queries {q.shape[1]} / nodes {k_parts[0].shape[2]} and width {width} must be multiples "
                         f"of block_queries {st.block_queries} / tile {st.tile}")
    if q.dtype != rotated_dtype:
        raise TypeError(f"q must be rotated {jnp.dtype(rotated_dtype).name} (rotate_queries), got {q.dtype}")


@functools.partial(jax.jit, static_argnames=("width", "st", "interpret", "export", "with_shift"))
def top_importance_keys_pallas(q_rot, top: TopInputs, width: int, st: LayerStatic, interpret=False, export=False,
                               with_shift=False, bound=None):
    """Packed importance keys `[B, Q, H_kv, width]` of the top layer (`top.n`,
    `top.first`, `top.k`; its keys, tau and values not read), `st.block_queries`
    queries per program; with `export`, `(keys, importance [B, Q, H_kv, width] float32)`
    (SPEC 8, 0 where invalid); `with_shift` (and `export`) adds the rows' importance
    shifts `[B, Q, H_kv, Gt]` (what split heads need to sum their importance). `q_rot = rotate_queries(q, n, ...)`, `k_rot =
    key_operands(rotate_keys(...), st.precision, st.importance_operands, split)`.
    `bound` (SPEC 11, `selection="bound"`): `common.Bound(qn [B, Q, H_kv, Gt, Gn] float32, rho)`, the
    query rows' feature-group norms and `key_operands` of the layer's radii `[B, H_kv,
    Np, Gn]` (padded like `k_rot`): the importance is then the bound scores'.
    `first=None`: one document per row (candidate `p` is row `p`), one pass per tile."""
    n, first, k_rot = top.n, top.first, top.k
    check_top_inputs(st, q_rot, k_rot, width, (1, key_parts(st.precision, st.importance_operands)))
    B, Q, H_kv = q_rot.shape[:3]
    documents = first is not None
    sp = top_specs(st, q_rot, k_rot, None, width)
    keys_shape = jax.ShapeDtypeStruct((B, Q, H_kv, width), jnp.int32)
    imp_shape = jax.ShapeDtypeStruct((B, Q, H_kv, width), jnp.float32)
    out_specs, out_shape = sp["keys"], keys_shape
    if export:
        out_specs, out_shape = [sp["keys"], sp["keys"]], [keys_shape, imp_shape]
    if with_shift:
        out_specs.append(sp["vec"])
        out_shape.append(jax.ShapeDtypeStruct((B, Q, H_kv, q_rot.shape[3]), jnp.float32))
    extra_specs, extra = [], ()
    if bound is not None:
        qn, rho = bound.query_norms, bound.radii
        bound_specs = top_specs(st, qn, rho, None, width)
        extra_specs, extra = [bound_specs["q"], *bound_specs["k"]], (qn, *rho)
    return pl.pallas_call(
        functools.partial(_top_keys_kernel, st=st, documents=documents, export=export or with_shift,
                          with_shift=with_shift,
                          bound_parts=0 if bound is None else len(bound.radii)),
        grid=(B, Q // st.block_queries, H_kv),
        in_specs=[sp["q"], sp["n"], *([sp["first"]] if documents else []), *sp["k"], *extra_specs],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(st.num_warps, st.num_stages),
        interpret=interpret,
    )(q_rot, n, *([first] if documents else []), *k_rot, *extra)


@functools.partial(jax.jit, static_argnames=("st", "interpret", "out_dtype", "return_lse"))
def top_merge_pallas(q_rot, top: TopInputs, state, st: LayerStatic, interpret=False, out_dtype=jnp.float32,
                     return_lse=False):
    """With `top.keys [B, Q, H_kv, width], tau`: the state after merging the top layer's
    candidates not kept. With `keys=None` (`L = 1`): the normalised output
    `[B, Q, H_kv, Gt, Vp]` in `out_dtype` (and its rows' log-sum-exp with `return_lse`). `v` padded like `k_rot` (`pad_nodes`), `k_rot =
    key_operands(rotate_keys(...), merge precision, st.merge_operands)`; `first=None`: one
    document per row."""
    n, first, keys, tau, k_rot, v = top
    bottom = keys is None
    width = st.tile if bottom else keys.shape[-1]
    check_top_inputs(st, q_rot, k_rot, width, (key_parts(merge_score_precision(st), st.merge_operands),))
    B, Q, H_kv, gt, _ = q_rot.shape
    vp = v.shape[-1]
    sp = top_specs(st, q_rot, k_rot, v, width)
    documents = first is not None
    in_specs = [sp["q"], sp["n"]] + ([sp["first"]] if documents else []) + ([] if bottom else [sp["keys"], sp["tau"]])
    in_specs += [*sp["k"], sp["v"], sp["vec"], sp["vec"], sp["mat"]]
    args = (q_rot, n) + ((first,) if documents else ()) + (() if bottom else (keys, tau)) + tuple(k_rot) + (v,)
    args += tuple(state)
    out_specs, out_shape = merge_outputs(sp, (B, Q, H_kv, gt, vp), bottom, out_dtype, return_lse)
    out = pl.pallas_call(
        functools.partial(_top_merge_kernel, st=st, bottom=bottom, documents=documents),
        grid=(B, Q // st.block_queries, H_kv),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(st.num_warps, st.num_stages),
        interpret=interpret,
    )(*args)
    return out if bottom else tuple(out)


__all__ = ["top_importance_keys_pallas", "top_merge_pallas"]
