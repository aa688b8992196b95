"""Which queries merged each node (SPEC 5): the inverse index that both backward families
sum key and value gradients over (`gqa.node_backward`, `wide.backward`), the units of
`UNIT = 16` nodes their programs own, the zeroed accumulators, the frame `dk` comes out
in, and the fold of a long unit's spilled partials. `gqa/node_backward.py` says why
gradients are summed by node (no atomics, bitwise deterministic) and how a unit's
entries spill.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from htree_jax.core.rope import apply_rope
from pallas_kernels.shared.common import compiler_params, zeros_after
from pallas_kernels.shared.configs import UNIT_ENTRIES
from pallas_kernels.shared.importance import feature_pieces

UNIT = 16  # nodes per program below the top layer


def units_per_pair(r: int) -> int:
    """Units covered by one parent's children: `r / 16`, or 1 when `r <= 16` (then
    `16 / r` parents share a unit)."""
    return max(1, r // UNIT)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["query", "angle", "offset", "span", "bounds", "segments"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class NodeIndex:
    """Which `(query, slot)` pairs merged a child in each unit of `UNIT` nodes, one
    chunk's worth, with what the node kernel needs of each pair precomputed (so that
    its loads depend on no other load but these). Per `(b, h)`, entries `[E]` sorted by
    unit, then by query and slot; unit `u`'s first (at most `S` = entries per program)
    are `bounds[u, 0] : bounds[u, 1]`, the rest spill into consecutive segments,
    segment `x` holding entries `segments[x, 1] : segments[x, 2]` of unit
    `segments[x, 0]`, `segments[x, 3]` the unit's number of segments where `x` is its
    first, else 0 (`[X, 4]`, `X = E // S`, unused ones empty; `spill_segments`)."""

    query: jax.Array  # [B, H_kv, E] int32: the pair's query t (row in the chunk)
    angle: jax.Array  # [B, H_kv, E]: n_t - 1 - slot*r, the query's rotation
    offset: jax.Array  # [B, H_kv, E]: candidate position of the unit's first node
    span: jax.Array  # [B, H_kv, E]: lo + 32 * hi, the unit's nodes [lo, hi) this pair merges
    bounds: jax.Array  # [B, H_kv, units, 2]
    segments: jax.Array  # [B, H_kv, X, 4]


def spill_segments(begin, end, size: int, num_segments: int):
    """A unit's entries `[begin, end)` (`[B, H_kv, units]` each) past its first `size`
    in segments of `size`: `(bounds [.., units, 2]` the first `size`, `spill [.., units,
    2]` the unit's range of segments, `segments [.., num_segments, 4]`: (unit, begin,
    end, the unit's number of segments where this is its first, else 0) each, the unused
    ones empty)."""
    count = end - begin
    spills = jnp.maximum(count - 1, 0) // size  # ceil(count / size) - 1
    spill_end = jnp.cumsum(spills, axis=-1, dtype=jnp.int32)
    spill = jnp.stack([spill_end - spills, spill_end], axis=-1)
    x = jnp.arange(num_segments, dtype=jnp.int32)
    owner = jax.vmap(jax.vmap(lambda ends: jnp.searchsorted(ends, x, side="right")))(spill_end).astype(jnp.int32)
    used = owner < count.shape[-1]
    owner = jnp.where(used, owner, 0)
    at = lambda a: jnp.take_along_axis(a, owner, axis=-1)
    first_slot = at(spill[..., 0])  # the owner's first segment
    seg_begin = at(begin) + size * (x - first_slot + 1)
    seg_end = jnp.where(used, jnp.minimum(at(end), seg_begin + size), seg_begin)
    first = used & (x == first_slot)
    segments = jnp.stack([owner, seg_begin, seg_end, jnp.where(first, at(spills), 0)], axis=-1)
    return jnp.stack([begin, begin + jnp.minimum(count, size)], axis=-1), spill, segments


def node_index(parents, n, r: int, num_units: int, entries_per_program: int = UNIT_ENTRIES) -> NodeIndex:
    """The inverse index of one chunk's parent lists `parents [B, Q, H_kv, P]` (int32,
    ascending, `-1` padded; `n [B, Q, H_kv, 1]` valid candidates): a stable sort of the
    `(query, slot, j)` triples by the unit the `j`-th `UNIT` of the slot's children lie
    in (`j < units_per_pair(r)`); each unit's list cut after `entries_per_program`
    entries into segments of as many (`spill_segments`; 0: never cut)."""
    B, Q, H_kv, P = parents.shape
    U = units_per_pair(r)
    slot = jnp.arange(P, dtype=jnp.int32)
    used = (parents >= 0) & (slot * r < n)
    unit = ((jnp.maximum(parents, 0) * r) // UNIT)[..., None] + jnp.arange(U, dtype=jnp.int32)
    unit = jnp.where(used[..., None], unit, num_units)  # unused pairs sort past the end
    per_head = lambda x: jnp.moveaxis(x, 2, 1).reshape(B, H_kv, -1)
    unit = per_head(unit)
    ids = jnp.broadcast_to(jnp.arange(Q * P * U, dtype=jnp.int32), unit.shape)
    unit, entries = lax.sort((unit, ids), dimension=-1, num_keys=1, is_stable=True)
    edges = jnp.arange(num_units + 1, dtype=jnp.int32)
    starts = jax.vmap(jax.vmap(lambda x: jnp.searchsorted(x, edges, side="left")))(unit).astype(jnp.int32)
    size = entries_per_program or Q * P * U + 1  # 0: one segment holds any unit's list
    bounds, _, segments = spill_segments(starts[..., :-1], starts[..., 1:], size, Q * P * U // size)

    pair = entries // U
    t, s = pair // P, pair % P
    parent = jnp.take_along_axis(per_head(parents), pair, axis=-1)
    n_t = jnp.take_along_axis(per_head(n), t, axis=-1)
    first_node = unit * UNIT  # node i of the unit is first_node + i
    offset = s * r - parent * r + first_node  # child c = node - parent*r sits at s*r + c
    lo = jnp.clip(parent * r - first_node, 0, UNIT)
    hi = jnp.clip(jnp.minimum(parent * r + r - first_node, n_t - offset), 0, UNIT)
    hi = jnp.where(unit < num_units, jnp.maximum(hi, lo), lo)
    angle = jnp.maximum(n_t - 1 - s * r, 0)
    return NodeIndex(t, angle, offset, lo + 32 * hi, bounds, segments)


def node_buffers(B, H_kv, N: int, kp: int, vp: int, anchor=None):
    """Zeroed float32 accumulators of `layer_node_grads_pallas`: `dk [B, H_kv, Nu, Kp]`
    (copy 0's frame) and `dv [B, H_kv, Nu, Vp]`, `Nu` = N rounded up to whole units;
    allocated no earlier than `anchor` is computed (`common.zeros_after`; None: anywhere)."""
    Nu = -(-N // UNIT) * UNIT
    if anchor is None:
        return jnp.zeros((B, H_kv, Nu, kp), jnp.float32), jnp.zeros((B, H_kv, Nu, vp), jnp.float32)
    return zeros_after((B, H_kv, Nu, kp), jnp.float32, anchor), zeros_after((B, H_kv, Nu, vp), jnp.float32, anchor)


def node_gradient(dk_acc, N: int, cos, sin, r: int):
    """`dk [B, H_kv, N, Kp]` from `layer_node_grads_pallas`'s accumulator: node `j` was
    read rotated by `j mod r`."""
    angle = jnp.arange(N) % r
    return apply_rope(dk_acc[:, :, :N], cos[angle], -sin[angle])


def _fold_kernel(segment_ref, *refs, pieces: tuple):
    """The first segment of a unit that spilled adds the partials of all its segments,
    in order, to the unit's rows of the accumulators (whole `(b, h)` slices, aliased);
    every other program writes nothing. `pieces[a]`: array `a`'s power-of-two columns."""
    count = len(pieces)
    partial_refs, acc_in, acc_out = refs[:count], refs[count:2 * count], refs[2 * count:]
    x, spilled = pl.program_id(2), segment_ref[3]

    @pl.when(spilled > 0)
    def _():
        columns = [(a, piece) for a in range(count) for piece in pieces[a]]

        def add(i, sums):
            rows = pl.ds((x + i) * UNIT, UNIT)
            return tuple(total + partial_refs[a][rows, pl.ds(*piece)] for total, (a, piece) in zip(sums, columns))

        zeros = tuple(jnp.zeros((UNIT, size), jnp.float32) for _, (_, size) in columns)
        sums = lax.fori_loop(0, spilled, add, zeros)
        rows = pl.ds(segment_ref[0] * UNIT, UNIT)
        for total, (a, piece) in zip(sums, columns):
            acc_out[a][rows, pl.ds(*piece)] = acc_in[a][rows, pl.ds(*piece)] + total


def fold_spilled(segments, partials: tuple, accumulators: tuple, interpret: bool = False):
    """Adds each spilled unit's partials (`partials[a] [B, H_kv, X * UNIT, D_a]`, segment
    `x`'s rows `x*UNIT ...`), in segment order, to its rows of `accumulators[a] [B, H_kv,
    units * UNIT, D_a]` (float32, updated in place). `segments [B, H_kv, X, 4]` as in
    `NodeIndex`. Widths of any size, read in power-of-two pieces."""
    whole = [whole_slice(x) for x in (*partials, *accumulators)]
    count = len(accumulators)
    pair = pl.BlockSpec((None, None, None, segments.shape[-1]), lambda b, h, u: (b, h, u, 0))
    B, H_kv, X, _ = segments.shape
    out = pl.pallas_call(
        functools.partial(_fold_kernel, pieces=tuple(feature_pieces(a.shape[-1]) for a in accumulators)),
        grid=(B, H_kv, X),
        in_specs=[pair, *whole],
        out_specs=whole[count:],
        out_shape=[jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in accumulators],
        input_output_aliases={1 + count + a: a for a in range(count)},
        compiler_params=compiler_params(4, 1),
        interpret=interpret,
    )(segments, *partials, *accumulators)
    return tuple(out)


def whole_slice(x):
    """BlockSpec: the whole `(b, h)` slice of `[B, H_kv, ...]` for a grid `(B, H_kv, units)`."""
    return pl.BlockSpec((None, None) + x.shape[2:], lambda b, h, u: (b, h) + (0,) * (x.ndim - 2))


__all__ = ["UNIT", "NodeIndex", "fold_spilled", "node_buffers", "node_gradient", "node_index", "spill_segments",
           "units_per_pair", "whole_slice"]
