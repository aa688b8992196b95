"""Probe (issue 83): the block backward block-major on Mosaic GPU at layer 0's shape, the
key and value gradients written as partial sums instead of added by atomics.

`block_backward_ladder.py` measured layer 0's `dk`, `dv` summed by node tile: bound by
landing each block's 128 rows once for every 16 keys. Here the rows stay and the keys
travel, as in the forward: a program per (block, kv head) holds its 128 rows (16
queries x 8 heads: `q` already rotated, `do`, `lse`, `delta`) in shared memory and walks
its list of layer-0 node tiles, `C = 64` keys (four tiles of 16) a step landed by TMA
into a ring. Two consumer warpgroups of 64 rows compute, a step:

    s = q k^T, dp = do v^T          [64 rows, C]    (the keys as WGMMA's N)
    p = exp(s - lse), ds = p (dp - delta)
    dq += ds k                      [64 rows, 128]  (carried over the walk)
    dk^T = q_w^T ds, dv^T = do_w^T p  [64, C]       (warpgroup w: head-dim half w, all 128 rows)

Five products of `2 * 128 * C * 128` FLOPs a step. `dk^T`, `dv^T` need both warpgroups'
`p`, `ds` (through shared memory, one barrier of the pair a step); each step's two
`[64, C]` partials a warpgroup go to HBM by TMA: what a fixed-order sum by node (the
inverted index's order) would read back, instead of adding them with atomics. Partials in
float32 or bfloat16 (`--partials`; `none` leaves the stores out: the walk alone), with
`--slots` blocks' worth of buffer (block `j` writes slot `j % slots`, so the write
traffic is the full shape's while the memory is not). No RoPE and no mask (step 2 of
the ladder, as `block_backward_ladder.py`).

    python tools/probes/block_backward_blocks.py            # on a Hopper GPU
    python tools/probes/block_backward_blocks.py --check    # small, against a jnp twin
    python tools/probes/block_backward_blocks.py --lower    # lower for CUDA only (CPU)
"""

from __future__ import annotations

import argparse
import functools
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from htree_jax.bench import median_ms

ROWS = 64  # rows a consumer warpgroup takes (WGMMA's M)
R = 16  # keys a node tile
C = 64  # keys a step: four node tiles
TILES = C // R
LOG2E = math.log2(math.e)
LOAD_TAKES_INDEX = tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11)
SWIZZLE = 128  # every bf16 operand is 64 elements (128 bytes) wide


def _transforms(dtype):
    elems = SWIZZLE // jnp.dtype(dtype).itemsize
    return plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(SWIZZLE)


def _row(ref):
    """`ref`'s `[64]` float32 in WGMMA's row layout (jax 0.10's `load` takes an index
    apart from the reference; 0.11 deprecates that)."""
    if LOAD_TAKES_INDEX:
        return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(1))
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(1))


def block_grads(qd, lse, delta, k_lo, k_hi, v_lo, v_hi, lists, *, stages: int = 2, partials: str = "f32",
                slots: int = 0, alpha: float = 1.0):
    """Each block's `dq` and its partial `dk`, `dv` a step.

    qd `[H_kv, NB, 2, 2, 128, 64]` (`q` then `do`; the rows' halves of the head dim), lse,
    delta `[H_kv, NB, 128]` float32 (`lse` natural log), k_lo, k_hi, v_lo, v_hi `[H_kv, N,
    64]` (the layer's nodes, `N / 16` tiles), lists `[H_kv, NB, E]` int32 (the tiles a
    block merges; `E` a multiple of 4, `E / 4 >= stages`). Returns `dq [H_kv, NB, 2, 128,
    64]` float32 and, with `partials` `"f32"` or `"bf16"`, `part [H_kv, slots, E / 4, 2,
    2, C, 64]` (block `j` at slot `j % slots`; axis 3 `dk`, `dv`, axis 4 the head-dim half;
    step `e`'s keys `C` rows: tile `lists[..., 4 e + t]` at rows `16 t ..`)."""
    H_kv, NB, _, _, rows2, h = qd.shape
    E = lists.shape[2]
    steps = E // TILES
    dtype = qd.dtype
    store = partials != "none"
    part_dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16, "none": jnp.float32}[partials]
    slots = slots or NB
    pieces = -(-E // 256)
    assert rows2 == 2 * ROWS and h == 64 and E % TILES == 0 and steps >= stages and E % pieces == 0

    def kernel(qd_ref, lse_ref, delta_ref, klo_ref, khi_ref, vlo_ref, vhi_ref, list_ref, *outs_and_scratch):
        if store:
            dq_ref, part_ref, scratch, bars = outs_and_scratch
        else:
            dq_ref, scratch, bars = outs_and_scratch
        (qd_s, lse_s, delta_s, klo_s, khi_s, vlo_s, vhi_s, pd_s, out_s, list_s, *part_s) = scratch
        stage = part_s[0] if part_s else out_s  # where a step's partials wait for their store
        rows_bar, list_bar, landed, consumed, pd_ready, pd_read = bars
        j, hk = lax.axis_index("j"), lax.axis_index("h")
        wg = lax.axis_index("wg")
        mine = pl.ds(wg * ROWS, ROWS)

        @pl.when(wg < 2)
        def _consumer():
            plgpu.set_max_registers(232, action="increase")
            plgpu.barrier_wait(rows_bar.at[0])
            lse_row, delta_row = _row(lse_s.at[mine]), _row(delta_s.at[mine])
            zero = plgpu.layout_cast(jnp.zeros((ROWS, h), jnp.float32), plgpu.Layout.WGMMA)
            zc = plgpu.layout_cast(jnp.zeros((ROWS, C), jnp.float32), plgpu.Layout.WGMMA)

            def step(e, carry):
                slot = lax.rem(e, stages)
                plgpu.barrier_wait(landed.at[slot])

                def scores(refs):
                    s_ref, dp_ref = refs
                    plgpu.wgmma(s_ref, qd_s.at[0, 0, mine], klo_s.at[slot].transpose((1, 0)))
                    plgpu.wgmma(s_ref, qd_s.at[0, 1, mine], khi_s.at[slot].transpose((1, 0)))
                    plgpu.wgmma(dp_ref, qd_s.at[1, 0, mine], vlo_s.at[slot].transpose((1, 0)))
                    plgpu.wgmma(dp_ref, qd_s.at[1, 1, mine], vhi_s.at[slot].transpose((1, 0)))

                s, dp = pl.run_state(scores)((plgpu.ACC.init(zc), plgpu.ACC.init(zc)))
                p = jnp.exp2((s * alpha - lax.broadcast_in_dim(lse_row, s.shape, [0])) * LOG2E)
                ds = p * (dp - lax.broadcast_in_dim(delta_row, s.shape, [0])) * alpha
                p16, ds16 = p.astype(dtype), ds.astype(dtype)

                def rows_grad(refs):
                    lo_ref, hi_ref = refs
                    plgpu.wgmma(lo_ref, ds16, klo_s.at[slot])
                    plgpu.wgmma(hi_ref, ds16, khi_s.at[slot])

                carry = pl.run_state(rows_grad)(tuple(plgpu.ACC.init(x) for x in carry))
                plgpu.barrier_arrive(consumed.at[slot])  # the keys are read: the ring slot is free

                @pl.when(e > 0)
                def _():  # both warpgroups' previous products have read `pd_s`
                    plgpu.barrier_wait(pd_read.at[0])

                pd_s.at[0, wg][...] = ds16
                pd_s.at[1, wg][...] = p16
                plgpu.commit_smem()
                plgpu.barrier_arrive(pd_ready.at[0])
                plgpu.barrier_wait(pd_ready.at[0])

                def key_grads(refs):  # warpgroup 0: dk = ds^T q; 1: dv = p^T do; K: both warpgroups' rows
                    lo_acc, hi_acc = refs
                    for half in range(2):
                        rows = pl.ds(half * ROWS, ROWS)
                        weights = pd_s.at[wg, half].transpose((1, 0))  # [C, 64 rows]
                        plgpu.wgmma(lo_acc, weights, qd_s.at[wg, 0, rows])
                        plgpu.wgmma(hi_acc, weights, qd_s.at[wg, 1, rows])

                g_lo, g_hi = pl.run_state(key_grads)((plgpu.ACC.init(zc), plgpu.ACC.init(zc)))
                plgpu.barrier_arrive(pd_read.at[0])
                if store:
                    for half, x in enumerate((g_lo, g_hi)):
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the staging buffer is free
                        stage.at[wg][...] = x.astype(part_dtype)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(stage.at[wg], part_ref.at[hk, lax.rem(j, slots), e, wg, half])
                return carry

            dq_lo, dq_hi = lax.fori_loop(0, steps, step, (zero, zero))
            for half, x in enumerate((dq_lo, dq_hi)):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                out_s.at[wg][...] = x
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_s.at[wg], dq_ref.at[hk, j, half, mine])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            for a in range(2):  # one copy a `[128, 64]` (TMA strides at most 5 dimensions)
                for half in range(2):
                    plgpu.copy_gmem_to_smem(qd_ref.at[hk, j, a, half], qd_s.at[a, half], rows_bar.at[0])
            for src, dst in ((lse_ref, lse_s), (delta_ref, delta_s)):
                plgpu.copy_gmem_to_smem(src.at[hk, j], dst, rows_bar.at[0])
            size = E // pieces
            for c in range(pieces):
                plgpu.copy_gmem_to_smem(list_ref.at[hk, j, pl.ds(c * size, size)], list_s.at[pl.ds(c * size, size)],
                                        list_bar.at[0])
            plgpu.barrier_wait(list_bar.at[0])

            def issue(e, slot):
                for t in range(TILES):
                    u = list_s[e * TILES + t]
                    for src, dst in ((klo_ref, klo_s), (khi_ref, khi_s), (vlo_ref, vlo_s), (vhi_ref, vhi_s)):
                        plgpu.copy_gmem_to_smem(src.at[hk, pl.ds(u * R, R)], dst.at[slot, pl.ds(t * R, R)],
                                                landed.at[slot])

            for e in range(stages):
                issue(e, e)

            @pl.loop(0, steps - stages)
            def _(e):
                slot = lax.rem(e, stages)
                plgpu.barrier_wait(consumed.at[slot])
                issue(e + stages, slot)

    t = _transforms(dtype)
    keys = lambda: plgpu.SMEM((stages, C, h), dtype, transforms=t)
    # The f32 staging buffer takes `dq` at the end; bf16 partials stage in a buffer of their own.
    smem = [plgpu.SMEM((2, 2, rows2, h), dtype, transforms=t),
            plgpu.SMEM((rows2,), jnp.float32), plgpu.SMEM((rows2,), jnp.float32),
            keys(), keys(), keys(), keys(),
            plgpu.SMEM((2, 2, ROWS, C), dtype, transforms=t),  # ds, p: each warpgroup's rows
            plgpu.SMEM((2, ROWS, C), jnp.float32),
            plgpu.SMEM((E,), jnp.int32)]
    if part_dtype != jnp.float32:
        smem.append(plgpu.SMEM((2, C, h), part_dtype))
    bars = (plgpu.Barrier(num_arrivals=6, num_barriers=1),
            plgpu.Barrier(num_arrivals=pieces, num_barriers=1),
            plgpu.Barrier(num_arrivals=4 * TILES, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=1),
            plgpu.Barrier(num_arrivals=2, num_barriers=1))
    n_out = 2 if store else 1

    def entry_fn(*refs):
        ins, outs = refs[:-n_out], refs[-n_out:]
        pl.run_scoped(lambda scratch, barriers: kernel(*ins, *outs, scratch, barriers), smem, bars,
                      collective_axes="wg")

    out_types = [jax.ShapeDtypeStruct((H_kv, NB, 2, rows2, h), jnp.float32)]
    if store:
        out_types.append(jax.ShapeDtypeStruct((H_kv, slots, steps, 2, 2, C, h), part_dtype))
    return plgpu.kernel(entry_fn, out_type=tuple(out_types), grid=(NB, H_kv), grid_names=("j", "h"), num_threads=3,
                        thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=True))(
        qd, lse, delta, k_lo, k_hi, v_lo, v_hi, lists)


def sum_by_node(part, codes, counts, cos_t, sin_t, *, stages: int = 6):
    """The partials summed by node tile in a fixed order, `dk` rotated back: `[H_kv, U,
    2, 2, 16, 64]` float32 (axis 2 `dk`, `dv`; axis 3 the head-dim half).

    part as `block_grads` returns it; codes `[H_kv, U, L]` int32, tile `u`'s entries in
    block order, each `(j % slots) * E + s` for block `j`, holding `u` at slot `s` of its
    list (step `s // 4`, rows `16 (s % 4) ..` of it); counts `[H_kv, U, 4]` int32
    (`[..., 0]` the entries of each tile); cos_t, sin_t `[4, 16, 64]` float32 (a tile's
    angles by its place in a step: RoPE is relative, so a key's angle in the merge is
    its offset in the step against the rows turned to the step's start). One program
    per (tile, kv head): a memory warpgroup lands each entry's `[2, 2, 16, 64]` by TMA
    into a ring; one warpgroup adds them in float32."""
    H_kv, _, steps, _, _, _, h = part.shape
    U, L = codes.shape[1], codes.shape[2]
    E = steps * TILES
    pieces = -(-L // 256)
    assert L % pieces == 0 and (pieces == 1 or L % 256 == 0)  # shared-memory copies start at 128-byte boundaries

    def kernel(part_ref, code_ref, count_ref, cos_ref, sin_ref, out_ref, scratch, bars):
        ring, code_s, count_s, cos_s, sin_s, out_s = scratch
        setup, landed, consumed = bars
        u, hk = lax.axis_index("u"), lax.axis_index("h")
        wg = lax.axis_index("wg")

        @pl.when(wg == 0)
        def _consumer():
            plgpu.barrier_wait(setup.at[0])
            n = count_s[0]
            zero = jnp.zeros((R, h), jnp.float32)

            def entry(e, acc):
                slot = lax.rem(e, stages)
                plgpu.barrier_wait(landed.at[slot])
                off = lax.rem(code_s[e], TILES)
                x = [ring.at[slot, g, half][...].astype(jnp.float32) for g in range(2) for half in range(2)]
                c, sn = cos_s.at[off][...], sin_s.at[off][...]
                dk_lo, dk_hi, dv_lo, dv_hi = acc
                acc = (dk_lo + x[0] * c + x[1] * sn, dk_hi + x[1] * c - x[0] * sn, dv_lo + x[2], dv_hi + x[3])
                plgpu.barrier_arrive(consumed.at[slot])
                return acc

            acc = lax.fori_loop(0, n, entry, (zero, zero, zero, zero))
            for i, x in enumerate(acc):
                out_s.at[i // 2, i % 2][...] = x
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_s, out_ref.at[hk, u])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 1)
        def _memory():
            size = L // pieces
            for c in range(pieces):
                plgpu.copy_gmem_to_smem(code_ref.at[hk, u, pl.ds(c * size, size)], code_s.at[pl.ds(c * size, size)],
                                        setup.at[0])
            for src, dst in ((count_ref.at[hk, u], count_s), (cos_ref, cos_s), (sin_ref, sin_s)):
                plgpu.copy_gmem_to_smem(src, dst, setup.at[0])
            plgpu.barrier_wait(setup.at[0])
            n = count_s[0]

            @pl.loop(0, n)
            def _(e):
                slot = lax.rem(e, stages)

                @pl.when(e >= stages)
                def _():
                    plgpu.barrier_wait(consumed.at[slot])

                code = code_s[e]
                block, s = lax.div(code, E), lax.rem(code, E)
                plgpu.copy_gmem_to_smem(part_ref.at[hk, block, lax.div(s, TILES), :, :, pl.ds(lax.rem(s, TILES) * R, R)],
                                        ring.at[slot], landed.at[slot])

    smem = [plgpu.SMEM((stages, 2, 2, R, h), part.dtype), plgpu.SMEM((L,), jnp.int32), plgpu.SMEM((4,), jnp.int32),
            plgpu.SMEM((TILES, R, h), jnp.float32), plgpu.SMEM((TILES, R, h), jnp.float32),
            plgpu.SMEM((2, 2, R, h), jnp.float32)]
    bars = (plgpu.Barrier(num_arrivals=pieces + 3, num_barriers=1),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages))

    def entry_fn(*refs):
        pl.run_scoped(lambda scratch, barriers: kernel(*refs, scratch, barriers), smem, bars, collective_axes="wg")

    return plgpu.kernel(entry_fn, out_type=jax.ShapeDtypeStruct((H_kv, U, 2, 2, R, h), jnp.float32), grid=(U, H_kv),
                        grid_names=("u", "h"), num_threads=2, thread_name="wg")(part, codes, counts, cos_t, sin_t)


def inverted(lists, slots: int, pad_to: int = 8):
    """`(codes [H_kv, U, L], counts [H_kv, U, 4])` of `sum_by_node` from the blocks'
    `lists [H_kv, NB, E]` (NumPy): each tile's entries in block order (a stable sort by
    tile of the block-major entries)."""
    lists = np.asarray(lists)
    H_kv, NB, E = lists.shape
    U = int(lists.max()) + 1
    code = ((np.arange(NB)[:, None] % slots) * E + np.arange(E)[None, :]).ravel()
    per_head = []
    for hk in range(H_kv):
        order = np.argsort(lists[hk].ravel(), kind="stable")
        tiles = lists[hk].ravel()[order]
        counts = np.bincount(tiles, minlength=U)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        per_head.append((tiles, np.arange(tiles.size) - starts[tiles], code[order], counts))
    L = max(int(c.max()) for *_, c in per_head)
    pad_to = 256 if L > 256 else pad_to  # TMA lands the codes in pieces of 256 at 1 KB boundaries
    L = -(-L // pad_to) * pad_to
    codes = np.zeros((H_kv, U, L), np.int32)
    counts = np.zeros((H_kv, U, 4), np.int32)
    for hk, (tiles, rank, c, n) in enumerate(per_head):
        codes[hk, tiles, rank] = c
        counts[hk, :, 0] = n
    return jnp.asarray(codes), jnp.asarray(counts)


def angle_tables(K: int = 128, base: float = 10000.0):
    """`(cos, sin) [4, 16, 64]` float32: RoPE's angles of positions `0 .. 63`, a tile's
    rows by its place in a step."""
    freq = base ** (-np.arange(K // 2) * 2.0 / K)
    angle = np.arange(C)[:, None] * freq[None, :]
    return (jnp.asarray(np.cos(angle).reshape(TILES, R, K // 2), jnp.float32),
            jnp.asarray(np.sin(angle).reshape(TILES, R, K // 2), jnp.float32))


def sum_twin(part, codes, counts, cos_t, sin_t):
    """`sum_by_node` in NumPy (float64)."""
    part, codes, counts = (np.asarray(x, np.float64) for x in (part, codes, counts))
    cos_t, sin_t = np.asarray(cos_t, np.float64), np.asarray(sin_t, np.float64)
    H_kv, _, steps = part.shape[:3]
    E = steps * TILES
    U = codes.shape[1]
    out = np.zeros((H_kv, U, 2, 2, R, part.shape[-1]))
    for hk in range(H_kv):
        for u in range(U):
            for code in codes[hk, u, :int(counts[hk, u, 0])].astype(np.int64):
                block, s = divmod(code, E)
                x = part[hk, block, s // TILES, :, :, (s % TILES) * R:(s % TILES + 1) * R]
                c, sn = cos_t[s % TILES], sin_t[s % TILES]
                out[hk, u, 0, 0] += x[0, 0] * c + x[0, 1] * sn
                out[hk, u, 0, 1] += x[0, 1] * c - x[0, 0] * sn
                out[hk, u, 1] += x[1]
    return out


def twin(qd, lse, delta, k_lo, k_hi, v_lo, v_hi, lists, alpha: float = 1.0):
    """`block_grads` in jnp (float32): `(dq [H_kv, NB, 128, 128], dk, dv [H_kv, NB, E / 4,
    C, 128])`, each step's partials as `[keys, head dim]`."""
    f = lambda x: x.astype(jnp.float32)
    H_kv, NB = qd.shape[:2]
    whole = lambda x: jnp.concatenate([f(x[:, :, 0]), f(x[:, :, 1])], -1)  # [H_kv, NB, 128, K]
    qf, dof = whole(qd[:, :, 0]), whole(qd[:, :, 1])
    k, v = jnp.concatenate([f(k_lo), f(k_hi)], -1), jnp.concatenate([f(v_lo), f(v_hi)], -1)
    nodes = (lists[..., None] * R + jnp.arange(R)).reshape(H_kv, NB, -1, C)  # [H_kv, NB, steps, C]
    hi = jnp.arange(H_kv)[:, None, None, None]
    kj, vj = k[hi, nodes], v[hi, nodes]  # [H_kv, NB, steps, C, K]
    s = alpha * jnp.einsum("hjrk,hjeck->hjerc", qf, kj)
    p = jnp.exp(s - lse[:, :, None, :, None])
    dp = jnp.einsum("hjrv,hjecv->hjerc", dof, vj)
    ds = p * (dp - delta[:, :, None, :, None]) * alpha
    dq = jnp.einsum("hjerc,hjeck->hjrk", ds, kj)
    return dq, jnp.einsum("hjerc,hjrk->hjeck", ds, qf), jnp.einsum("hjerc,hjrv->hjecv", p, dof)


def from_kernel(dq, part=None):
    """The kernel's outputs in the twin's layout."""
    dq = jnp.concatenate([dq[:, :, 0], dq[:, :, 1]], -1)
    if part is None:
        return (dq,)
    part = part.astype(jnp.float32)
    g = lambda i: jnp.concatenate([part[:, :, :, i, 0], part[:, :, :, i, 1]], -1)
    return dq, g(0), g(1)


def inputs(rng, H_kv, NB, U, E, dtype, K=128):
    """Random inputs: each block's list `E` sorted distinct tiles of `U`."""
    h = K // 2
    n = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
    qd = jnp.stack([n(H_kv, NB, 2, 2 * ROWS, h) * (K ** -0.25), n(H_kv, NB, 2, 2 * ROWS, h)], 2)
    k = [n(H_kv, U * R, h) * (K ** -0.25) for _ in range(2)]
    v = [n(H_kv, U * R, h) for _ in range(2)]
    lse = jnp.asarray(rng.standard_normal((H_kv, NB, 2 * ROWS)) + 3.0, jnp.float32)
    delta = jnp.asarray(rng.standard_normal((H_kv, NB, 2 * ROWS)) * 0.1, jnp.float32)
    lists = np.sort(np.stack([[rng.choice(U, size=E, replace=False) for _ in range(NB)] for _ in range(H_kv)]), -1)
    return (qd, lse, delta, *k, *v, jnp.asarray(lists, jnp.int32))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="small shapes against the jnp twin")
    p.add_argument("--lower", action="store_true", help="lower for CUDA only (a CPU machine)")
    p.add_argument("--blocks", type=int, default=8192, help="blocks (T / 16)")
    p.add_argument("--tiles", type=int, default=8192, help="layer-0 node tiles a kv head (T / 16)")
    p.add_argument("--entries", type=int, default=512, help="tiles a block merges (top_k at 128K)")
    p.add_argument("--partials", default="none,bf16,f32")
    p.add_argument("--slots", type=int, default=256, help="blocks' worth of partial buffer")
    p.add_argument("--reduce-stages", default="6")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    dtype = jnp.bfloat16
    kinds = args.partials.split(",")
    reduce_stages = [int(x) for x in args.reduce_stages.split(",")]
    cos_t, sin_t = angle_tables()
    if args.lower:
        ins = inputs(rng, 1, 4, 8, 8, dtype)
        for kind in kinds:
            f = jax.jit(functools.partial(block_grads, partials=kind))
            f.trace(*ins).lower(lowering_platforms=("cuda",))
            print(f"lowered partials={kind}", flush=True)
            if kind != "none":
                part = jax.eval_shape(f, *ins)[1]
                codes, counts = inverted(ins[-1], 4)
                for stages in reduce_stages:
                    g = jax.jit(functools.partial(sum_by_node, stages=stages))
                    g.trace(jnp.zeros(part.shape, part.dtype), codes, counts, cos_t, sin_t).lower(
                        lowering_platforms=("cuda",))
                    print(f"lowered sum_by_node partials={kind} stages={stages}", flush=True)
        return 0
    if args.check:
        for H_kv, NB, U, E in ((1, 4, 8, 8), (2, 6, 16, 12), (1, 300, 16, 16)):  # the last: codes in two pieces
            ins = inputs(rng, H_kv, NB, U, E, dtype)
            want = twin(*ins)
            codes, counts = inverted(ins[-1], NB)
            for kind in kinds:
                outs = block_grads(*ins, partials=kind)
                for name, g, w in zip(("dq", "dk", "dv"), from_kernel(*outs), want):
                    err = float(jnp.max(jnp.abs(g - w)) / (jnp.max(jnp.abs(w)) + 1e-9))
                    print(f"CHECK H_kv={H_kv} NB={NB} U={U} E={E} partials={kind} {name}: max rel error {err:.2e}",
                          flush=True)
                if kind == "none":
                    continue
                for stages in reduce_stages:
                    got = np.asarray(sum_by_node(outs[1], codes, counts, cos_t, sin_t, stages=stages))
                    ref = sum_twin(outs[1], codes, counts, cos_t, sin_t)
                    err = float(np.max(np.abs(got - ref)) / (np.max(np.abs(ref)) + 1e-9))
                    print(f"CHECK sum_by_node H_kv={H_kv} partials={kind} stages={stages}: max rel error {err:.2e}",
                          flush=True)
        return 0
    H_kv, NB, U, E = 4, args.blocks, args.tiles, args.entries
    flops = H_kv * NB * E * R * 5 * 2 * (2 * ROWS) * 128
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: H_kv={H_kv} blocks={NB} tiles={U} entries={E}: "
          f"{flops / 1e12:.1f} TFLOP", flush=True)
    ins = inputs(rng, H_kv, NB, U, E, dtype)
    codes, counts = inverted(ins[-1], args.slots)
    for kind in kinds:
        size = 0 if kind == "none" else (4 if kind == "f32" else 2)
        written = H_kv * NB * E * R * 2 * 128 * size
        f = jax.jit(functools.partial(block_grads, partials=kind, slots=args.slots))
        try:
            ms = median_ms(f, ins, 5)
            print(f"TIME blocks partials={kind}: {ms:.1f} ms, {flops / ms / 1e9:.0f} TFLOP/s, "
                  f"{written / 1e12:.2f} TB of partials written at {written / ms / 1e9:.2f} TB/s", flush=True)
        except Exception as e:  # noqa: BLE001 - a launch that does not compile is a row too
            print(f"TIME blocks partials={kind}: {type(e).__name__}: {str(e)[:600]}", flush=True)
            continue
        if kind == "none":
            continue
        part = f(*ins)[1]
        for stages in reduce_stages:
            g = jax.jit(functools.partial(sum_by_node, stages=stages))
            try:
                ms = median_ms(g, (part, codes, counts, cos_t, sin_t), 5)
                print(f"TIME sum_by_node partials={kind} stages={stages}: {ms:.1f} ms, partials read at "
                      f"{written / ms / 1e9:.2f} TB/s", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"TIME sum_by_node partials={kind} stages={stages}: {type(e).__name__}: {str(e)[:600]}",
                      flush=True)
        del part
    return 0


if __name__ == "__main__":
    sys.exit(main())
