"""Probe (issue 82): how fast can the block merge's shape run on Mosaic GPU, grown one
feature at a time from JAX's own flash attention (`attention_mgpu`) toward the merge.

Every step runs the benchmark shape's programs: a program per (block of 16 queries, kv
head) holds 128 rows (16 queries x 8 heads, two consumer warpgroups of 64), a memory
warpgroup feeds a two-stage shared-memory ring by TMA, and the rows fold `candidates`
keys and values into one online softmax:
  1. `attention_mgpu.attention`, dense causal at T (the ceiling on this road);
  2. `gathered`: the keys and values read by index, node tiles of `r` contiguous rows
     (`tile / r` of them a step, each its own TMA copy at a row read from the program's
     node list in shared memory), no RoPE, no mask;
  3. `rotated`: as 2, each key tile rotated by its buffer position (RoPE at candidate
     positions, SPEC 2.2): each consumer warpgroup rotates the tile's keys in registers
     into a buffer of its own, then scores them; the queries come rotated (XLA);
  3b. as 3, the memory warpgroup rotating each tile once, in place, once it has landed
     (`rotator="memory"`; this probe's build hung, journal 2026-12-01 (2); the merge's
     own memory-warpgroup rotation runs, `block/mosaic_merge.py`).
Step 4 (the merged mask and the layers' lists) is the merge itself, timed by layout with
`tools/probes/block_merge_pipelines.py` and beside the other routes by
`benchmarks/bench_block_routes.py`.

FLOPs counted as the merge counts them (`merge_flops`): `2 * (K + V)` a candidate a row.

    python tools/probes/block_merge_ladder.py                 # on a Hopper GPU
    python tools/probes/block_merge_ladder.py --check         # small, against a jnp twin
    python tools/probes/block_merge_ladder.py --check --interpret   # the same on a CPU (jax >= 0.12)
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

ROWS = 64  # rows a consumer warpgroup holds (WGMMA's M)
LOG2E = math.log2(math.e)


def _transforms(minor: int, dtype):
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor * bits)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


def merge_tiles(q, k, v, nodes, cos=None, sin=None, *, r: int = 16, tile: int = 128, stages: int = 2,
                rotator: str = "consumers", interpret=None):
    """Each program's 128 rows fold every candidate of its node list into one softmax.

    Step 2 (`cos=None`): q `[B, NB, H_kv, 2 * ROWS, K]`, k `[B, H_kv, N, K]`. Step 3: q and
    k as their rotate-half halves `(lo, hi)` (q already rotated, by XLA), each key tile
    rotated here by its buffer position with `cos, sin [n_tiles * r, K / 2]` (in the
    inputs' dtype: the rotated keys are rounded to it anyway). v `[B, H_kv, N, V]`, nodes
    `[B, NB, H_kv, n_tiles]` int32: node tiles of `r` rows, `n_tiles * r` candidates a
    program at buffer positions `0 .. n_tiles * r - 1`. Returns `o [B, NB, H_kv, 2 *
    ROWS, V]`. `rotator`: who rotates the keys: each consumer warpgroup its own copy
    (`"consumers"`), or the memory warpgroup once, in place, once the tile has landed
    (`"memory"`: the consumers wait for the rotated tile)."""
    rotate = cos is not None
    by_memory = rotate and rotator == "memory"
    if rotate:
        (q_lo, q_hi), (k_lo, k_hi) = q, k
        B, NB, H_kv, rows2, h = q_lo.shape
        K = 2 * h
        dtype = q_lo.dtype
    else:
        B, NB, H_kv, rows2, K = q.shape
        h = K // 2
        dtype = q.dtype
    V = v.shape[-1]
    n_tiles = nodes.shape[-1]
    per_step = tile // r
    steps = n_tiles // per_step
    pieces = -(-n_tiles // 256)  # a TMA copy moves at most 256 elements along a dimension
    assert rows2 == 2 * ROWS and n_tiles % per_step == 0 and steps >= stages and n_tiles % pieces == 0

    def kernel(*refs):
        if rotate:
            (qlo_ref, qhi_ref, klo_ref, khi_ref, v_ref, nodes_ref, cos_ref, sin_ref, o_ref, scratch, bars) = refs
            if by_memory:
                (qlo_s, qhi_s, klo_s, khi_s, v_s, cos_s, sin_s, o_s, nodes_s) = scratch
                rlo_s, rhi_s = klo_s, khi_s  # rotated in place
            else:
                (qlo_s, qhi_s, klo_s, khi_s, v_s, cos_s, sin_s, rlo_s, rhi_s, o_s, nodes_s) = scratch
        else:
            (q_ref, k_ref, v_ref, nodes_ref, o_ref, scratch, bars) = refs
            (q_s, k_s, v_s, nodes_s) = scratch
            o_s = q_s  # V == K: the rows' buffer takes the output
        k_bars, v_bars, q_bars, n_bar, k_done, v_done, schedule, *landed = bars
        b, j, hk = lax.axis_index("b"), lax.axis_index("j"), lax.axis_index("h")
        wg = lax.axis_index("wg")
        my_rows = pl.ds(wg * ROWS, ROWS)

        def schedule_barrier():
            plgpu.barrier_arrive(schedule)
            plgpu.barrier_wait(schedule)

        @pl.when(wg < 2)
        def _consumer():
            # Rotating on the memory warpgroup takes registers there: 2 x 208 + 88, the
            # same 504 a thread slot as 2 x 232 + 40 (2 x 216 + 80, the whole register
            # file, hung on the H200: 2026-12-01, journal).
            plgpu.set_max_registers(208 if by_memory else 232, action="increase")
            if rotate:
                plgpu.copy_gmem_to_smem(qlo_ref.at[b, j, hk, my_rows], qlo_s.at[wg], q_bars.at[wg])
                plgpu.copy_gmem_to_smem(qhi_ref.at[b, j, hk, my_rows], qhi_s.at[wg], q_bars.at[wg])
            else:
                plgpu.copy_gmem_to_smem(q_ref.at[b, j, hk, my_rows], q_s.at[wg], q_bars.at[wg])
            plgpu.barrier_wait(q_bars.at[wg])
            m = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            total = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.zeros((ROWS, V), jnp.float32), plgpu.Layout.WGMMA)
            plgpu.barrier_wait(k_bars.at[0])
            pl.when(wg == 1)(schedule_barrier)

            def step(i, carry):
                acc, m, total = carry
                slot = lax.rem(i, stages)
                if rotate and not by_memory:  # this warpgroup's copy of the tile's keys, rotated by their positions
                    lo = klo_s.at[slot][...].astype(jnp.float32)
                    hi = khi_s.at[slot][...].astype(jnp.float32)
                    c, s_ = cos_s.at[slot][...].astype(jnp.float32), sin_s.at[slot][...].astype(jnp.float32)
                    rlo_s.at[wg][...] = (lo * c - hi * s_).astype(dtype)
                    rhi_s.at[wg][...] = (lo * s_ + hi * c).astype(dtype)
                    plgpu.commit_smem()

                def scores(acc_ref):
                    if by_memory:
                        plgpu.wgmma(acc_ref, qlo_s.at[wg], rlo_s.at[slot].transpose((1, 0)))
                        plgpu.wgmma(acc_ref, qhi_s.at[wg], rhi_s.at[slot].transpose((1, 0)))
                    elif rotate:
                        plgpu.wgmma(acc_ref, qlo_s.at[wg], rlo_s.at[wg].transpose((1, 0)))
                        plgpu.wgmma(acc_ref, qhi_s.at[wg], rhi_s.at[wg].transpose((1, 0)))
                    else:
                        plgpu.wgmma(acc_ref, q_s.at[wg], k_s.at[slot].transpose((1, 0)))
                    schedule_barrier()
                    return acc_ref[...]

                s = pl.run_scoped(scores, plgpu.ACC((ROWS, tile), jnp.float32))
                plgpu.barrier_arrive(k_done.at[slot])
                # `pallas_kernels.shared.softmax.fold`, in base 2 (as `attention_mgpu`).
                m_new = jnp.maximum(m, s.max(axis=1) * LOG2E)
                decay = jnp.exp2(m - m_new)
                w = jnp.exp2(s * LOG2E - lax.broadcast_in_dim(m_new, s.shape, [0]))
                acc = acc * lax.broadcast_in_dim(decay, acc.shape, [0])
                total = total * decay + w.sum(axis=1)
                w16 = w.astype(dtype)
                acc, total, m_new, w16 = lax.optimization_barrier((acc, total, m_new, w16))
                plgpu.barrier_arrive(schedule)
                plgpu.barrier_wait(v_bars.at[slot])
                plgpu.barrier_wait(schedule)

                def values(acc_ref):
                    plgpu.wgmma(acc_ref, w16, v_s.at[slot])
                    nxt = i + 1

                    @pl.when(nxt < steps)
                    def _():
                        plgpu.barrier_wait(k_bars.at[lax.rem(nxt, stages)])

                acc = pl.run_state(values)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_done.at[slot])
                return acc, m_new, total

            acc, m, total = lax.fori_loop(0, steps, step, (acc, m, total))
            pl.when(wg == 0)(schedule_barrier)
            out = acc / lax.broadcast_in_dim(total, acc.shape, [0])
            o_s.at[wg][...] = out.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_s.at[wg], o_ref.at[b, j, hk, my_rows])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(88 if by_memory else 40, action="decrease")
            size = n_tiles // pieces
            for c in range(pieces):
                plgpu.copy_gmem_to_smem(nodes_ref.at[b, j, hk, pl.ds(c * size, size)], nodes_s.at[pl.ds(c * size, size)],
                                        n_bar.at[0])
            plgpu.barrier_wait(n_bar.at[0])

            def issue_keys(i, slot):
                land = landed[0].at[slot] if by_memory else k_bars.at[slot]
                for t in range(per_step):
                    start = nodes_s[i * per_step + t] * r
                    rows = pl.ds(t * r, r)
                    if rotate:
                        plgpu.copy_gmem_to_smem(klo_ref.at[b, hk, pl.ds(start, r)], klo_s.at[slot, rows], land)
                        plgpu.copy_gmem_to_smem(khi_ref.at[b, hk, pl.ds(start, r)], khi_s.at[slot, rows], land)
                    else:
                        plgpu.copy_gmem_to_smem(k_ref.at[b, hk, pl.ds(start, r)], k_s.at[slot, rows], k_bars.at[slot])
                if rotate:
                    plgpu.copy_gmem_to_smem(cos_ref.at[pl.ds(i * tile, tile)], cos_s.at[slot], land)
                    plgpu.copy_gmem_to_smem(sin_ref.at[pl.ds(i * tile, tile)], sin_s.at[slot], land)

            def rotate_keys(slot):
                """The tile landed in `slot` rotated in place, then handed to the consumers
                (`k_bars`)."""
                if by_memory:
                    plgpu.barrier_wait(landed[0].at[slot])
                    # The whole tile at once (16-row slices found no register layout).
                    lo = klo_s.at[slot][...].astype(jnp.float32)
                    hi = khi_s.at[slot][...].astype(jnp.float32)
                    cc = cos_s.at[slot][...].astype(jnp.float32)
                    ss = sin_s.at[slot][...].astype(jnp.float32)
                    klo_s.at[slot][...] = (lo * cc - hi * ss).astype(dtype)
                    khi_s.at[slot][...] = (lo * ss + hi * cc).astype(dtype)
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(k_bars.at[slot])

            def issue_values(i, slot):
                for t in range(per_step):
                    start = nodes_s[i * per_step + t] * r
                    plgpu.copy_gmem_to_smem(v_ref.at[b, hk, pl.ds(start, r)], v_s.at[slot, pl.ds(t * r, r)],
                                            v_bars.at[slot])

            for i in range(stages):
                issue_keys(i, i)
                issue_values(i, i)
                rotate_keys(i)

            @pl.loop(0, steps - stages)
            def _(i):
                nxt = i + stages
                slot = lax.rem(i, stages)
                plgpu.barrier_wait(k_done.at[slot])
                issue_keys(nxt, slot)
                rotate_keys(slot)
                plgpu.barrier_wait(v_done.at[slot])
                issue_values(nxt, slot)

    t = lambda minor, dt=dtype: _transforms(minor, dt)
    if by_memory:
        key_copies = 1  # the memory warpgroup's arrival once the tile is rotated
        smem = [plgpu.SMEM((2, ROWS, h), dtype, transforms=t(h)), plgpu.SMEM((2, ROWS, h), dtype, transforms=t(h)),
                plgpu.SMEM((stages, tile, h), dtype, transforms=t(h)),
                plgpu.SMEM((stages, tile, h), dtype, transforms=t(h)),
                plgpu.SMEM((stages, tile, V), dtype, transforms=t(V)),
                plgpu.SMEM((stages, tile, h), dtype, transforms=t(h)),
                plgpu.SMEM((stages, tile, h), dtype, transforms=t(h)),
                plgpu.SMEM((2, ROWS, V), dtype, transforms=t(V)),
                plgpu.SMEM((n_tiles,), jnp.int32)]
        args = (q_lo, q_hi, k_lo, k_hi, v, nodes, cos.astype(dtype), sin.astype(dtype))
        out_shape = q_lo.shape[:-1] + (V,)
    elif rotate:
        key_copies = 2 * per_step + 2
        smem = [plgpu.SMEM((2, ROWS, h), dtype, transforms=t(h)), plgpu.SMEM((2, ROWS, h), dtype, transforms=t(h)),
                plgpu.SMEM((stages, tile, h), dtype, transforms=t(h)),
                plgpu.SMEM((stages, tile, h), dtype, transforms=t(h)),
                plgpu.SMEM((stages, tile, V), dtype, transforms=t(V)),
                plgpu.SMEM((stages, tile, h), dtype, transforms=t(h)),
                plgpu.SMEM((stages, tile, h), dtype, transforms=t(h)),
                plgpu.SMEM((2, tile, h), dtype, transforms=t(h)), plgpu.SMEM((2, tile, h), dtype, transforms=t(h)),
                plgpu.SMEM((2, ROWS, V), dtype, transforms=t(V)),
                plgpu.SMEM((n_tiles,), jnp.int32)]
        args = (q_lo, q_hi, k_lo, k_hi, v, nodes, cos.astype(dtype), sin.astype(dtype))
        out_shape = q_lo.shape[:-1] + (V,)
    else:
        key_copies = per_step
        smem = [plgpu.SMEM((2, ROWS, K), dtype, transforms=t(K)),
                plgpu.SMEM((stages, tile, K), dtype, transforms=t(K)),
                plgpu.SMEM((stages, tile, V), dtype, transforms=t(V)),
                plgpu.SMEM((n_tiles,), jnp.int32)]
        args = (q, k, v, nodes)
        out_shape = q.shape[:-1] + (V,)
    bars = (plgpu.Barrier(num_arrivals=key_copies, num_barriers=stages),
            plgpu.Barrier(num_arrivals=per_step, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2 if rotate else 1, num_barriers=2),
            plgpu.Barrier(num_arrivals=pieces, num_barriers=1),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2))
    if by_memory:  # the key tile's copies landing, which the memory warpgroup waits for
        bars += (plgpu.Barrier(num_arrivals=2 * per_step + 2, num_barriers=stages),)

    def entry(*refs):
        ins, out = refs[:-1], refs[-1]
        pl.run_scoped(lambda scratch, barriers: kernel(*ins, out, scratch, barriers), smem, bars,
                      collective_axes="wg")

    params = {} if interpret is None else {"interpret": interpret}
    return plgpu.kernel(entry, out_type=jax.ShapeDtypeStruct(out_shape, dtype),
                        grid=(H_kv, NB, B), grid_names=("h", "j", "b"), num_threads=3, thread_name="wg",
                        compiler_params=plgpu.CompilerParams(approx_math=True), **params)(*args)


def twin(q, k, v, nodes, r, cos=None, sin=None):
    """`merge_tiles` in jnp (float32)."""
    idx = (nodes[..., :, None] * r + jnp.arange(r)).reshape(nodes.shape[:-1] + (-1,))  # [B, NB, H_kv, C]
    rotate = cos is not None
    if rotate:
        q = jnp.concatenate(q, -1)
        k = jnp.concatenate(k, -1)
    bi = jnp.arange(idx.shape[0])[:, None, None, None]
    hi = jnp.arange(idx.shape[2])[None, None, :, None]
    keys = k[bi, hi, idx].astype(jnp.float32)  # [B, NB, H_kv, C, K]
    vals = v[bi, hi, idx].astype(jnp.float32)
    if rotate:
        h = keys.shape[-1] // 2
        c, s = cos.astype(keys.dtype), sin.astype(keys.dtype)
        lo, hi_ = keys[..., :h], keys[..., h:]
        keys = jnp.concatenate([lo * c - hi_ * s, lo * s + hi_ * c], -1)
    s = jnp.einsum("bjhrk,bjhck->bjhrc", q.astype(jnp.float32), keys)
    w = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bjhrc,bjhcv->bjhrv", w, vals)


def inputs(rng, B, NB, H_kv, N, K, V, n_tiles, r, dtype):
    q = jnp.asarray(rng.standard_normal((B, NB, H_kv, 2 * ROWS, K)) * K ** -0.5, dtype)
    k = jnp.asarray(rng.standard_normal((B, H_kv, N, K)), dtype)
    v = jnp.asarray(rng.standard_normal((B, H_kv, N, V)), dtype)
    nodes = np.sort(rng.integers(0, N // r, size=(B, NB, H_kv, n_tiles)), axis=-1).astype(np.int32)
    positions = np.arange(n_tiles * r)[:, None] * (10000.0 ** (-np.arange(K // 2) / (K // 2)))[None, :]
    return q, k, v, jnp.asarray(nodes), jnp.asarray(np.cos(positions), jnp.float32), jnp.asarray(
        np.sin(positions), jnp.float32)




def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="small shapes against the jnp twin")
    p.add_argument("--interpret", action="store_true", help="Mosaic GPU's interpret mode (a CPU; jax >= 0.12)")
    p.add_argument("--T", type=int, default=131072)
    p.add_argument("--candidates", type=int, default=12288, help="candidates a program (the merge's mean at 128K)")
    p.add_argument("--tiles", default="128,64", help="candidates a step to try")
    p.add_argument("--steps", default="1,2,3")
    p.add_argument("--r", type=int, default=16, help="rows a node tile (one TMA copy each)")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    interpret = plgpu.InterpretGPUParams() if args.interpret else None
    r, K, V, dtype = args.r, 128, 128, jnp.float16
    if args.check:
        B, NB, H_kv, N, n_tiles = 1, 2, 2, 1024, 16
        q, k, v, nodes, cos, sin = inputs(rng, B, NB, H_kv, N, K, V, n_tiles, r, dtype)
        halves = lambda x: (x[..., :K // 2], x[..., K // 2:])
        for tile in (int(t) for t in args.tiles.split(",")):
            for rotate, rotator in ((False, "-"), (True, "consumers"), (True, "memory")) if tile <= 64 else (
                    (False, "-"),):
                qq, kk, tables = (halves(q), halves(k), (cos, sin)) if rotate else (q, k, ())
                got = merge_tiles(qq, kk, v, nodes, *tables, r=r, tile=tile, rotator=rotator, interpret=interpret)
                want = twin(qq, kk, v, nodes, r, *tables)
                err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)))
                print(f"check tile={tile} rotate={rotate} by {rotator}: max abs error {err:.2e}", flush=True)
        return 0
    T, H, H_kv = args.T, 32, 4
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: T={T} H={H} H_kv={H_kv} K=V={K} f16", flush=True)
    if "1" in args.steps.split(","):
        from jax.experimental.pallas.ops.gpu import attention_mgpu

        kq = jax.random.split(jax.random.key(0), 3)
        qd = jax.random.normal(kq[0], (1, T, H, K), dtype)
        kd = jax.random.normal(kq[1], (1, T, H_kv, K), dtype)
        vd = jax.random.normal(kq[2], (1, T, H_kv, K), dtype)
        flops = 4 * T * T * K * H / 2
        for block_kv in (128, 64):
            config = attention_mgpu.TuningConfig(block_q=64, block_kv=block_kv, max_concurrent_steps=2, causal=True)
            try:
                ms = median_ms(jax.jit(functools.partial(attention_mgpu.attention, config=config)), (qd, kd, vd), 5)
                print(f"step 1 attention_mgpu causal block_kv={block_kv}: {ms:.1f} ms, {flops / ms / 1e9:.0f} TFLOP/s",
                      flush=True)
            except Exception as e:  # noqa: BLE001 - a launch that does not compile is a row too
                print(f"step 1 attention_mgpu block_kv={block_kv}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
        ms = median_ms(cudnn, (qd, kd, vd), 5)
        print(f"step 1 cuDNN causal: {ms:.1f} ms, {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        del qd, kd, vd
    NB = T // 16
    n_tiles = args.candidates // r
    q, k, v, nodes, cos, sin = inputs(rng, 1, NB, H_kv, T, K, V, n_tiles, r, dtype)
    flops = NB * H_kv * 2 * ROWS * n_tiles * r * 2 * (K + V)
    halves = lambda x: (x[..., :K // 2], x[..., K // 2:])
    # Step 3 at 64 candidates a step: at 128 its buffers (rotated keys a warpgroup, the
    # tables) pass the 227 KiB of shared memory a block has.
    for step, rotate, tiles, rotator, stages in (
            ("2", False, args.tiles, "-", 2), ("3", True, "64", "consumers", 2), ("3b", True, "64", "memory", 2),
            ("3b", True, "64", "memory", 3)):
        if step not in args.steps.split(","):
            continue
        for tile in (int(t) for t in tiles.split(",")):
            qq, kk, tables = (halves(q), halves(k), (cos, sin)) if rotate else (q, k, ())
            f = jax.jit(functools.partial(merge_tiles, r=r, tile=tile, rotator=rotator, stages=stages))
            try:
                ms = median_ms(f, (qq, kk, v, nodes, *tables), 10)
                print(f"step {step} {'rotated by ' + rotator if rotate else 'gathered'} r={r} tile={tile} "
                      f"stages={stages}: {ms:.1f} ms, "
                      f"{flops / ms / 1e9:.0f} TFLOP/s ({flops / 1e12:.1f} TFLOP)", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"step {step} tile={tile}: {type(e).__name__}: {str(e)[:600]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
