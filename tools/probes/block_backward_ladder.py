"""Probe (issue 83): how fast can the block backward's key and value gradients, summed
by node (the node-major algorithm of the library's `"by_node"` sums, which left it on
12-07; git keeps them), run on Mosaic GPU at layer 0's shape?

At T=131072 (`top_k=512`, `selection_block=16`) layer 0's node tiles are 16 rows (the
children of one layer-1 node), and each is merged by the blocks that kept its parent:
about 512 of the 8192 (the inverted index's list). A program per (tile, kv head) walks
its list; each entry brings one block's 128 rows (16 queries x 8 heads: `q` already
rotated, `do`, `lse`, `delta`) by TMA into a ring of shared-memory stages, and two
consumer warpgroups (64 rows each) do, in the transposed form (WGMMA's M is 64, a tile
has 16 keys; the keys are N):

    s = q k^T, dp = do v^T          [64 rows, 16]
    p = exp(s - lse), ds = p (dp - delta)
    dv^T += do^T p, dk^T += q^T ds  [128, 16] (M: the head dim, K: the rows)

Four products of `2 * 128 * 16 * 128` FLOPs a block's rows; `dq` is block-major (not
here). Step 2 of the ladder (tiles by index, random sorted block lists, no RoPE, no
mask; step 1 is the forward ladder's): timed with the lists over all blocks or a window
of them (`--windows`: neighbouring tiles then share blocks in L2), 2 or 3 ring stages,
and with 32 or 48 keys a program sharing one list (`--keys`: as where a layer's nodes
sit at the same positions in every block), which lands the same rows for more keys.

    python tools/probes/block_backward_ladder.py            # on a Hopper GPU
    python tools/probes/block_backward_ladder.py --check    # small, against a jnp twin
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

ROWS = 64  # rows a consumer warpgroup takes (WGMMA's M for the scores)
R = 16  # keys a node tile
LOG2E = math.log2(math.e)
LOAD_TAKES_INDEX = tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11)
SWIZZLE = 32  # every operand: a `[64, 16]` bf16 weight tile is 32 bytes wide, and A's swizzle must match B's


def _transforms(dtype):
    elems = SWIZZLE * 8 // (jnp.dtype(dtype).itemsize * 8)
    return plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(SWIZZLE)


def _row(ref):
    """`ref`'s `[64]` float32 in WGMMA's row layout (jax 0.10's `load` takes an index
    apart from the reference; 0.11 deprecates that)."""
    if LOAD_TAKES_INDEX:
        return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(1))
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(1))


def node_grads(q_lo, q_hi, do_lo, do_hi, lse, delta, k_lo, k_hi, v_lo, v_hi, lists, *, stages: int = 2,
               alpha: float = 1.0):
    """Each tile's `dk^T, dv^T` summed over its list's blocks.

    q_lo, q_hi, do_lo, do_hi `[H_kv, NB, 128, 64]` (the rows' halves of the head dim),
    lse, delta `[H_kv, NB, 128]` float32 (`lse` natural log), k_lo, k_hi, v_lo, v_hi
    `[H_kv, U, R, 64]` (`R` keys a program: 16, 32 or 48), lists `[H_kv, U, E]` int32
    (blocks; `E` a multiple of 4, whole 16 bytes for TMA). Returns `(dkT, dvT)`, each
    `[H_kv, U, 2, 2, 64, R]` float32: (consumer, half, head-dim row, key); the sum over
    the consumer axis is the tile's gradient (XLA, in a fixed order)."""
    H_kv, NB, rows2, h = q_lo.shape
    U, E = lists.shape[1], lists.shape[2]
    R = k_lo.shape[2]  # keys a program (16: one node tile; more: tiles sharing one list, `--keys`)
    dtype = q_lo.dtype
    pieces = -(-E // 256)
    assert rows2 == 2 * ROWS and E % pieces == 0 and E >= stages

    def kernel(qlo_ref, qhi_ref, dlo_ref, dhi_ref, lse_ref, delta_ref, klo_ref, khi_ref, vlo_ref, vhi_ref, list_ref,
               dk_ref, dv_ref, scratch, bars):
        (qlo_s, qhi_s, dlo_s, dhi_s, lse_s, delta_s, klo_s, khi_s, vlo_s, vhi_s, p_s, ds_s, out_s, list_s) = scratch
        landed, consumed, tile_bar, list_bar = bars
        u, hk = lax.axis_index("u"), lax.axis_index("h")
        wg = lax.axis_index("wg")
        mine = pl.ds(wg * ROWS, ROWS)

        @pl.when(wg < 2)
        def _consumer():
            plgpu.set_max_registers(232, action="increase")
            plgpu.barrier_wait(tile_bar.at[0])
            zero = plgpu.layout_cast(jnp.zeros((h, R), jnp.float32), plgpu.Layout.WGMMA)

            def entry(e, carry):
                slot = lax.rem(e, stages)
                plgpu.barrier_wait(landed.at[slot])

                def scores(refs):
                    s_ref, dp_ref = refs
                    plgpu.wgmma(s_ref, qlo_s.at[slot, mine], klo_s.transpose((1, 0)))
                    plgpu.wgmma(s_ref, qhi_s.at[slot, mine], khi_s.transpose((1, 0)))
                    plgpu.wgmma(dp_ref, dlo_s.at[slot, mine], vlo_s.transpose((1, 0)))
                    plgpu.wgmma(dp_ref, dhi_s.at[slot, mine], vhi_s.transpose((1, 0)))

                zs = plgpu.layout_cast(jnp.zeros((ROWS, R), jnp.float32), plgpu.Layout.WGMMA)
                s, dp = pl.run_state(scores)((plgpu.ACC.init(zs), plgpu.ACC.init(zs)))
                lse_row, delta_row = _row(lse_s.at[slot, mine]), _row(delta_s.at[slot, mine])
                p = jnp.exp2((s * alpha - lax.broadcast_in_dim(lse_row, s.shape, [0])) * LOG2E)
                ds = p * (dp - lax.broadcast_in_dim(delta_row, s.shape, [0])) * alpha
                p_s.at[wg][...] = p.astype(dtype)
                ds_s.at[wg][...] = ds.astype(dtype)
                plgpu.commit_smem()

                def grads(refs):
                    dk_lo, dk_hi, dv_lo, dv_hi = refs
                    plgpu.wgmma(dv_lo, dlo_s.at[slot, mine].transpose((1, 0)), p_s.at[wg])
                    plgpu.wgmma(dv_hi, dhi_s.at[slot, mine].transpose((1, 0)), p_s.at[wg])
                    plgpu.wgmma(dk_lo, qlo_s.at[slot, mine].transpose((1, 0)), ds_s.at[wg])
                    plgpu.wgmma(dk_hi, qhi_s.at[slot, mine].transpose((1, 0)), ds_s.at[wg])

                carry = pl.run_state(grads)(tuple(plgpu.ACC.init(x) for x in carry))
                plgpu.barrier_arrive(consumed.at[slot])
                return carry

            dk_lo, dk_hi, dv_lo, dv_hi = lax.fori_loop(0, E, entry, (zero, zero, zero, zero))
            # One [64, 16] float32 buffer a warpgroup, reused: three ring stages fit beside it.
            for x, dst in ((dk_lo, dk_ref.at[hk, u, wg, 0]), (dk_hi, dk_ref.at[hk, u, wg, 1]),
                           (dv_lo, dv_ref.at[hk, u, wg, 0]), (dv_hi, dv_ref.at[hk, u, wg, 1])):
                out_s.at[wg][...] = x
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_s.at[wg], dst)
                plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            for src, dst in ((klo_ref, klo_s), (khi_ref, khi_s), (vlo_ref, vlo_s), (vhi_ref, vhi_s)):
                plgpu.copy_gmem_to_smem(src.at[hk, u], dst, tile_bar.at[0])
            size = E // pieces
            for c in range(pieces):
                plgpu.copy_gmem_to_smem(list_ref.at[hk, u, pl.ds(c * size, size)], list_s.at[pl.ds(c * size, size)],
                                        list_bar.at[0])
            plgpu.barrier_wait(list_bar.at[0])

            def issue(e, slot):
                j = list_s[e]
                for src, dst in ((qlo_ref, qlo_s), (qhi_ref, qhi_s), (dlo_ref, dlo_s), (dhi_ref, dhi_s),
                                 (lse_ref, lse_s), (delta_ref, delta_s)):
                    plgpu.copy_gmem_to_smem(src.at[hk, j], dst.at[slot], landed.at[slot])

            for e in range(stages):
                issue(e, e)

            @pl.loop(0, E - stages)
            def _(e):
                slot = lax.rem(e, stages)
                plgpu.barrier_wait(consumed.at[slot])
                issue(e + stages, slot)

    t = _transforms(dtype)
    rows_buf = lambda: plgpu.SMEM((stages, rows2, h), dtype, transforms=t)
    tile_buf = lambda: plgpu.SMEM((R, h), dtype, transforms=t)
    smem = [rows_buf(), rows_buf(), rows_buf(), rows_buf(),
            plgpu.SMEM((stages, rows2), jnp.float32), plgpu.SMEM((stages, rows2), jnp.float32),
            tile_buf(), tile_buf(), tile_buf(), tile_buf(),
            plgpu.SMEM((2, ROWS, R), dtype, transforms=t), plgpu.SMEM((2, ROWS, R), dtype, transforms=t),
            plgpu.SMEM((2, h, R), jnp.float32),
            plgpu.SMEM((E,), jnp.int32)]
    bars = (plgpu.Barrier(num_arrivals=6, num_barriers=stages),
            plgpu.Barrier(num_arrivals=2, num_barriers=stages),
            plgpu.Barrier(num_arrivals=4, num_barriers=1),
            plgpu.Barrier(num_arrivals=pieces, num_barriers=1))

    def entry_fn(*refs):
        ins, outs = refs[:-2], refs[-2:]
        pl.run_scoped(lambda scratch, barriers: kernel(*ins, *outs, scratch, barriers), smem, bars,
                      collective_axes="wg")

    out = jax.ShapeDtypeStruct((H_kv, U, 2, 2, h, R), jnp.float32)
    return plgpu.kernel(entry_fn, out_type=(out, out), grid=(U, H_kv), grid_names=("u", "h"), num_threads=3,
                        thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=True))(
        q_lo, q_hi, do_lo, do_hi, lse, delta, k_lo, k_hi, v_lo, v_hi, lists)


def twin(q_lo, q_hi, do_lo, do_hi, lse, delta, k_lo, k_hi, v_lo, v_hi, lists, alpha: float = 1.0):
    """`node_grads` in jnp (float32): `(dk [H_kv, U, 16, 128], dv [...])`."""
    f = lambda x: x.astype(jnp.float32)
    q, do = f(jnp.concatenate([q_lo, q_hi], -1)), f(jnp.concatenate([do_lo, do_hi], -1))
    k, v = f(jnp.concatenate([k_lo, k_hi], -1)), f(jnp.concatenate([v_lo, v_hi], -1))
    hi = jnp.arange(q.shape[0])[:, None, None]
    qj, doj = q[hi, lists], do[hi, lists]  # [H_kv, U, E, 128, K]
    lj, dj = lse[hi, lists], delta[hi, lists]
    s = alpha * jnp.einsum("huerk,huck->huerc", qj, k)
    p = jnp.exp(s - lj[..., None])
    dp = jnp.einsum("huerv,hucv->huerc", doj, v)
    ds = p * (dp - dj[..., None]) * alpha
    return jnp.einsum("huerc,huerk->huck", ds, qj), jnp.einsum("huerc,huerv->hucv", p, doj)


def from_kernel(dkT, dvT):
    """The kernel's `[H_kv, U, 2, 2, 64, 16]` partials as `[H_kv, U, 16, 128]`."""
    g = lambda x: jnp.swapaxes(x[:, :, 0] + x[:, :, 1], -1, -2)  # [H_kv, U, 2, 16, 64]
    return tuple(jnp.concatenate([y[:, :, 0], y[:, :, 1]], -1) for y in (g(dkT), g(dvT)))


def inputs(rng, H_kv, NB, U, E, dtype, K=128, window: int = 0, R: int = R):
    """Random inputs; each tile's list `E` sorted distinct blocks of all `NB`, or with
    `window` of the `window` blocks from `u * (NB - window) / U` (neighbouring tiles
    share blocks: the reads a block-chunked order would share in L2)."""
    h = K // 2
    n = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
    q = [n(H_kv, NB, 2 * ROWS, h) * (K ** -0.25) for _ in range(2)]
    k = [n(H_kv, U, R, h) * (K ** -0.25) for _ in range(2)]
    do = [n(H_kv, NB, 2 * ROWS, h) for _ in range(2)]
    v = [n(H_kv, U, R, h) for _ in range(2)]
    lse = jnp.asarray(rng.standard_normal((H_kv, NB, 2 * ROWS)) + 3.0, jnp.float32)
    delta = jnp.asarray(rng.standard_normal((H_kv, NB, 2 * ROWS)) * 0.1, jnp.float32)
    span = window or NB
    start = lambda u: (u * (NB - span)) // max(U, 1)
    lists = np.sort(np.stack([[start(u) + rng.choice(span, size=E, replace=False) for u in range(U)]
                              for _ in range(H_kv)]), -1)
    return (*q, *do, lse, delta, *k, *v, jnp.asarray(lists, jnp.int32))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="small shapes against the jnp twin")
    p.add_argument("--lower", action="store_true", help="lower for CUDA only (a CPU machine)")
    p.add_argument("--blocks", type=int, default=8192, help="blocks (T / 16)")
    p.add_argument("--tiles", type=int, default=8192, help="node tiles a kv head (layer 0 at 128K)")
    p.add_argument("--entries", type=int, default=512, help="blocks a tile's list")
    p.add_argument("--stages", default="2,3")
    p.add_argument("--keys", default="16", help="keys a program to time (16: a node tile; 32, 48: tiles "
                   "sharing one list, as where a layer's nodes sit at the same positions in every block)")
    p.add_argument("--windows", default="0", help="block windows of the lists to time (0: all blocks)")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    dtype = jnp.bfloat16
    if args.lower:
        ins = inputs(rng, 1, 8, 2, 4, dtype)
        for stages in (int(s) for s in args.stages.split(",")):
            f = jax.jit(functools.partial(node_grads, stages=stages))
            f.trace(*ins).lower(lowering_platforms=("cuda",))
            print(f"lowered stages={stages}", flush=True)
        return 0
    if args.check:
        for H_kv, NB, U, E, keys in ((1, 8, 2, 4, 16), (2, 16, 3, 8, 16), (1, 16, 2, 8, 48)):  # E: whole 16 bytes (TMA)
            ins = inputs(rng, H_kv, NB, U, E, dtype, R=keys)
            want = twin(*ins)
            for stages in (int(s) for s in args.stages.split(",")):
                if E < stages:
                    continue
                got = from_kernel(*node_grads(*ins, stages=stages))
                for name, g, w in zip(("dk", "dv"), got, want):
                    err = float(jnp.max(jnp.abs(g - w)) / (jnp.max(jnp.abs(w)) + 1e-9))
                    print(f"CHECK H_kv={H_kv} NB={NB} U={U} E={E} keys={keys} stages={stages} {name}: "
                          f"max rel error {err:.2e}", flush=True)
        return 0
    H_kv, NB, U, E = 4, args.blocks, args.tiles, args.entries
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: H_kv={H_kv} blocks={NB} tiles={U} entries={E}",
          flush=True)
    for keys, window in ((int(n), int(w)) for n in args.keys.split(",") for w in args.windows.split(",")):
        Up = U * R // keys  # the same keys, `keys` a program
        flops = H_kv * Up * E * 4 * 2 * (2 * ROWS) * keys * 128
        read = H_kv * Up * E * 2 * (2 * ROWS) * (128 * 2 + 4)  # the rows' bytes the entries land
        print(f"keys={keys}: {flops / 1e12:.1f} TFLOP, {read / 1e12:.2f} TB of rows landed", flush=True)
        ins = inputs(rng, H_kv, NB, Up, E, dtype, window=window, R=keys)
        for stages in (int(s) for s in args.stages.split(",")):
            f = jax.jit(functools.partial(node_grads, stages=stages))
            try:
                ms = median_ms(f, ins, 5)
                print(f"TIME step 2 keys={keys} window={window or NB} stages={stages}: {ms:.1f} ms, "
                      f"{flops / ms / 1e9:.0f} TFLOP/s, rows read at {read / ms / 1e9:.2f} TB/s", flush=True)
            except Exception as e:  # noqa: BLE001 - a launch that does not compile is a row too
                print(f"TIME step 2 stages={stages}: {type(e).__name__}: {str(e)[:600]}", flush=True)
        del ins
    return 0


if __name__ == "__main__":
    sys.exit(main())
