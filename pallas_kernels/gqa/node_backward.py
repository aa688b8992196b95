"""Key and value gradients by node (SPEC 5), deterministic: the transpose of the
per-query kernels of `layer_backward.py`, which give `dq`.

Each program owns a block of nodes and visits, in a fixed order, every query that merged
one of them, summing in registers; it then adds the block's sum to the accumulator,
which no other program of the launch touches. Chunks of queries follow each other in
order. So `dk`, `dv` are bitwise the same run to run, and no atomic is issued (adding
them with float32 atomics from the per-query programs instead ran several times slower:
journal, 2026-11-22 (session 5)).

- Layers below the top (`layer_node_grads_pallas`): a program per `UNIT = 16`
  consecutive nodes (a dot's least width). Which queries merged them comes from an
  inverse index of the chunk's parent lists (`node_index`: a stable sort of the
  `(query, slot)` pairs by the unit their parent's children lie in, with each pair's
  rotation and candidate positions precomputed, so the kernel's loads depend on no
  other load but the index's). A pair `(t, s)` with parent `P` puts child `c` of `P` at
  candidate position `s*r + c`; the unit's keys are read once, rotated by `c` (copy 0
  of `rotate_phases`), and each pair's query is rotated by `n_t - 1 - s*r` (RoPE is
  relative), so `dk` comes out in the frame of copy 0, rotated back once at the end
  (`node_gradient`).
  A unit's entries are walked by one program up to `BlockSizes.node_entries` (512,
  `UNIT_ENTRIES`); the rest of a longer list (a node that every query of the chunk
  merged: the bound rule of SPEC 11 picks the same nodes for most queries) spills into
  segments of as many, each summed by a program of its own into a partial; a third
  launch adds a unit's partials, in order, after its own sum. Without the split one
  program walked up to a whole chunk's queries while the others idled, and the bound's
  backward ran well behind the mean's; cut after 512 entries it runs about as the mean's
  (journal, 2026-11-25 (2)). Adding the partials inside the unit kernel instead slowed
  it where nothing spilled.
The top layer's `dk`, `dv` (flash attention's loop over query blocks) are in
`top_backward.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.gqa.layer_backward import grads_of_block
from pallas_kernels.shared.common import LayerInputs, LayerStatic, RowStats, compiler_params, merge_score_precision
from pallas_kernels.shared.node_index import UNIT, NodeIndex, fold_spilled, whole_slice
from pallas_kernels.shared.precision import check_key_parts, dot_rows, key_parts, product, split_rows


def _per_row(x, gt: int):
    """`[E, ...]` per entry -> `[E * gt, ...]`, repeated for each of its query's rows."""
    return jnp.broadcast_to(x[:, None], (x.shape[0], gt) + x.shape[1:]).reshape((x.shape[0] * gt,) + x.shape[1:])


def _unit_sums(u, begin, end, data, st: LayerStatic, bottom: bool, entries_per_step: int, gt: int):
    """`(dk_lo, dk_hi, dv)` float32 `[UNIT, *]` of unit `u`'s nodes over the index's
    entries `[begin, end)`, in steps of `entries_per_step` pairs (`entries_per_step * gt`
    rows). Per-query arrays are flattened per `(b, h)`: row `t*gt + g` of `q, lse, delta,
    do`, `t*Mp + p` of `keys`."""
    precision, operands = merge_score_precision(st), st.merge_operands
    query_ref, angle_ref, offset_ref, span_ref, q_ref, *refs = data
    keys_ref = tau_ref = None
    if not bottom:
        keys_ref, tau_ref, *refs = refs
    parts = key_parts(precision, operands)
    k_refs, (v_ref, cos_ref, sin_ref, lse_ref, delta_ref, do_ref) = refs[:parts], refs[parts:]
    E = entries_per_step
    half, vp = q_ref.shape[-1] // 2, do_ref.shape[-1]
    Mp, N = cos_ref.shape[0], v_ref.shape[0]
    rows = E * gt
    nodes = u * UNIT + jnp.arange(UNIT, dtype=jnp.int32)
    at = jnp.minimum(nodes, N - 1)
    k_lo = tuple(k_ref[at, pl.ds(0, half)] for k_ref in k_refs)  # copy 0: node j rotated by j mod r
    k_hi = tuple(k_ref[at, pl.ds(half, half)] for k_ref in k_refs)
    values = v_ref[at, :]
    node = jnp.arange(UNIT, dtype=jnp.int32)[None, :]
    head = jnp.arange(gt, dtype=jnp.int32)
    real = head[None, :] < st.group  # [1, gt]: rows past G are padding

    def step(i, carry):
        dk_lo, dk_hi, dv = carry
        e = jnp.minimum(begin + i * E + jnp.arange(E, dtype=jnp.int32), end - 1)
        ok = (begin + i * E + jnp.arange(E, dtype=jnp.int32) < end)[:, None]
        t, angle, offset, span = query_ref[e], angle_ref[e], offset_ref[e], span_ref[e]
        row = (t[:, None] * gt + head[None, :]).reshape(rows)
        # The pair's query rotated by n_t - 1 - slot*r; with the key rotated by its
        # child c that puts them s*r + c apart, the candidate position.
        c, s = _per_row(cos_ref[angle, :], gt), _per_row(sin_ref[angle, :], gt)
        q_lo = q_ref[row, pl.ds(0, half)].astype(jnp.float32)
        q_hi = q_ref[row, pl.ds(half, half)].astype(jnp.float32)
        qr_lo, qr_hi = q_lo * c - q_hi * s, q_hi * c + q_lo * s
        scores = st.alpha * (dot_rows(split_rows(qr_lo, precision, operands), k_lo, precision, operands)
                             + dot_rows(split_rows(qr_hi, precision, operands), k_hi, precision, operands))
        merged = ok & (node >= (span % 32)[:, None]) & (node < (span // 32)[:, None])  # [E, UNIT]
        if not bottom:
            position = jnp.clip(offset[:, None] + node, 0, Mp - 1)
            merged = merged & (keys_ref[t[:, None] * Mp + position] < tau_ref[t][:, None])
        merged = (merged[:, None, :] & real[:, :, None]).reshape(rows, UNIT)
        do = do_ref[row, :]
        p, ds = grads_of_block(scores, values, do, lse_ref[row], delta_ref[row], merged, st)
        return (dk_lo + product(ds, qr_lo, (0, 0), precision, operands),
                dk_hi + product(ds, qr_hi, (0, 0), precision, operands),
                dv + product(p, do, (0, 0), precision, operands))

    zeros = lambda d: jnp.zeros((UNIT, d), jnp.float32)
    return lax.fori_loop(0, (end - begin + E - 1) // E, step, (zeros(half), zeros(half), zeros(vp)))


def _spill_kernel(segment_ref, *refs, st: LayerStatic, bottom: bool, entries_per_step: int, gt: int):
    """One spilled segment of a unit's entries (`segment_ref`: unit, begin, end): its
    sums into a partial of its own."""
    data, (pk_out, pv_out) = refs[:-2], refs[-2:]
    dk_lo, dk_hi, dv = _unit_sums(segment_ref[0], segment_ref[1], segment_ref[2], data, st, bottom,
                                  entries_per_step, gt)
    half = dk_lo.shape[-1]
    pk_out[:, pl.ds(0, half)] = dk_lo
    pk_out[:, pl.ds(half, half)] = dk_hi
    pv_out[...] = dv


def _layer_node_kernel(bounds_ref, *refs, st: LayerStatic, bottom: bool, entries_per_step: int, gt: int):
    """One unit of `UNIT` nodes, its first entries, added to the accumulators."""
    data, (dk_in, dv_in, dk_out, dv_out) = refs[:-4], refs[-4:]
    dk_lo, dk_hi, dv = _unit_sums(pl.program_id(2), bounds_ref[0], bounds_ref[1], data, st, bottom,
                                  entries_per_step, gt)
    half = dk_lo.shape[-1]
    dk_out[:, pl.ds(0, half)] = dk_in[:, pl.ds(0, half)] + dk_lo
    dk_out[:, pl.ds(half, half)] = dk_in[:, pl.ds(half, half)] + dk_hi
    dv_out[...] = dv_in[...] + dv


def _per_head(x):
    """`[B, Q, H_kv, ...]` -> `[B, H_kv, Q * ...]`: one flat run per `(b, h)`."""
    x = jnp.moveaxis(x, 2, 1)
    return x.reshape(x.shape[:2] + (-1,))


def _per_head_rows(x):
    """`[B, Q, H_kv, Gt, D]` -> `[B, H_kv, Q * Gt, D]`."""
    x = jnp.moveaxis(x, 2, 1)
    return x.reshape(x.shape[:2] + (-1, x.shape[-1]))


def _unit_rows(x):
    """BlockSpec: program `u`'s `UNIT` rows of `[B, H_kv, R, D]`."""
    return pl.BlockSpec((None, None, UNIT, x.shape[-1]), lambda b, h, u: (b, h, u, 0))


@functools.partial(jax.jit, static_argnames=("st", "interpret", "entries_per_step", "num_warps"))
def layer_node_grads_pallas(q, layer: LayerInputs, stats: RowStats, index: NodeIndex, accumulators, st: LayerStatic,
                            interpret=False, entries_per_step=None, num_warps=None):
    """`dk`, `dv` of one layer below the top (the bottom with `layer.keys=None`) added
    to `accumulators` (`node_buffers`), deterministically.

    `q [B, Q, H_kv, Gt, Kp]` un-rotated, halves padded apart; `layer` as for
    `layer_backward_pallas`; `stats` the rows' `lse, do, delta` (`Gt` rows, `do`
    float32); `index = node_index(parents, n, r, units, node_entries)` (`layer.parents`,
    `layer.n` are read through it; with spilled segments, three launches: their
    partials, the units' own sums, the fold). `entries_per_step`: pairs per step
    (default: 64 rows)."""
    _, _, keys, tau, k_phases, layer_v, cos, sin = layer  # parents, n: read through the index
    lse, do, delta = stats
    check_key_parts(k_phases, (key_parts(merge_score_precision(st), st.merge_operands),))
    B, Q, H_kv, gt, kp = q.shape
    bottom = keys is None
    dk_acc, dv_acc = accumulators
    num_units = index.bounds.shape[2]
    if dk_acc.shape[2] != num_units * UNIT:
        raise ValueError(f"accumulators hold {dk_acc.shape[2]} rows, the index {num_units} units of {UNIT}")
    # 64 rows per step: 128 spill registers (journal, 2026-11-22 (session 5)). Warps:
    # `BlockSizes.node_num_warps`, passed by the backward.
    E = entries_per_step or max(1, 64 // gt)
    if st.merge_operands is not None:
        do = do.astype(st.merge_operands)  # the products read it so: half the bytes gathered
    data = [index.query, index.angle, index.offset, index.span, _per_head_rows(q)]
    if not bottom:
        data += [_per_head(keys), _per_head(tau)]
    data += list(k_phases) + [layer_v]
    table = pl.BlockSpec(cos.shape, lambda b, h, u: (0, 0))
    rows = [_per_head(lse), _per_head(delta), _per_head_rows(do)]
    data_specs = [whole_slice(x) for x in data] + [table, table] + [whole_slice(x) for x in rows]
    data += [cos, sin, *rows]
    kernel = dict(st=st, bottom=bottom, entries_per_step=E, gt=gt)
    params = compiler_params(num_warps or st.merge_num_warps or st.num_warps, st.num_stages)
    pair = lambda x: pl.BlockSpec((None, None, None, x.shape[-1]), lambda b, h, u: (b, h, u, 0))
    num_segments = index.segments.shape[2]
    partials = []
    if num_segments:  # the spilled segments' partials, folded in after the units' own sums
        shape = lambda d: jax.ShapeDtypeStruct((B, H_kv, num_segments * UNIT, d), jnp.float32)
        partials = pl.pallas_call(
            functools.partial(_spill_kernel, **kernel),
            grid=(B, H_kv, num_segments),
            in_specs=[pair(index.segments)] + data_specs,
            out_specs=[_unit_rows(shape(dk_acc.shape[-1])), _unit_rows(shape(dv_acc.shape[-1]))],
            out_shape=[shape(dk_acc.shape[-1]), shape(dv_acc.shape[-1])],
            compiler_params=params,
            interpret=interpret,
        )(index.segments, *data)
    args = [index.bounds, *data, dk_acc, dv_acc]
    out_shape = [jax.ShapeDtypeStruct(dk_acc.shape, jnp.float32), jax.ShapeDtypeStruct(dv_acc.shape, jnp.float32)]
    dk_acc, dv_acc = pl.pallas_call(
        functools.partial(_layer_node_kernel, **kernel),
        # Units innermost: programs that run together read the same head's queries.
        grid=(B, H_kv, num_units),
        in_specs=[pair(index.bounds), *data_specs, _unit_rows(dk_acc), _unit_rows(dv_acc)],
        out_specs=[_unit_rows(dk_acc), _unit_rows(dv_acc)],
        out_shape=out_shape,
        input_output_aliases={len(args) - 2: 0, len(args) - 1: 1},
        compiler_params=params,
        interpret=interpret,
    )(*args)
    if num_segments:
        dk_acc, dv_acc = fold_spilled(index.segments, tuple(partials), (dk_acc, dv_acc), interpret)
    return dk_acc, dv_acc


__all__ = ["layer_node_grads_pallas"]
