"""The top layer's backward (SPEC 5, selection constant): flash attention's two backward
loops on the forward's top-layer layouts (`top_layer.py`).

With the forward's per-row log-sum-exp `lse` and `delta = rowsum(do * o)`, a merged
node `j` of row `i` has `p = exp(s - lse)` and `ds = p * (do . v_j - delta)`; `dq_i +=
alpha * ds * k_j`, `dk_j += alpha * ds * q_i`, `dv_j += p * do_i`. Both kernels score in
base 2 as the forward does: the queries are handed over scaled by `alpha * log2(e)`
and cast to the merge dots' operand dtype once (`top_backward_queries`), `p =
exp2(s2 - log2(e) * lse)`, and the constant is taken out of the sums at the end.

- `top_dq_pallas`: a program per block of queries (`BQ * Gt` rows) walks the node
  tiles, summing `dq` in registers (flash attention's dq loop).
- `top_node_grads_pallas`: a program per tile of nodes walks the chunk's queries in
  blocks, summing `dk`, `dv` in registers (the dk/dv loop), skipping the leading
  blocks whose queries all see fewer nodes than the tile's first (`block_ranges`).
  Only the tiles a chunk's queries reach have work (at T=131072, top_k=512, 70 of 128
  per kv head in the middle chunk: 280 programs for 132 SMs), so each tile's blocks
  are split among `segments` programs (`top_backward_statics`), whose partial sums
  are added in order afterwards: deterministic, no atomics.
  Scoring transposed (`k q^T`, so `p^T`, `ds^T` come out as the left operands of the
  dk and dv products, as Triton's flash attention backward does) ran slower here
  (journal, 2026-11-26 (2)).
`first=None`: one document per row (no per-document loop, which keeps Triton from
pipelining the tiles' loads); packed rows pass `first` (`chunks.chunk_queries` gives None unpacked).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.gqa.layer_backward import grads_of_block
from pallas_kernels.gqa.top_layer import BASE2, block_rows, by_document, check_top_inputs, per_row, query_refs, tile_rows, \
    top_specs
from pallas_kernels.shared.common import (LayerStatic, RowStats, TopInputs, compiler_params, layer_refs,
                                         merge_score_precision, next_power_of_two)
from pallas_kernels.shared.configs import TopBackwardConfig
from pallas_kernels.shared.precision import check_key_parts, dot_rows, key_parts, product, split_rows, whole_keys


# The node kernel's partial sums are added in one elementwise fusion of this many at most.
MAX_SEGMENTS = 32


def top_backward_statics(st_top: LayerStatic, tuning: TopBackwardConfig, itemsize: int, kp: int, vp: int, nodes: int,
                         width: int,
                         node_tiles_per_chunk: int, chunk: int):
    """`(st_dq, st_dkv, segments)`: the launches of the two kernels from `tuning`
    (`dq_*`, `dkv_*`): `block_queries` at most the forward's (so they divide
    the chunk), tiles powers of two that divide the top layer's padded `nodes` and the
    keys' `width`; the node kernel's query segments per tile, so that `B * H_kv *
    tiles * segments` (`node_tiles_per_chunk = B * H_kv`) is about
    `tuning.dkv_programs`, at most `MAX_SEGMENTS` and the chunk's blocks of
    queries (`chunk` queries). Float32 inputs hold twice the bytes per row: half
    the rows at `Kp = 128` (128 rows of 128 features asked 262144 B of 232448 on an
    H100) and one stage; wider heads one stage."""
    gt = next_power_of_two(st_top.group)
    divides = min(nodes & -nodes, width & -width)

    def launch(rows, tile, warps, stages):
        if itemsize > 2:
            rows, stages = rows * min(64, kp) // kp, 1
        if kp > 128 or vp > 128:
            stages = 1
        bq = max(1, min(st_top.block_queries, next_power_of_two(rows) // gt))
        return dataclasses.replace(st_top, block_queries=bq, tile=min(next_power_of_two(tile, 16), divides),
                                   num_warps=warps, num_stages=stages)

    b = tuning
    st_dq = launch(b.dq_rows, b.dq_tile, b.dq_warps, b.dq_stages)
    st_dkv = launch(b.dkv_rows, b.dkv_tile, b.dkv_warps, b.dkv_stages)
    segments = b.dkv_programs // (node_tiles_per_chunk * (nodes // st_dkv.tile))
    return st_dq, st_dkv, max(1, min(segments, MAX_SEGMENTS, chunk // st_dkv.block_queries))


def top_backward_queries(q_rot, st: LayerStatic):
    """The rotated queries `[B, Q, H_kv, Gt, Kp]` as both kernels read them: scaled by
    `alpha * log2(e)` (scores in base 2) and cast to the merge dots' operand dtype (the
    products round them so anyway: half the bytes each node kernel step loads)."""
    scaled = (BASE2 * st.alpha) * q_rot.astype(jnp.float32)
    return scaled if st.merge_operands is None else scaled.astype(st.merge_operands)


def _top_dq_kernel(*refs, st: LayerStatic, bottom: bool, documents: bool):
    """A block of `BQ` queries (rows `b*Gt + g`) against the node tiles: `dq` in the
    rotated frame."""
    precision, operands = merge_score_precision(st), st.merge_operands
    leading, keys_ref, tau_ref, k_refs, (v_ref, lse_ref, delta_ref, do_ref, dq_ref) = layer_refs(
        refs, 2 + documents, st, bottom)
    (q_ref, n_ref, first_ref), _ = query_refs(leading, documents)
    bq, gt, _ = q_ref.shape
    rows, vp, tile = bq * gt, do_ref.shape[-1], st.tile
    q, n_q, first_q = block_rows(q_ref, n_ref, first_ref)
    n_rows = per_row(n_q, gt)
    rows_first = None if first_q is None else per_row(first_q, gt)
    real = jnp.arange(rows, dtype=jnp.int32) % gt < st.group
    lse = jnp.where(real, BASE2 * lse_ref[...].reshape(rows), 0.0)
    delta = delta_ref[...].reshape(rows)
    do = do_ref[...].reshape(rows, vp)
    q_parts = split_rows(q, precision, operands)
    if not bottom:
        tau = tau_ref[...]  # [BQ, 1]

    def body(i, dq):
        positions = i * tile + jnp.arange(tile, dtype=jnp.int32)
        if bottom:
            merged = positions[None, :] < n_rows[:, None]
        else:
            kept = keys_ref[:, pl.ds(i * tile, tile)] >= tau
            merged_q = (positions[None, :] < n_q[:, None]) & ~kept
            merged = jnp.broadcast_to(merged_q[:, None, :], (bq, gt, tile)).reshape(rows, tile)
        merged = merged & real[:, None]

        def document(f, dq):  # rows of other documents get ds = 0
            k_parts = tile_rows(i, f, k_refs, st)
            values = v_ref[pl.ds(f + i * tile, tile), :]
            mine = merged if rows_first is None else merged & (rows_first == f)[:, None]
            _, ds = grads_of_block(dot_rows(q_parts, k_parts, precision, operands), values, do, lse, delta, mine, st,
                                   exp=jnp.exp2, alpha=False)
            return dq + product(ds, whole_keys(k_parts), (1, 0), precision, operands)

        return by_document(first_q, document, dq)

    dq = lax.fori_loop(0, (jnp.max(n_q) + tile - 1) // tile, body, jnp.zeros((rows, q.shape[-1]), jnp.float32))
    dq_ref[...] = (st.alpha * dq).reshape(dq_ref.shape)


@functools.partial(jax.jit, static_argnames=("st", "interpret"))
def top_dq_pallas(q_ops, top: TopInputs, stats: RowStats, st: LayerStatic, interpret=False):
    """`dq_rot [B, Q, H_kv, Gt, Kp]` float32 from the top layer's merged candidates (all
    valid ones with `top.keys=None`, `L = 1`), in the rotated queries' frame (the caller
    rotates it back). `q_ops = top_backward_queries(q_rot, st)`; `top` as for
    `top_merge_pallas` (`first=None`: one document per row); `stats` the rows' `lse, do,
    delta` (`Gt` rows)."""
    n, first, keys, tau, k_rot, v = top
    lse, do, delta = stats
    bottom = keys is None
    width = st.tile if bottom else keys.shape[-1]
    check_top_inputs(st, q_ops, k_rot, width, (key_parts(merge_score_precision(st), st.merge_operands),),
                     rotated_dtype=st.merge_operands or jnp.float32)
    documents = first is not None
    sp = top_specs(st, q_ops, k_rot, v, width)
    in_specs = [sp["q"], sp["n"]] + ([sp["first"]] if documents else []) + ([] if bottom else [sp["keys"], sp["tau"]])
    in_specs += [*sp["k"], sp["v"], sp["vec"], sp["vec"], sp["mat"]]
    args = (q_ops, n) + ((first,) if documents else ()) + (() if bottom else (keys, tau)) + tuple(k_rot)
    args += (v, lse, delta, do)
    return pl.pallas_call(
        functools.partial(_top_dq_kernel, st=st, bottom=bottom, documents=documents),
        grid=(q_ops.shape[0], q_ops.shape[1] // st.block_queries, q_ops.shape[2]),
        in_specs=in_specs,
        out_specs=sp["q"],
        out_shape=jax.ShapeDtypeStruct(q_ops.shape, jnp.float32),
        compiler_params=compiler_params(st.num_warps, st.num_stages),
        interpret=interpret,
    )(*args)


def _top_node_kernel(*refs, st: LayerStatic, bottom: bool, documents: bool, segments: int):
    """One tile of the top layer's nodes against the chunk's queries, `BQ` per step,
    over the blocks `[blocks[0], blocks[1])` (the others see none of the tile), or with
    `segments > 1` this program's share of them (its sums then written to a partial of
    its own). Node rows are absolute: a row's candidates are rows `[first, first + n)`
    (`[0, n)` without `first`), and `keys` (kept or not) are indexed by row."""
    precision, operands = merge_score_precision(st), st.merge_operands
    blocks_ref, q_ref, n_ref, *refs = refs
    first_ref = refs.pop(0) if documents else None
    keys_ref = tau_ref = None
    if not bottom:
        keys_ref, tau_ref, *refs = refs
    parts = key_parts(precision, operands)
    k_refs, (v_ref, lse_ref, delta_ref, do_ref, *out_refs) = refs[:parts], refs[parts:]
    _, gt, kp = q_ref.shape
    bq, tile, vp = st.block_queries, st.tile, do_ref.shape[-1]
    rows = bq * gt
    start = pl.program_id(1) * tile
    positions = start + jnp.arange(tile, dtype=jnp.int32)
    k_parts = tuple(k_ref[pl.ds(start, tile), :] for k_ref in k_refs)
    values = v_ref[pl.ds(start, tile), :]
    real = jnp.arange(rows, dtype=jnp.int32) % gt < st.group  # [rows]

    def merged_of(block):  # [BQ, tile]
        n_q = n_ref[block, :]
        if documents:
            first_q = first_ref[block, :]
            merged = (positions[None, :] >= first_q) & (positions[None, :] < first_q + n_q)
        else:
            merged = positions[None, :] < n_q
        if not bottom:
            merged = merged & (keys_ref[block, pl.ds(start, tile)] < tau_ref[block, :])
        return merged

    def step(i, carry):
        dk, dv = carry
        block = pl.ds(i * bq, bq)
        q = q_ref[block, :, :].reshape(rows, kp)
        do = do_ref[block, :, :].reshape(rows, vp)
        lse = jnp.where(real, BASE2 * lse_ref[block, :].reshape(rows), 0.0)
        delta = delta_ref[block, :].reshape(rows)
        merged = jnp.broadcast_to(merged_of(block)[:, None, :], (bq, gt, tile)).reshape(rows, tile) & real[:, None]
        scores = dot_rows(split_rows(q, precision, operands), k_parts, precision, operands)  # base 2
        p, ds = grads_of_block(scores, values, do, lse, delta, merged, st, exp=jnp.exp2, alpha=False)
        return dk + product(ds, q, (0, 0), precision, operands), dv + product(p, do, (0, 0), precision, operands)

    lead, end = blocks_ref[0], blocks_ref[1]
    if segments > 1:
        share = (end - lead + segments - 1) // segments
        lead = lead + pl.program_id(3) * share
        end = jnp.minimum(end, lead + share)
    init = (jnp.zeros((tile, kp), jnp.float32), jnp.zeros((tile, vp), jnp.float32))
    dk, dv = lax.fori_loop(lead, end, step, init)
    dk = dk * (1.0 / BASE2)  # the queries were scaled by alpha * log2(e)
    if segments > 1:
        dk_out, dv_out = out_refs
        dk_out[...], dv_out[...] = dk, dv
    else:
        dk_in, dv_in, dk_out, dv_out = out_refs
        dk_out[...] = dk_in[...] + dk
        dv_out[...] = dv_in[...] + dv


def block_ranges(n, first, block_queries: int, tile: int, num_tiles: int):
    """`[B, H_kv, num_tiles, 2]`: per node tile, the blocks of queries that may see it,
    `[lead, end)`: the leading blocks (every query of them and of the blocks before
    ends at or before the tile's start) and the trailing ones (every query of them and
    after starts at or after the tile's end: later documents of a packed row; `first`
    never decreases along the queries) see none of it. `n, first [B, Q, H_kv, 1]`
    (`first=None`: 0)."""
    B, Q, H_kv, _ = n.shape
    first = jnp.zeros_like(n) if first is None else first
    per_block = lambda x: jnp.moveaxis(x[..., 0], 2, 1).reshape(B, H_kv, Q // block_queries, block_queries)
    reach = lax.cummax(jnp.max(per_block(first + n), axis=-1), axis=2)  # [B, H_kv, blocks]
    begin = lax.cummin(jnp.min(per_block(first), axis=-1), axis=2, reverse=True)
    starts = jnp.arange(num_tiles, dtype=jnp.int32) * tile
    lead = jnp.sum(reach[:, :, None, :] <= starts[:, None], axis=-1, dtype=jnp.int32)
    end = Q // block_queries - jnp.sum(begin[:, :, None, :] >= starts[:, None] + tile, axis=-1, dtype=jnp.int32)
    return jnp.stack([lead, jnp.maximum(lead, end)], axis=-1)


@functools.partial(jax.jit, static_argnames=("st", "interpret", "segments"))
def top_node_grads_pallas(q_ops, top: TopInputs, stats: RowStats, accumulators, st: LayerStatic, interpret=False,
                          segments: int = 1):
    """`dk`, `dv` of the top layer (all valid candidates with `top.keys=None`) added to
    `accumulators` (float32, shaped like `top.k [B, H_kv, Np, Kp]` and `top.v`),
    deterministically; inputs as for `top_dq_pallas`, `top.keys [B, Q, H_kv, Np]` indexed
    by node row. `dk` in the rotated keys' frame (`rotate_keys`). `segments > 1`: each
    node tile's queries split among that many programs (more programs to spread over
    the GPU: in a chunk only the tiles its queries reach have work), their partial sums
    added in order afterwards."""
    n, first, keys, tau, k_rot, v = top
    lse, do, delta = stats
    check_key_parts(k_rot, (key_parts(merge_score_precision(st), st.merge_operands),))
    B, Q, H_kv, gt, kp = q_ops.shape
    tile, bq = st.tile, st.block_queries
    Np = k_rot[0].shape[2]
    if Q % bq or Np % tile:
        raise ValueError(f"queries {Q} / nodes {Np} must be multiples of block_queries {bq} / tile {tile}")
    bottom, documents = keys is None, first is not None
    dk_acc, dv_acc = accumulators
    chunk = lambda *tail: pl.BlockSpec((None, Q, None) + tail, lambda b, j, h, s: (b, 0, h) + (0,) * len(tail))
    whole_nodes = lambda x: pl.BlockSpec((None, None, Np, x.shape[-1]), lambda b, j, h, s: (b, h, 0, 0))
    blocks = block_ranges(n, first, bq, tile, Np // tile)
    args = [blocks, q_ops, n] + ([first] if documents else []) + ([] if bottom else [keys, tau]) + list(k_rot)
    args += [v, lse, delta, do]
    in_specs = [pl.BlockSpec((None, None, None, 2), lambda b, j, h, s: (b, h, j, 0)), chunk(gt, kp), chunk(1)]
    in_specs += [chunk(1)] if documents else []
    in_specs += [] if bottom else [chunk(keys.shape[-1]), chunk(1)]
    in_specs += [whole_nodes(x) for x in k_rot] + [whole_nodes(v), chunk(gt), chunk(gt), chunk(gt, do.shape[-1])]
    kernel = functools.partial(_top_node_kernel, st=st, bottom=bottom, documents=documents, segments=segments)
    call = functools.partial(pl.pallas_call, kernel, grid=(B, Np // tile, H_kv, segments),
                             compiler_params=compiler_params(st.num_warps, st.num_stages), interpret=interpret)
    if segments == 1:
        nodes = lambda x: pl.BlockSpec((None, None, tile, x.shape[-1]), lambda b, j, h, s: (b, h, j, 0))
        return tuple(call(
            in_specs=in_specs + [nodes(dk_acc), nodes(dv_acc)],
            out_specs=[nodes(dk_acc), nodes(dv_acc)],
            out_shape=[jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (dk_acc, dv_acc)],
            input_output_aliases={len(args): 0, len(args) + 1: 1},
        )(*args, dk_acc, dv_acc))
    shape = lambda x: jax.ShapeDtypeStruct((B, H_kv, segments, Np, x.shape[-1]), jnp.float32)
    part = lambda x: pl.BlockSpec((None, None, None, tile, x.shape[-1]), lambda b, j, h, s: (b, h, s, j, 0))
    partials = call(in_specs=in_specs, out_specs=[part(dk_acc), part(dv_acc)],
                    out_shape=[shape(dk_acc), shape(dv_acc)])(*args)
    # In segment order, element by element: the same sums run to run.
    return tuple(functools.reduce(lambda total, s: total + x[:, :, s], range(segments), acc)
                 for acc, x in zip(accumulators, partials))


__all__ = ["block_ranges", "top_backward_queries", "top_backward_statics", "top_dq_pallas", "top_node_grads_pallas"]
