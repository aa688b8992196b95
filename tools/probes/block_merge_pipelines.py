"""Probe (issue 82): the Mosaic GPU block merge (`block/mosaic_merge.py`) by pipeline
layout (`mosaic_merge.Pipeline`): each layout checked against the Pallas-Triton merge on
small shapes (multi-layer trees, one and two consumer warpgroups), then timed at the
benchmark shape (B=1, H=32, H_kv=4, K=V=128, bf16, `top_k=512`, `selection_block=16`)
beside the Pallas-Triton merge and cuDNN, random and correlated inputs. One layout a
process, so that a layout that hangs costs only its own timeout:

    for p in 64,4,176,152 64,4,168,40,136; do
        timeout 240 python tools/probes/block_merge_pipelines.py --pipe $p --check --time; done

Prints `CHECK ...` and `TIME ...` lines; the merge's rate is `merge_flops` over the
merge kernel's own time in a profile.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_block import merge_flops
from htree_jax import HTreeConfig
from htree_jax.backends import blocks_of
from htree_jax.bench import INPUTS, dense_fn, median_ms
from htree_jax.core.tree import build_tree
from htree_jax.kernel_trace import kernel_times
from pallas_kernels.block import mosaic_merge
from pallas_kernels.block.forward import block_forward_pallas, merge_static
from pallas_kernels.block.layout import block_layout, table_positions
from pallas_kernels.block.merge import BlockLaunch, layer_arrays, selection_lists
from pallas_kernels.shared.common import pad_rope_halves
from pallas_kernels.shared.configs import BlockConfig
from tests.conftest import random_qkv

CASES = [  # r, top_k, T, H, H_kv, K, V, dtype, source
    (16, 8, 4096, 32, 4, 128, 128, jnp.bfloat16, "first"),
    (16, 32, 3000, 8, 1, 128, 128, jnp.bfloat16, "previous"),
    (8, 8, 1500, 8, 2, 64, 128, jnp.float16, "first"),
    (16, 8, 2048, 16, 1, 64, 64, jnp.float16, "first"),
    (16, 64, 8192, 64, 4, 128, 128, jnp.bfloat16, "first"),
]


def mosaic_merge_call(q, k, v, selections, config, pipe):
    """`block_forward_pallas(..., merge="mosaic_gpu")` with the merge laid out by `pipe`."""
    B, T, H, K = q.shape
    H_kv, V = k.shape[2], v.shape[-1]
    st = merge_static(config, T, H // H_kv, K, V, q.dtype, BlockConfig(), "mosaic_gpu")
    b = config.selection_block
    Tp = -(-T // b) * b
    q5 = block_layout(pad_rope_halves(q, st.half), H_kv, st, Tp)
    layers = layer_arrays(build_tree(k, v, config), st)
    launch = BlockLaunch(config, st, K, table_positions(config, T, st))
    o, lse = mosaic_merge.block_merge_mosaic(q5, layers, selection_lists(selections, st), launch, pipe=pipe)
    G = H // H_kv
    return o[:, :T, :, :G, :V].reshape(B, T, H, V), lse[:, :T, :, :G].reshape(B, T, H)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pipe", default="64,2,176,152",
                   help="tile,stages,consumer registers,memory registers[,rotator registers][,keys|queries][,smem]"
                        "[,absolute][,ablate]")
    p.add_argument("--baseline", action="store_true", help="time the Pallas-Triton merge and cuDNN too")
    p.add_argument("--check", action="store_true")
    p.add_argument("--time", action="store_true")
    p.add_argument("--T", default="131072")
    p.add_argument("--cases", type=int, default=len(CASES), help="the first this many check cases")
    p.add_argument("--kinds", default="random,correlated")
    args = p.parse_args(argv)
    tile, s, creg, mreg, *rest = args.pipe.split(",")
    rreg = int(rest.pop(0)) if rest and rest[0].isdigit() else 0
    turn = rest.pop(0) if rest and rest[0] in ("keys", "queries") else "keys"
    hold = not (rest and rest[0] == "smem" and rest.pop(0))  # "smem": the rows read again each step
    absolute = bool(rest and rest[0] == "absolute" and rest.pop(0))  # the top layer's keys at their positions
    pipe = mosaic_merge.Pipeline(tile=int(tile), stages=int(s), consumer_registers=int(creg),
                                 memory_registers=int(mreg), rotator_registers=rreg, turn=turn, hold_rows=hold,
                                 absolute_top=absolute, ablate=rest[0] if rest else "")
    tag = args.pipe
    print(jax.devices()[0].device_kind, jax.__version__, pipe, flush=True)
    if args.check:
        for r, top_k, T, H, H_kv, K, V, dtype, source in CASES[: args.cases]:
            rng = np.random.default_rng(T)
            q, k, v = (jnp.asarray(x, dtype) for x in random_qkv(rng, 1, T, H, H_kv, K, V))
            config = HTreeConfig(compression_rate=r, top_k=top_k, selection_block=r, block_source=source)
            blocks = jax.jit(lambda q, k, v: blocks_of(q, k, v, config))(q, k, v)
            t0 = time.time()
            try:
                base = jax.jit(lambda q, k, v, s: block_forward_pallas(q, k, v, s, config=config))(q, k, v, blocks)
                got = jax.jit(lambda q, k, v, s: mosaic_merge_call(q, k, v, s, config, pipe))(q, k, v, blocks)
                got = jax.block_until_ready(got)
                o_err = rel(got[0].astype(jnp.float32), base[0].astype(jnp.float32))
                lse_err = float(np.max(np.abs(np.asarray(got[1]) - np.asarray(base[1]))))
                print(f"CHECK {tag} r={r} top_k={top_k} T={T} H={H}/{H_kv} K={K} V={V} {jnp.dtype(dtype).name} "
                      f"L={config.num_layers(T)}: o rel {o_err:.2e}, lse max abs {lse_err:.2e} ({time.time() - t0:.1f} s)",
                      flush=True)
            except Exception as e:  # noqa: BLE001 - a shape that does not compile is a line too
                print(f"CHECK {tag} r={r} T={T} H={H}/{H_kv}: FAIL {type(e).__name__}: {str(e)[:2000]}", flush=True)
    if args.time:
        config = HTreeConfig(top_k=512, selection_block=16)
        for T in (int(t) for t in args.T.split(",")):
            for kind in args.kinds.split(","):
                q, k, v = INPUTS[kind](T)
                G, K, V = q.shape[2] // k.shape[2], q.shape[-1], v.shape[-1]
                blocks = jax.jit(lambda q, k, v: blocks_of(q, k, v, config))(q, k, v)
                flops = merge_flops(blocks, config, T, G, K, V)
                row = {}
                fns = [("mosaic", lambda q, k, v, s: mosaic_merge_call(q, k, v, s, config, pipe)[0])]
                if args.baseline:
                    fns.append(("pallas_triton", lambda q, k, v, s: block_forward_pallas(q, k, v, s, config=config)[0]))
                for name, fn in fns:
                    f = jax.jit(fn)
                    row[name + "_call_ms"] = round(median_ms(f, (q, k, v, blocks), 10), 2)
                    times = kernel_times(lambda: f(q, k, v, blocks), 3)
                    name_, (us, _) = max(times.items(), key=lambda kv: kv[1][0])
                    row[name + "_kernel_ms"] = round(us / 1e3, 2)
                    row[name + "_TFLOPs"] = round(flops / (us / 1e6) / 1e12, 1)
                if args.baseline:
                    row["cudnn_ms"] = round(median_ms(dense_fn(HTreeConfig(top_k=512, selection_block=1)), (q, k, v), 5), 2)
                print(f"TIME {tag} T={T} {kind} merge {flops / 1e12:.1f} TFLOP: {row}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
