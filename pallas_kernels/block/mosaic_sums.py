"""The partial sums by node (`partials.sum_partials` with `tables`, the Mosaic GPU walk's
slabs) on Pallas's Mosaic GPU backend (`plgpu.kernel`): one program per `(node tile, kv
head, b)`, a memory warpgroup landing each index entry's rows by TMA into a ring, one
warpgroup adding them in float32 in the index's order, as `tools/probes/
block_backward_blocks.py`'s `sum_by_node` (5 TB/s on the H200).

An entry of tile `u` (`inverted.py`: block `j`, slot `s`) is, for each of its block's
programs `q` in order, the slab rows `p0 .. p0 + r - 1` (`p0 = s * r`) of program `j *
per_block + q`: its key gradients (the gradients of the keys turned by their buffer
positions, turned back here by the RoPE table's rows at `p0`) and value gradients. Rows
a program did not walk (outside its `ranges`) were never written: their copies come from
a zero tile instead. `plgpu.kernel` has no input-output aliasing, so each program lands
its tile's totals so far and writes the new ones, every tile of the layer a chunk.

Needs a Hopper GPU (no interpret mode); `partials.sum_partials` is its twin, which CI runs
interpreted and the gate compares against (`BlockKernels.sum_kernel`). Opt-in:
writing every tile of the layer a chunk makes layer 0 slower than the twin's in-place sums
(benchmarks/RESULTS.md, "The block backward without atomics").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.block.inverted import InvertedLayer
from pallas_kernels.block.merge import rotate_back
from pallas_kernels.block.partials import SumLaunch
from pallas_kernels.shared.shared_memory import LIMIT

WINDOW = 256  # index entries a copy lands (1 KB of int32, one TMA box)
RANGE_ROWS = 256  # programs' walked ranges a copy lands
HALF = 64  # the key and value gradients' halves (`mosaic_backward.HALF`)


def check_mosaic_sum_dims(r: int, kp: int, vp: int, programs: int, stages: int) -> None:
    """What this kernel takes; a ValueError naming the rule otherwise: node tiles of 8 to
    64 rows, `K` and `V` padded to 128 (the walk's slabs), and a chunk's programs' walked
    ranges within shared memory."""
    rules = []
    if r not in (8, 16, 32, 64):
        rules.append(f"compression_rate 8, 16, 32 or 64 (got {r})")
    if kp != 2 * HALF or vp != 2 * HALF:
        rules.append(f"key and value gradients 128 wide (got {kp}, {vp})")
    if not rules and _shared_bytes(r, programs, stages) > LIMIT:
        rules.append(f"its ring of {stages} entries and a chunk's {programs} programs' ranges within shared memory "
                     f"(fewer blocks a chunk: BlockConfig.backward_partial_bytes)")
    if rules:
        raise ValueError("BlockKernels(sum_kernel='mosaic_gpu') takes " + "; ".join(rules)
                         + ": use BlockKernels(sum_kernel='pallas_triton')")


def _padded_programs(programs: int) -> int:
    return -(-programs // RANGE_ROWS) * RANGE_ROWS


def _shared_bytes(r: int, programs: int, stages: int) -> int:
    ring = stages * r * (2 * HALF * 2 + 2 * HALF * 2 + 2 * HALF * 4)  # dk halves, dv (16-bit), cos, sin
    totals = r * (2 * HALF + 2 * HALF) * 4  # the tile's key and value totals, float32
    return ring + totals + 2 * 2 * WINDOW * 4 + _padded_programs(programs) * 8 * 4 + 8 * 1024


def _sum_kernel(first_ref, lo_ref, hi_ref, blk_ref, slot_ref, range_ref, pk_ref, pv_ref, cos_ref, sin_ref, zero_ref,
                tk_ref, tv_ref, ok_ref, ov_ref, scratch, bars, *, r: int, width: int, per_block: int, layer: int,
                stages: int, programs: int):
    klo_s, khi_s, v_s, c_s, s_s, blk_s, slot_s, range_s, lo_s, hi_s, first_s, tk_s, tv_s = scratch
    setup, codes, landed, consumed = bars
    u, hk, b = lax.axis_index("u"), lax.axis_index("h"), lax.axis_index("b")
    wg = lax.axis_index("wg")
    S = stages
    tile = pl.ds(0, r)

    @pl.when(wg == 0)
    def _consumer():
        plgpu.barrier_wait(setup)
        n = (hi_s[u % 4] - lo_s[u % 4]) * per_block
        acc = (tk_s.at[0][...], tk_s.at[1][...], tv_s[...])

        def entry(g, acc):
            slot = lax.rem(g, S)
            plgpu.barrier_wait(landed.at[slot])
            lo, hi = rotate_back(klo_s.at[slot][...].astype(jnp.float32), khi_s.at[slot][...].astype(jnp.float32),
                                 c_s.at[slot][...], s_s.at[slot][...])
            acc = (acc[0] + lo, acc[1] + hi, acc[2] + v_s.at[slot][...].astype(jnp.float32))
            plgpu.barrier_arrive(consumed.at[slot])
            return acc

        dk_lo, dk_hi, dv = lax.fori_loop(0, n, entry, acc)
        tk_s.at[0][...] = dk_lo
        tk_s.at[1][...] = dk_hi
        tv_s[...] = dv
        plgpu.commit_smem()
        for half in range(2):
            plgpu.copy_smem_to_gmem(tk_s.at[half], ok_ref.at[b, hk, u, tile, pl.ds(half * HALF, HALF)])
        plgpu.copy_smem_to_gmem(tv_s, ov_ref.at[b, hk, u, tile])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        quad = pl.ds(u // 4 * 4, 4)  # a 16-byte box holding tile `u`'s bound
        # Bounds in buffers of their own: a TMA destination starts at 128 bytes.
        plgpu.copy_gmem_to_smem(lo_ref.at[b, hk, quad], lo_s, setup)
        plgpu.copy_gmem_to_smem(hi_ref.at[b, hk, quad], hi_s, setup)
        plgpu.copy_gmem_to_smem(first_ref, first_s, setup)
        for piece in range(_padded_programs(programs) // RANGE_ROWS):
            rows = pl.ds(piece * RANGE_ROWS, RANGE_ROWS)
            plgpu.copy_gmem_to_smem(range_ref.at[b, hk, rows], range_s.at[rows], setup)
        for half in range(2):
            plgpu.copy_gmem_to_smem(tk_ref.at[b, hk, u, tile, pl.ds(half * HALF, HALF)], tk_s.at[half], setup)
        plgpu.copy_gmem_to_smem(tv_ref.at[b, hk, u, tile], tv_s, setup)
        plgpu.barrier_wait(setup)
        start, stop = lo_s[u % 4], hi_s[u % 4]
        w0 = start // 4 * 4  # a window starts at a 16-byte boundary
        first = first_s[0]

        def land_window(k):
            at = pl.ds(w0 + k * WINDOW, WINDOW)
            plgpu.copy_gmem_to_smem(blk_ref.at[b, hk, at], blk_s.at[k % 2], codes.at[k % 2])
            plgpu.copy_gmem_to_smem(slot_ref.at[b, hk, at], slot_s.at[k % 2], codes.at[k % 2])

        @pl.when(stop > start)
        def _():
            land_window(0)

        def entry(e, g):
            k = (e - w0) // WINDOW
            at = (e - w0) % WINDOW

            @pl.when((at == 0) | (e == start))
            def _():  # the entry opens a window: wait for it, and land the next
                plgpu.barrier_wait(codes.at[k % 2])

                @pl.when(w0 + (k + 1) * WINDOW < stop)
                def _():
                    land_window(k + 1)

            blk, s = blk_s[k % 2, at], slot_s[k % 2, at]
            p0 = s * r
            for q in range(per_block):  # the block's programs, in order
                slot = lax.rem(g + q, S)

                @pl.when(g + q >= S)
                def _():
                    plgpu.barrier_wait(consumed.at[slot])

                prog = (blk - first) * per_block + q
                walked = (p0 >= range_s[prog, 2 * layer]) & (p0 < range_s[prog, 2 * layer + 1])
                rows = pl.ds(prog * width + p0, r)

                @pl.when(walked)
                def _():
                    for half, dst in enumerate((klo_s, khi_s)):
                        plgpu.copy_gmem_to_smem(pk_ref.at[b, hk, rows, pl.ds(half * HALF, HALF)], dst.at[slot],
                                                landed.at[slot])
                    plgpu.copy_gmem_to_smem(pv_ref.at[b, hk, rows], v_s.at[slot], landed.at[slot])

                @pl.when(~walked)
                def _():  # never written: zeros instead
                    for dst in (klo_s, khi_s):
                        plgpu.copy_gmem_to_smem(zero_ref.at[:, pl.ds(0, HALF)], dst.at[slot], landed.at[slot])
                    plgpu.copy_gmem_to_smem(zero_ref, v_s.at[slot], landed.at[slot])

                table = pl.ds(jnp.minimum(p0, width - r), r)
                plgpu.copy_gmem_to_smem(cos_ref.at[table], c_s.at[slot], landed.at[slot])
                plgpu.copy_gmem_to_smem(sin_ref.at[table], s_s.at[slot], landed.at[slot])
            return g + per_block

        lax.fori_loop(start, stop, entry, jnp.int32(0))


def ring_stages(r: int, programs: int) -> int:
    """Entries the ring holds: four, or fewer where wide node tiles pass shared memory."""
    return next((s for s in (4, 3) if _shared_bytes(r, programs, s) <= LIMIT), 2)


@functools.partial(jax.jit, static_argnames=("launch",))
def mosaic_sum_partials(first, bounds, index: InvertedLayer, ranges, slabs, *, launch: SumLaunch, tables, totals):
    """`partials.sum_partials(..., tables=tables, totals=totals)` (same arguments and
    results; `totals` `(dk, dv)` each `[B, H_kv, U, R, 128]` float32, rows `r ..` of a
    tile left as they come) on the kernel above; `launch`'s warps, stages and interpret
    mode are Pallas-Triton's and not read."""
    (lo, hi), (pk, pv) = bounds, slabs
    r, width, per_block, layer = launch.r, launch.width, launch.per_block, launch.layer
    B, H_kv, U = lo.shape
    programs = ranges.shape[2]
    stages = ring_stages(r, programs)
    check_mosaic_sum_dims(r, pk.shape[-1], pv.shape[-1], programs, stages)
    pad_to = lambda x, axis, n: jnp.pad(x, [(0, 0)] * axis + [(0, n - x.shape[axis])] + [(0, 0)] * (x.ndim - axis - 1))
    Up = -(-U // 4) * 4
    lo, hi = pad_to(lo, 2, Up), pad_to(hi, 2, Up)
    E = -(-index.blocks.shape[-1] // 4) * 4  # rows of whole 16 bytes (TMA's strides), windows in bounds
    blocks, slots = (pad_to(x, 2, E + WINDOW) for x in (index.blocks, index.slots))
    ranges = pad_to(ranges, 2, _padded_programs(programs))
    cos, sin = (jnp.pad(x[:width], ((0, max(0, width - x.shape[0])), (0, 0))) for x in tables)
    zero = jnp.zeros((r, 2 * HALF), pk.dtype)
    dt = pk.dtype
    scratch = [plgpu.SMEM((stages, r, HALF), dt), plgpu.SMEM((stages, r, HALF), dt),
               plgpu.SMEM((stages, r, 2 * HALF), pv.dtype),
               plgpu.SMEM((stages, r, HALF), jnp.float32), plgpu.SMEM((stages, r, HALF), jnp.float32),
               plgpu.SMEM((2, WINDOW), jnp.int32), plgpu.SMEM((2, WINDOW), jnp.int32),
               plgpu.SMEM((_padded_programs(programs), ranges.shape[-1]), jnp.int32),
               plgpu.SMEM((4,), jnp.int32), plgpu.SMEM((4,), jnp.int32), plgpu.SMEM((first.shape[0],), jnp.int32),
               plgpu.SMEM((2, r, HALF), jnp.float32), plgpu.SMEM((r, 2 * HALF), jnp.float32)]
    setup = 3 + _padded_programs(programs) // RANGE_ROWS + 3
    bars = [plgpu.Barrier(num_arrivals=setup), plgpu.Barrier(num_arrivals=2, num_barriers=2),
            plgpu.Barrier(num_arrivals=5, num_barriers=stages), plgpu.Barrier(num_arrivals=1, num_barriers=stages)]
    kernel_fn = functools.partial(_sum_kernel, r=r, width=width, per_block=per_block, layer=layer, stages=stages,
                                  programs=programs)

    def entry_fn(*refs):
        pl.run_scoped(lambda s, b_: kernel_fn(*refs, s, b_), scratch, bars, collective_axes="wg")

    out = [jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in totals]
    kernel = plgpu.kernel(entry_fn, out_type=out, grid=(U, H_kv, B), grid_names=("u", "h", "b"), num_threads=2,
                          thread_name="wg")
    return tuple(kernel(first, lo, hi, blocks, slots, ranges, pk, pv, cos, sin, zero, *totals))


__all__ = ["check_mosaic_sum_dims", "mosaic_sum_partials", "ring_stages"]
