"""The block backward's key and value gradients as partial sums, summed by node in a
fixed order (SPEC 5 with SPEC 12's selections constant; `BlockKernels.sums =
"partials"`): no atomics, so `dk`, `dv` are bitwise the same run to run.

The walk is `backward.py`'s, block-major (the rows held, the candidates gathered, as
the forward does). Where the atomics add each candidate tile's `dk`, `dv` into the
layer's accumulators, this writes them, rotated back, to the program's own slab of a
partial buffer at the tile's buffer positions (`[W_l, D]` a program and layer), and
records the positions it walked. Then one launch a layer sums each node tile's
partials over the blocks that merged it (`inverted.py`'s index, in block order): the
inverse of the walk, reading instead of adding.

The buffer is `B * H_kv * NB * sum_l W_l * (K + V)` float32 for the whole call (about
570 GB at the benchmark shape's 128K), so the blocks go in chunks that keep it under
`BlockConfig.backward_partial_bytes`: a chunk's walk, then its sums added to the
layer's totals, chunk after chunk in block order.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.block.inverted import InvertedLayer
from pallas_kernels.block.merge import BlockStatic, rotate_back
from pallas_kernels.shared.common import compiler_params, next_power_of_two

LANES = 16  # a chunk's first block, as a vector the kernels read one lane of


def tile_rows(r: int) -> int:
    """Rows a node tile takes in the totals: `r`, at least 16, a power of two."""
    return max(16, next_power_of_two(r))


def slab_widths(layer_sizes, table_rows: int, st: BlockStatic) -> tuple[int, ...]:
    """Each layer's positions a program's partial slab holds: its walk stops at the
    tile past its last candidate, at most the layer's nodes and the RoPE table's rows."""
    return tuple(next_power_of_two(min(n, table_rows), st.tile) for n in layer_sizes)


def range_lanes(num_layers: int) -> int:
    """Lanes of a program's walked ranges: `[start, stop)` positions a layer."""
    return next_power_of_two(2 * num_layers, 2)


def chunk_blocks(num_blocks: int, per_block: int, bytes_per_program: int, budget: int) -> int:
    """Blocks a chunk: the most whose programs' slabs fit `budget` bytes (at least one)."""
    return max(1, min(num_blocks, budget // max(1, bytes_per_program * per_block)))


def _sum_kernel(first_ref, lo_ref, hi_ref, blk_ref, slot_ref, range_ref, pk_ref, pv_ref, *refs, r: int, width: int,
                per_block: int, layer: int, rotated: bool):
    cos_ref, sin_ref, refs = (refs[0], refs[1], refs[2:]) if rotated else (None, None, refs)
    dk_in, dv_in, dk_ref, dv_ref = refs  # the totals so far, aliased to the new ones
    R = dk_ref.shape[0]
    h = dk_ref.shape[-1] // 2
    u = pl.program_id(2)
    c = jnp.arange(R, dtype=jnp.int32)
    real = c < r
    first = first_ref[0]

    def entry(e, carry):
        dk_lo, dk_hi, dv = carry
        j = blk_ref[e] - first  # the block inside the chunk
        pos = slot_ref[e] * r + jnp.where(real, c, 0)  # the tile's buffer positions in block `j`
        at = jnp.minimum(pos, width - 1)
        for q in range(per_block):  # the block's programs, in order
            prog = j * per_block + q
            walked = (real & (pos >= range_ref[prog, 2 * layer]) & (pos < range_ref[prog, 2 * layer + 1]))[:, None]
            lo = pk_ref[prog * width + at, pl.ds(0, h)].astype(jnp.float32)
            hi = pk_ref[prog * width + at, pl.ds(h, h)].astype(jnp.float32)
            if rotated:  # the gradient of the key turned by its buffer position, turned back
                lo, hi = rotate_back(lo, hi, cos_ref[at, :], sin_ref[at, :])
            dk_lo = dk_lo + jnp.where(walked, lo, 0.0)
            dk_hi = dk_hi + jnp.where(walked, hi, 0.0)
            dv = dv + jnp.where(walked, pv_ref[prog * width + at, :].astype(jnp.float32), 0.0)
        return dk_lo, dk_hi, dv

    start, stop = lo_ref[u], hi_ref[u]

    @pl.when(stop > start)
    def _():  # a tile no block of the chunk merged keeps its totals, unread and unwritten
        totals = (dk_in[:, pl.ds(0, h)], dk_in[:, pl.ds(h, h)], dv_in[...])
        dk_lo, dk_hi, dv = lax.fori_loop(start, stop, entry, totals)
        dk_ref[:, pl.ds(0, h)] = dk_lo
        dk_ref[:, pl.ds(h, h)] = dk_hi
        dv_ref[...] = dv


@dataclasses.dataclass(frozen=True)
class SumLaunch:
    """What one layer's sum of a chunk's partials is compiled for: the compression rate
    `r`, the layer's slab `width` a program, the programs a block `per_block`, the
    `layer`, and the Pallas-Triton launch's warps, stages and interpret mode."""

    r: int
    width: int
    per_block: int
    layer: int
    num_warps: int = 4
    num_stages: int = 1
    interpret: bool = False


@functools.partial(jax.jit, static_argnames=("launch",))
def sum_partials(first, bounds, index: InvertedLayer, ranges, slabs, *, launch: SumLaunch, tables=None, totals=None):
    """Layer `launch.layer`'s `(dk [B, H_kv, U, R, kp], dv [B, H_kv, U, R, vp])` float32
    (`totals_layout`) with one chunk's partials `slabs = (pk, pv)` added: `pk [B, H_kv,
    NPc * width, kp]`, `pv` (program `p`'s slab at rows `p * width ..`) and walked
    `ranges [B, H_kv, NPc, lanes]`; node tile `u` adds its index entries `lo[..., u] ..
    hi[..., u] - 1` (`bounds = (lo, hi)`, the chunk's blocks, whose first is `first
    [16]`'s lane 0), each block's programs in order, to its totals so far (`totals`, `(dk, dv)` in that layout, which the result
    aliases: a tile with no entries keeps them untouched; None: zeros). `tables`: `(cos, sin) [>= width, kp / 2]` float32
    where each `dk` partial is the gradient of its key turned by its buffer position
    (`mosaic_backward.py`'s slabs): each is turned back by it before the add; None: the
    slabs hold `dk` as it is (`backward.py`'s). Slabs in any float dtype, summed in
    float32."""
    (lo, hi), (pk, pv), r = bounds, slabs, launch.r
    B, H_kv, U = lo.shape
    kp, vp = pk.shape[-1], pv.shape[-1]
    if totals is None:
        totals = zero_totals(B, H_kv, U, r, kp, vp)
    whole = lambda x: pl.BlockSpec((None, None) + x.shape[2:], lambda i, h, u: (i, h) + (0,) * (x.ndim - 2))
    tile = lambda d: pl.BlockSpec((None, None, None, tile_rows(r), d), lambda i, h, u: (i, h, u, 0, 0))
    rotated = tables is not None
    tables = () if tables is None else tuple(x[:launch.width] for x in tables)
    table_specs = [pl.BlockSpec(x.shape, lambda i, h, u: (0, 0)) for x in tables]
    first_total = 8 + len(tables)
    return tuple(pl.pallas_call(
        functools.partial(_sum_kernel, r=r, width=launch.width, per_block=launch.per_block, layer=launch.layer,
                          rotated=rotated),
        grid=(B, H_kv, U),
        in_specs=[pl.BlockSpec((LANES,), lambda i, h, u: (0,)), whole(lo), whole(hi), whole(index.blocks),
                  whole(index.slots), whole(ranges), whole(pk), whole(pv)] + table_specs + [tile(kp), tile(vp)],
        out_specs=[tile(kp), tile(vp)],
        out_shape=[jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in totals],
        input_output_aliases={first_total: 0, first_total + 1: 1},
        compiler_params=compiler_params(launch.num_warps, launch.num_stages),
        interpret=launch.interpret,
    )(first, lo, hi, index.blocks, index.slots, ranges, pk, pv, *tables, *totals))


def zero_totals(B: int, H_kv: int, U: int, r: int, kp: int, vp: int):
    """A layer's key and value totals before any chunk: `(dk [B, H_kv, U, R, kp], dv [..., vp])`
    float32 zeros, each node tile's rows padded to `R = tile_rows(r)`."""
    R = tile_rows(r)
    return jnp.zeros((B, H_kv, U, R, kp), jnp.float32), jnp.zeros((B, H_kv, U, R, vp), jnp.float32)


def totals_by_node(totals, r: int):
    """`sum_partials`' `(dk, dv)` as `[B, H_kv, U * r, D]`: the padded rows dropped."""
    out = []
    for x in totals:
        B, H_kv, U, _, D = x.shape
        out.append(x[:, :, :, :r].reshape(B, H_kv, U * r, D))
    return tuple(out)


def entry_keys(index: InvertedLayer, num_blocks: int):
    """`[B, H_kv, E]` int32, each entry's `tile * NB + block`: ascending (tiles in order,
    each tile's blocks in order; the padding past the last tile), so a chunk's entries of
    a tile are one `searchsorted` range."""
    entries = jnp.arange(index.blocks.shape[-1], dtype=jnp.int32)
    tile = jnp.vectorize(lambda off: jnp.searchsorted(off[1:], entries, side="right"), signature="(u)->(e)")(
        index.offsets)
    return (tile * num_blocks + index.blocks).astype(jnp.int32)


def chunk_edges(keys, num_tiles: int, num_blocks: int, edges):
    """`[C, B, H_kv, U]` int32: for each block `edges[c]` (`[C]`, ascending), each tile's
    first index entry of a block at or past it; chunk `c` of blocks `edges[c] ..
    edges[c + 1] - 1` holds entries `[c] .. [c + 1] - 1` of each tile. One search for
    every chunk of a call."""
    base = jnp.arange(num_tiles, dtype=jnp.int32)[None, :] * num_blocks + jnp.asarray(edges, jnp.int32)[:, None]
    find = jnp.vectorize(lambda k, x: jnp.searchsorted(k, x, side="left"), signature="(e),(c,u)->(c,u)")
    return jnp.moveaxis(find(keys, base).astype(jnp.int32), 2, 0)


def chunk_bounds(keys, num_tiles: int, num_blocks: int, first, count: int):
    """`(lo, hi) [B, H_kv, U]`: each tile's entries of blocks `first .. first + count - 1`."""
    bounds = chunk_edges(keys, num_tiles, num_blocks, jnp.stack([jnp.asarray(first, jnp.int32),
                                                                   jnp.asarray(first + count, jnp.int32)]))
    return bounds[0], bounds[1]


__all__ = ["SumLaunch", "chunk_blocks", "chunk_bounds", "chunk_edges", "entry_keys", "range_lanes", "slab_widths", "sum_partials",
           "totals_by_node", "zero_totals"]
