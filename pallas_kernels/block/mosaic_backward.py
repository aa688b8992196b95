"""The block backward's walk (`backward._block_backward_kernel` with `sums="partials"`,
SPEC 5 with SPEC 12's selections constant) on Pallas's Mosaic GPU backend
(`plgpu.kernel`), warp-specialized as the forward merge (`mosaic_merge.py`) is.

One program per `(b, queries, h_kv)` holds its rows (padded to 128: two consumer
warpgroups of 64) and walks every layer's candidates `TILE = 64` a step, landed by a
memory warpgroup through a ring of shared-memory stages. A step, each consumer:

    s = q k^T, dp = do v^T                  [64 rows, 64]   (the keys as WGMMA's N)
    p = exp(s - lse) where merged, ds = alpha p (dp - delta)
    dq += ds k                              [64 rows, K]    (carried over the layer)

then both consumers' `p`, `ds` go to shared memory (one barrier of the pair) and
consumer 0 takes `dk = ds^T q`, consumer 1 `dv = p^T do` over all 128 rows, each `[64,
K]` partial stored by TMA at the step's buffer positions of the program's slab (the
layout of `partials.py`, which sums them by node in block order: no atomics, so `dk`,
`dv` are the same bits every call).

Rotation: each layer's queries come rotated by their row's angle `n - 1`
(`mosaic_merge.rotated_queries`), and each key sits rotated by its buffer position `p`
in shared memory, so that `dq` sums in the rows' frame over a layer (rotated back in
XLA, once a layer) and each `dk` partial is the gradient of the key turned by `p`
(`partials.sum_partials(..., rotated=True)` turns it back when it sums). The keys come
from XLA rotated by their offset within a step (`mosaic_merge.turned_keys`; the top
layer by its node, its buffer position in every block) and the memory warpgroup turns
each landed step by the step's first position (one row of tables a step) while the next
step's copies fly. Masks as the forward's: at layer 0 the positions past each row's
`n`, above it the refined bitmap's and those past `n`.

Inputs in bfloat16 or float16, `K / 2 = 64` and `V = 128` (padded), `compression_rate`
8, 16, 32 or 64 and at most 128 rows a program (`check_mosaic_backward_dims`); other
launches take the Pallas-Triton walk, its twin, which CI runs interpreted. Partials in
the inputs' dtype (each block's share of a node rounded once before the float32 sum by
node). Needs a Hopper GPU; the tests that run it are GPU-marked, and the gate compares
it with the twin.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from htree_jax.core.indexing import candidate_count
from pallas_kernels.block.merge import BlockLaunch, BlockStatic, layer_parent_counts, rope_tables, rotate_back
from pallas_kernels.block.mosaic_merge import (DTYPES, WORD, count_entries, from_program_layout, layer_bounds,
                                               node_first_row, per_program_lists, program_layout,
                                               shifted_position,
                                               refined_bitmaps, rotated_queries, row_angles, shared_bytes,
                                               split_layers, tma_boxes, turned_keys, unmerged_at_minus_inf, with_firsts,
                                               with_offset)
from pallas_kernels.shared.common import next_power_of_two
from pallas_kernels.shared.shared_memory import LIMIT

TILE = 64  # candidates a step (WGMMA's N of the scores, M of the key gradients)
ROWS = 64  # rows a consumer warpgroup holds (WGMMA's M)
PROGRAM_ROWS = 2 * ROWS  # a program's rows, padded: `dk`, `dv` split between the two consumers
HALF = 64  # K / 2 and V / 2: each a WGMMA operand of one 128-byte swizzle
LOG2E = math.log2(math.e)
SHARE = 65536 // (3 * 128) // 8 * 8  # registers a thread of a three-warpgroup launch holds


@dataclasses.dataclass(frozen=True)
class BackwardPipeline:
    """The walk's layout on one multiprocessor: `stages` steps of keys and values in the
    ring, the registers a consumer thread and a memory thread keep (`setmaxnreg`, each a
    multiple of 8). A launch of three 128-thread warpgroups gives each thread `SHARE =
    168` registers, and `setmaxnreg` only moves them: `2 * consumer + memory` past `3 *
    SHARE` leaves the consumers' increase waiting for registers that never come (a
    hang, measured: 208 / 96)."""

    stages: int = 2
    consumer_registers: int = 208
    memory_registers: int = 88

    def __post_init__(self):
        c, m = self.consumer_registers, self.memory_registers
        if self.stages < 2 or 2 * c + m > 3 * SHARE or any(n % 8 or not 24 <= n <= 256 for n in (c, m)) or (
                m > SHARE or c < SHARE):
            raise ValueError(f"BackwardPipeline: stages >= 2; 2 * consumer + memory registers <= {3 * SHARE}, each "
                             f"a multiple of 8, memory at most and consumer at least {SHARE} ({self})")


BACKWARD_PIPELINE = BackwardPipeline()


def check_mosaic_backward_dims(st: BlockStatic, K: int, V: int, dtype, table_rows: int,
                               pipe: BackwardPipeline | None = None) -> None:
    """What this walk takes; a ValueError naming the rule otherwise: bfloat16 or float16,
    `compression_rate` 8, 16, 32 or 64 (`TILE` whole node tiles of whole 8-row tiles),
    at most 128 rows a program, `K / 2` and `V` padded to 64 and 128 (the `dk` and `dv`
    products split the same two 64-wide halves between the consumers), and buffers
    (`top_k`'s lists, the layers' bitmaps) within a block's shared memory."""
    rules = []
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES]:
        rules.append(f"bfloat16 or float16 inputs (got {jnp.dtype(dtype).name})")
    if st.r not in (8, 16, 32, 64):
        rules.append(f"compression_rate 8, 16, 32 or 64 (got {st.r})")
    if st.rows > PROGRAM_ROWS:
        rules.append(f"at most {PROGRAM_ROWS} rows a program (got {st.rows})")
    if next_power_of_two(K // 2, 16) != HALF or next_power_of_two(V, 16) != 2 * HALF:
        rules.append(f"K in 66..128 and V in 65..128 (padded to 128; got K = {K}, V = {V})")
    if not rules:
        need = shared_bytes(launch_scratch(st, pipe or BACKWARD_PIPELINE, dtype, table_rows, True, True))
        if need > LIMIT:
            rules.append(f"buffers within a block's {LIMIT} bytes of shared memory (top_k={st.top_k} and "
                         f"{st.num_layers} layers take {need})")
    if rules:
        raise ValueError("BlockKernels(walk='mosaic_gpu') takes " + "; ".join(rules)
                         + ": use BlockKernels(walk='pallas_triton')")


def launch_scratch(st: BlockStatic, pipe: BackwardPipeline, dtype, table_rows: int, packed: bool, shard: bool):
    """`scratch_shapes` for a launch: `(table_rows rounded, its lists' and bitmaps' TMA
    boxes)` and the scratch."""
    words = _table_rows(table_rows) // WORD
    lists = (max(st.num_layers - 1, 1),) + tma_boxes(next_power_of_two(st.top_k, 4))
    return scratch_shapes(st, pipe, dtype, lists, (max(st.num_layers - 1, 1),) + tma_boxes(words),
                          count_entries(st.num_layers, packed, shard))


def _table_rows(table_rows: int) -> int:
    """RoPE rows the walk reads: whole steps, and a bitmap a TMA copy of at least 16 bytes."""
    return -(-max(table_rows, 4 * WORD) // TILE) * TILE


def _transforms(dtype):
    elems = 128 // jnp.dtype(dtype).itemsize  # a 64-wide 16-bit operand: one 128-byte swizzle
    return plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(128)


def _walk_kernel(q_lo_ref, q_hi_ref, do_ref, lse_ref, delta_ref, bcos_ref, bsin_ref, sel_ref, count_ref, bits_ref,
                 *refs, st: BlockStatic, widths: tuple, words: tuple[int, int], lists: tuple[int, int], dtype,
                 pipe: BackwardPipeline, packed: bool, shard: bool):
    L, r, C, S = st.num_layers, st.r, TILE, pipe.stages
    layer_refs = refs[: 4 * L]  # bottom first: keys' halves (turned copies), values' halves
    dq_ref = refs[4 * L]
    slab_refs = refs[4 * L + 1: 4 * L + 1 + 2 * L]  # bottom first: dk, dv partial slabs
    scratch, bars = refs[4 * L + 1 + 2 * L:]
    qd_s, k_lo_s, k_hi_s, v_lo_s, v_hi_s, pd_s, out_s, part_s, bcos_s, bsin_s, sel_s, bits_s, count_s, lse_s, \
        delta_s = scratch  # qd_s [2, 2, 128, HALF]: the layer's queries, then the cotangents; each in halves
    setup, q_bar, layer_done, landed, k_bars, consumed, pd_ready, pd_read = bars
    b, j, hk, wg = lax.axis_index("b"), lax.axis_index("j"), lax.axis_index("h"), lax.axis_index("wg")
    t_first = j * st.queries
    t0 = t_first - t_first % r
    blk = t_first // r
    node_tiles = C // r
    wcols = words[1]
    lcols = lists[1]

    def bounds(l):
        return layer_bounds(count_s, l, st=st, tile=C, t_first=t_first, t0=t0, packed=packed, shard=shard)

    @pl.when(wg < 2)
    def _consumer():
        plgpu.set_max_registers(pipe.consumer_registers, action="increase")
        mine = pl.ds(wg * ROWS, ROWS)
        row_layout, col_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
        row = plgpu.broadcasted_iota(jnp.int32, (ROWS,), 0, layout=row_layout) + wg * ROWS
        col = plgpu.broadcasted_iota(jnp.int32, (C,), 0, layout=col_layout)
        plgpu.barrier_wait(setup)
        lse2, delta = _row(lse_s.at[mine]) * LOG2E, _row(delta_s.at[mine])
        zero = plgpu.layout_cast(jnp.zeros((ROWS, HALF), jnp.float32), plgpu.Layout.WGMMA)
        zc = plgpu.layout_cast(jnp.zeros((ROWS, C), jnp.float32), plgpu.Layout.WGMMA)
        g = jnp.int32(0)
        for l in reversed(range(L)):
            n_parents, n_max, start, stop = bounds(l)
            n_row = candidate_count(n_parents, shifted_position(count_s, t_first + row // st.group, L, shard), r, 0) if (
                l == 0) else None
            part_at = j * widths[l]
            dk_slab, dv_slab = slab_refs[2 * l], slab_refs[2 * l + 1]

            def merged(s, i, l=l, n_max=n_max, n_row=n_row):
                return unmerged_at_minus_inf(s, i, layer=l, num_layers=L, tile=C, col=col, n_row=n_row,
                                             n_max=n_max, bits_s=bits_s, wcols=wcols)

            plgpu.barrier_wait(q_bar)

            def step(i, carry, merged=merged, part_at=part_at, dk_slab=dk_slab, dv_slab=dv_slab):
                dq_lo, dq_hi, g = carry
                slot = lax.rem(g, S)
                plgpu.barrier_wait(k_bars.at[slot])

                def scores(refs):
                    s_ref, dp_ref = refs
                    plgpu.wgmma(s_ref, qd_s.at[0, 0, mine], k_lo_s.at[slot].transpose((1, 0)))
                    plgpu.wgmma(s_ref, qd_s.at[0, 1, mine], k_hi_s.at[slot].transpose((1, 0)))
                    plgpu.wgmma(dp_ref, qd_s.at[1, 0, mine], v_lo_s.at[slot].transpose((1, 0)))
                    plgpu.wgmma(dp_ref, qd_s.at[1, 1, mine], v_hi_s.at[slot].transpose((1, 0)))

                s, dp = pl.run_state(scores)((plgpu.ACC.init(zc), plgpu.ACC.init(zc)))
                s = merged(s * (st.alpha * LOG2E), i)
                p = jnp.exp2(s - lax.broadcast_in_dim(lse2, s.shape, [0]))
                ds = p * (dp - lax.broadcast_in_dim(delta, s.shape, [0])) * st.alpha
                p16, ds16 = p.astype(dtype), ds.astype(dtype)

                def rows_grad(refs):
                    lo_ref, hi_ref = refs
                    plgpu.wgmma(lo_ref, ds16, k_lo_s.at[slot])
                    plgpu.wgmma(hi_ref, ds16, k_hi_s.at[slot])

                dq_lo, dq_hi = pl.run_state(rows_grad)((plgpu.ACC.init(dq_lo), plgpu.ACC.init(dq_hi)))
                plgpu.barrier_arrive(consumed.at[slot])  # the step's keys and values are read

                @pl.when(g > 0)
                def _():  # both consumers' previous key products have read `pd_s`
                    plgpu.barrier_wait(pd_read)

                pd_s.at[0, wg][...] = ds16
                pd_s.at[1, wg][...] = p16
                plgpu.commit_smem()
                plgpu.barrier_arrive(pd_ready)
                plgpu.barrier_wait(pd_ready)

                def key_grads(refs):  # consumer 0: dk = ds^T q; 1: dv = p^T do; over both consumers' rows
                    lo_acc, hi_acc = refs
                    for half in range(2):
                        rows = pl.ds(half * ROWS, ROWS)
                        weights = pd_s.at[wg, half].transpose((1, 0))  # [C, 64 rows]: ds or p
                        plgpu.wgmma(lo_acc, weights, qd_s.at[wg, 0, rows])  # q or do
                        plgpu.wgmma(hi_acc, weights, qd_s.at[wg, 1, rows])

                g_lo, g_hi = pl.run_state(key_grads)((plgpu.ACC.init(zc), plgpu.ACC.init(zc)))
                plgpu.barrier_arrive(pd_read)
                at = pl.ds(part_at + i * C, C)
                for half, x in enumerate((g_lo, g_hi)):
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the staging buffer is free
                    part_s.at[wg][...] = x.astype(dtype)
                    plgpu.commit_smem()
                    cols = pl.ds(half * HALF, HALF)

                    @pl.when(wg == 0)
                    def _():
                        plgpu.copy_smem_to_gmem(part_s.at[0], dk_slab.at[b, hk, at, cols])

                    @pl.when(wg == 1)
                    def _():
                        plgpu.copy_smem_to_gmem(part_s.at[1], dv_slab.at[b, hk, at, cols])
                return dq_lo, dq_hi, g + 1

            dq_lo, dq_hi, g = lax.fori_loop(start, stop, step, (zero, zero, g))
            for half, x in enumerate((dq_lo, dq_hi)):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                out_s.at[wg][...] = x
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_s.at[wg], dq_ref.at[l, b, j, hk, half, mine])
            plgpu.barrier_arrive(layer_done)  # this layer's rows are read: the next may land
        plgpu.wait_smem_to_gmem(0)

    def finish(g, absolute):
        """Step `g`'s keys, once landed, turned by the step's first position (`rotate_back`'s
        transpose: `merge.rotate_halves`, in float32), then handed to the consumers."""
        slot = lax.rem(g, S)
        plgpu.barrier_wait(landed.at[slot])
        if not absolute:
            cb = lax.broadcast_in_dim(plgpu.layout_cast(bcos_s.at[slot, 0][...], plgpu.Layout.WGMMA.reduce(0)),
                                      (C, HALF), [1])
            sb = lax.broadcast_in_dim(plgpu.layout_cast(bsin_s.at[slot, 0][...], plgpu.Layout.WGMMA.reduce(0)),
                                      (C, HALF), [1])
            k_lo = k_lo_s.at[slot][...].astype(jnp.float32)
            k_hi = k_hi_s.at[slot][...].astype(jnp.float32)
            k_lo_s.at[slot][...] = (k_lo * cb - k_hi * sb).astype(dtype)
            k_hi_s.at[slot][...] = (k_lo * sb + k_hi * cb).astype(dtype)
            plgpu.commit_smem()
        plgpu.barrier_arrive(k_bars.at[slot])

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(pipe.memory_registers, action="decrease")
        plgpu.copy_gmem_to_smem(count_ref.at[b, blk, hk], count_s, setup)
        plgpu.copy_gmem_to_smem(sel_ref.at[b, blk, hk], sel_s, setup)
        plgpu.copy_gmem_to_smem(bits_ref.at[b, blk, hk], bits_s, setup)
        for half in range(2):
            plgpu.copy_gmem_to_smem(do_ref.at[b, j, hk, half], qd_s.at[1, half], setup)
        plgpu.copy_gmem_to_smem(lse_ref.at[b, j, hk], lse_s, setup)
        plgpu.copy_gmem_to_smem(delta_ref.at[b, j, hk], delta_s, setup)
        plgpu.barrier_wait(setup)
        g = jnp.int32(0)
        for l in reversed(range(L)):
            k_lo_ref, k_hi_ref, v_lo_ref, v_hi_ref = layer_refs[4 * l: 4 * l + 4]
            _, n_max, start, stop = bounds(l)
            top = l == L - 1
            if not top:
                plgpu.barrier_wait(layer_done)  # the layer above is done with the rows
            plgpu.copy_gmem_to_smem(q_lo_ref.at[l, b, j, hk], qd_s.at[0, 0], q_bar)
            plgpu.copy_gmem_to_smem(q_hi_ref.at[l, b, j, hk], qd_s.at[0, 1], q_bar)

            def node_rows(i, jn, n_max=n_max, l=l):
                return node_first_row(sel_s, i * node_tiles + jn, layer=l, st=st, n_max=n_max, lcols=lcols)

            def produce(i, g, k_lo_ref=k_lo_ref, k_hi_ref=k_hi_ref, v_lo_ref=v_lo_ref, v_hi_ref=v_hi_ref,
                        node_rows=node_rows, top=top, start=start):
                slot = lax.rem(g, S)

                @pl.when(g >= S)
                def _():
                    plgpu.barrier_wait(consumed.at[slot])

                for jn in range(node_tiles):
                    first, rows_at = node_rows(i, jn), pl.ds(jn * r, r)
                    copy = 0 if top else jn  # the copy turned by `jn * r + c` (the top: by the node)
                    for src, dst in ((k_lo_ref.at[copy], k_lo_s), (k_hi_ref.at[copy], k_hi_s)):
                        plgpu.copy_gmem_to_smem(src.at[b, hk, pl.ds(first, r)], dst.at[slot, rows_at],
                                                landed.at[slot])
                    for src, dst in ((v_lo_ref, v_lo_s), (v_hi_ref, v_hi_s)):
                        plgpu.copy_gmem_to_smem(src.at[b, hk, pl.ds(first, r)], dst.at[slot, rows_at],
                                                landed.at[slot])
                plgpu.copy_gmem_to_smem(bcos_ref.at[pl.ds(i, 1)], bcos_s.at[slot], landed.at[slot])
                plgpu.copy_gmem_to_smem(bsin_ref.at[pl.ds(i, 1)], bsin_s.at[slot], landed.at[slot])
                pl.when(i > start)(lambda: finish(g - 1, top))  # the previous step, while these fly
                return g + 1

            g = lax.fori_loop(start, stop, produce, g)
            pl.when(stop > start)(lambda top=top, g=g: finish(g - 1, top))


_LOAD_TAKES_INDEX = tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11)


def _row(ref):
    """`ref`'s `[64]` float32 in WGMMA's row layout (jax 0.10's `load` takes an index
    apart from the reference; 0.11 deprecates that)."""
    if _LOAD_TAKES_INDEX:
        return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(1))
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(1))


def scratch_shapes(st: BlockStatic, pipe: BackwardPipeline, dtype, list_shape, word_shape, count_len: int):
    """The walk's shared memory, one `plgpu.SMEM` a buffer (`_walk_kernel` unpacks them in
    this order)."""
    S, C = pipe.stages, TILE
    t = _transforms(dtype)
    keys = lambda: plgpu.SMEM((S, C, HALF), dtype, transforms=t)
    return [
        plgpu.SMEM((2, 2, PROGRAM_ROWS, HALF), dtype, transforms=t),  # the layer's queries, the cotangents
        keys(), keys(), keys(), keys(),  # keys' and values' halves
        plgpu.SMEM((2, 2, ROWS, C), dtype, transforms=t),  # ds, p: each consumer's rows
        plgpu.SMEM((2, ROWS, HALF), jnp.float32),  # dq's staging, a consumer's
        plgpu.SMEM((2, C, HALF), dtype),  # a partial's staging, a consumer's
        plgpu.SMEM((S, 1, HALF), jnp.float32),  # a step's first position's cos
        plgpu.SMEM((S, 1, HALF), jnp.float32),  # sin
        plgpu.SMEM(list_shape, jnp.int32),  # every layer's list
        plgpu.SMEM(word_shape, jnp.int32),  # every refined bitmap
        plgpu.SMEM((count_len,), jnp.int32),  # n_P of each layer (then firsts, offset)
        plgpu.SMEM((PROGRAM_ROWS,), jnp.float32),  # lse
        plgpu.SMEM((PROGRAM_ROWS,), jnp.float32),  # delta
    ]


def walk_layers(layers, launch: BlockLaunch) -> list:
    """The tree's layers (`merge.layer_arrays`, bottom first) as `launch`'s walk lands them: each
    layer's keys' halves in `TILE / r` copies turned by their offset in a step (the top
    layer in one, turned by its node: `mosaic_merge.turned_keys`), then its values'
    halves: `[k_lo, k_hi, v_lo, v_hi]` a layer."""
    st = launch.st
    cos32, sin32 = rope_tables(launch.config, launch.head_dim, _table_rows(launch.table_rows), st)
    keys = turned_keys(split_layers(layers, st), cos32, sin32, st, TILE, absolute_top=True)
    out = []
    for k_lo, k_hi, v in zip(keys[0::3], keys[1::3], keys[2::3]):
        out += [k_lo, k_hi, v[..., :HALF], v[..., HALF:]]
    return out


def walked_ranges(counts, st: BlockStatic, num_programs: int, packed: bool, shard: bool):
    """Each program's walked `[start, stop)` buffer positions a layer, as `partials.py`
    reads them: `[B, H_kv, NP, range_lanes(L)]` int32 from the kernel's counts `[B, NB,
    H_kv, Lp]` (`layer_bounds`, the walk's own arithmetic, on every program at once)."""
    L = st.num_layers
    per_block = st.r // st.queries
    c = jnp.moveaxis(counts[:, jnp.arange(num_programs) // per_block], -1, 0)  # [Lp, B, NP, H_kv]
    t_first = (jnp.arange(num_programs, dtype=jnp.int32) * st.queries)[None, :, None]
    t0 = t_first - t_first % st.r
    out = []
    for l in range(L):
        _, _, start, stop = layer_bounds(c, l, st=st, tile=TILE, t_first=t_first, t0=t0, packed=packed, shard=shard)
        out += [jnp.broadcast_to(start * TILE, c.shape[1:]), jnp.broadcast_to(stop * TILE, c.shape[1:])]
    lanes = next_power_of_two(2 * L, 2)
    ranges = jnp.stack(out + [jnp.zeros(c.shape[1:], jnp.int32)] * (lanes - 2 * L), axis=-1)  # [B, NP, H_kv, lanes]
    return jnp.swapaxes(ranges, 1, 2).astype(jnp.int32)


def halves(x, axis: int):
    """`[..., 2 * HALF, ...]` -> `[..., 2, ..., HALF]`: the last axis's halves stacked at `axis`."""
    return jnp.moveaxis(x.reshape(x.shape[:-1] + (2, HALF)), -2, axis)


@functools.partial(jax.jit, static_argnames=("launch", "sums", "pipe"))
def block_backward_mosaic(rows, layers, selections, launch: BlockLaunch, sums: str = "partials", firsts=None,
                          offset=None, pipe: BackwardPipeline | None = None, prepared=None):
    """`backward.block_backward_launch` with `sums="partials"` (same arguments and
    results: `(dq5 [B, Tp, H_kv, Gp, 2 * half]` float32, `[pk_l, pv_l]` each `[B, H_kv,
    NP * widths[l], D]` in the inputs' dtype, `ranges [B, H_kv, NP, lanes]` int32)`) on
    the Mosaic GPU walk above; `st.tile` must be `TILE` (the slabs' positions a step)
    and the `dk` partials are the gradients of the keys turned by their buffer
    positions (`sum_partials(..., tables=)`). `prepared`: `walk_layers(layers, ...)`, made
    once for the calls of a backward's chunks (else here, from `layers`: several GB of
    copies at 512K that a chunk's call would repeat). No interpret mode (refused); a layout
    whose buffers pass a block's shared memory is refused (ValueError) before it is
    built."""
    if launch.interpret:
        raise ValueError("BlockKernels(walk='mosaic_gpu') has no interpret mode; interpreted runs take "
                         "'pallas_triton'")
    q5, do5, lse, delta = rows
    config, st, head_dim, widths = launch.config, launch.st, launch.head_dim, launch.widths
    if sums != "partials" or st.tile != TILE:
        raise ValueError(f"BlockKernels(walk='mosaic_gpu') writes partial sums {TILE} candidates a step (got "
                         f"sums={sums!r}, tile {st.tile})")
    pipe = pipe or BACKWARD_PIPELINE
    B, Tp, H_kv, gp, kp = q5.shape
    dtype, C, L = q5.dtype, TILE, st.num_layers
    check_mosaic_backward_dims(st, head_dim, st.vp, dtype, launch.table_rows, pipe)
    packed, shard = firsts is not None, offset is not None
    table_rows = _table_rows(launch.table_rows)
    nj, nb = Tp // st.queries, Tp // st.r
    words = table_rows // WORD
    list_boxes, word_boxes = tma_boxes(next_power_of_two(st.top_k, 4)), tma_boxes(words)
    scratch = launch_scratch(st, pipe, dtype, table_rows, packed, shard)
    cos32, sin32 = rope_tables(config, head_dim, table_rows, st)
    T0 = jnp.arange(nb, dtype=jnp.int32) * st.r
    if shard:
        T0 = T0 + offset
    counts = layer_parent_counts(selections, st, T0, (B, nb, H_kv))
    if packed:
        counts = with_firsts(counts, firsts, L)
    if shard:
        counts = with_offset(counts, offset, L)
    if selections:
        sel = jnp.stack([s[..., : st.top_k] for s in selections])
        bits = refined_bitmaps(selections, st, words, firsts)
    else:  # a one-layer tree: nothing refined, no list read
        if packed:
            raise ValueError("BlockKernels(walk='mosaic_gpu'): packed rows of a one-layer tree have no top layer to mark")
        sel = jnp.zeros((1, B, nb, H_kv, st.top_k), jnp.int32)
        bits = jnp.zeros((1, B, nb, H_kv, words), jnp.int32)
    sel, bits = per_program_lists(sel, list_boxes), per_program_lists(bits, word_boxes)
    q_lo, q_hi = rotated_queries(q5, counts, cos32, sin32, st, PROGRAM_ROWS, dtype, offset)
    do2 = halves(program_layout(do5, st, PROGRAM_ROWS), 3)  # [B, NJ, H_kv, 2, rows, HALF]
    lse_p, delta_p = (program_layout(x, st, PROGRAM_ROWS) for x in (lse, delta))
    inputs = walk_layers(layers, launch) if prepared is None else prepared
    node_tiles = C // st.r
    bars = [plgpu.Barrier(num_arrivals=7),  # setup: counts, lists, bitmaps, cotangents' halves, lse, delta
            plgpu.Barrier(num_arrivals=2),  # a layer's queries' halves
            plgpu.Barrier(num_arrivals=2),  # layer done: both consumers past the layer's last step
            plgpu.Barrier(num_arrivals=4 * node_tiles + 2, num_barriers=pipe.stages),  # a step landed
            plgpu.Barrier(num_arrivals=1, num_barriers=pipe.stages),  # a step's keys turned
            plgpu.Barrier(num_arrivals=2, num_barriers=pipe.stages),  # a step's keys and values read
            plgpu.Barrier(num_arrivals=2),  # ds, p written
            plgpu.Barrier(num_arrivals=2)]  # ds, p read
    kernel_fn = functools.partial(_walk_kernel, st=st, widths=widths, words=word_boxes, lists=list_boxes,
                                  dtype=dtype, pipe=pipe, packed=packed, shard=shard)

    def entry(*refs):
        pl.run_scoped(lambda scratch_refs, bar_refs: kernel_fn(*refs, scratch_refs, bar_refs), scratch, bars,
                      collective_axes="wg")

    out_type = [jax.ShapeDtypeStruct((L, B, nj, H_kv, 2, PROGRAM_ROWS, HALF), jnp.float32)]
    for W in widths:
        out_type += [jax.ShapeDtypeStruct((B, H_kv, nj * W, 2 * HALF), dtype)] * 2
    kernel = plgpu.kernel(entry, out_type=out_type, grid=(H_kv, nj, B), grid_names=("h", "j", "b"), num_threads=3,
                          thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=True))
    dq, *slabs = kernel(q_lo, q_hi, do2, lse_p, delta_p, cos32[::C], sin32[::C], sel, counts, bits, *inputs)
    # Each layer's `dq` turned back from its rows' angle (`rotated_queries`' transpose), then summed.
    dq = from_program_layout(jnp.concatenate([dq[:, :, :, :, 0], dq[:, :, :, :, 1]], -1), st, gp, lead=1)
    angle = row_angles(counts, Tp, st, offset)[..., None]  # [L, B, Tp, H_kv, 1]
    lo, hi = rotate_back(dq[..., :HALF], dq[..., HALF:], cos32[angle], sin32[angle])
    dq5 = jnp.concatenate([jnp.sum(lo, 0), jnp.sum(hi, 0)], -1)
    return dq5, slabs, walked_ranges(counts, st, nj, packed, shard)


__all__ = ["BACKWARD_PIPELINE", "TILE", "BackwardPipeline", "block_backward_mosaic", "check_mosaic_backward_dims",
           "walk_layers"]
