"""Block selection's kernels on the GPU (SPEC 12, `pallas_kernels.block`) against cuDNN
in the same run: the forward through `htree_attention` (as users call it), its two
launches apart (the blocks' selections on the per-query kernels, `block_selections`;
the block merge, `block_forward_pallas`, with each `--variants` tile and warps) and
the merge's rate in TFLOP/s (its score and value dots over the candidates it
gathers), per-query htree at the same `top_k` beside it, and forward+backward at
`--backward-sizes` (and the block backward alone, `block_backward_pallas`, with each
`--backward-variants` and `--backward-sums`, with whether two calls agree bitwise; its
rate counts five dots a candidate to the forward's two; forward+backward with each of
`--backward-sums` too).

    python benchmarks/bench_block.py [--sizes 131072,524288] [--top-k 512] [--json FILE]

The benchmark shape: B=1, H=32, H_kv=4, K=V=128, bfloat16, `compression_rate=16`,
random and correlated inputs (`htree_jax.bench`); `--shapes` times other GQA groups
(`32/8`: G=4 on 8 kv heads, `4/1`: the frontier's models). Medians after warm-up
(`median_ms`).

    python benchmarks/bench_block.py --shapes 32/4,32/8,4/1 --sizes 65536,131072 \\
        --backward-sizes 65536,131072 --sources first --variants "" --backward-variants "" \\
        --backward-sums auto --kinds random,correlated --json FILE  # the default by group
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from htree_jax import HTreeConfig, htree_attention
from htree_jax.backends import blocks_of
from htree_jax.bench import INPUTS, dense_fn, grad_of_sum, head_shapes, int_list, median_ms, run_header
from htree_jax.cli import DefaultsHelpFormatter
from pallas_kernels.block.backward import block_backward_pallas
from pallas_kernels.block.forward import block_forward_pallas
from pallas_kernels.shared.configs import BlockConfig, KernelConfigs
from pallas_kernels.shared.kernels import BlockKernels


def merge_flops(blocks, config: HTreeConfig, T: int, G: int, K: int, V: int) -> float:
    """The block merge's dot FLOPs: every block's rows (`b * G`, per kv head) times the
    candidates of its layers (`2 * (K + V)` each): the top layer's nodes up to the block,
    each lower layer's `r` children of every parent it was given."""
    b, r, L = config.selection_block, config.compression_rate, config.num_layers(T)
    starts = jnp.arange(-(-T // b)) * b
    top = (starts // r ** (L - 1) + 1).astype(jnp.float32)  # [NB]
    per_block = top[None, :, None] + sum(jnp.sum(s >= 0, axis=-1).astype(jnp.float32) * r for s in blocks)
    return float(jnp.sum(per_block)) * b * G * 2 * (K + V)


def bitwise_repeatable(fn, args) -> bool:
    """Whether two calls of `fn` on the same `args` give bitwise equal outputs."""
    first = jax.device_get(fn(*args))
    second = jax.device_get(fn(*args))
    return all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)))


def sum_and_walk(text: str) -> BlockKernels:
    """`"partials:mosaic_gpu"` -> `BlockKernels`'s `sums` and (after the colon) `walk`."""
    summed, _, walk = text.partition(":")
    return BlockKernels(sums=summed, **({"walk": walk} if walk else {}))


def parse_variants(text: str) -> list[tuple[int, int]]:
    """`"64x8,32x4"` -> `[(tile, warps), ...]`."""
    return [tuple(int(x) for x in item.split("x")) for item in text.split(",") if item]


def run(args):
    rows = []
    budget = args.backward_partial_bytes
    for heads, kind, T in itertools.product(head_shapes(args.shapes), args.kinds.split(","), int_list(args.sizes)):
        q, k, v = INPUTS[kind](T, heads=heads)
        B, _, H, K = q.shape
        H_kv, V = k.shape[2], v.shape[-1]
        shape = dict(H=H, H_kv=H_kv)
        per_query = HTreeConfig(top_k=args.top_k, selection_block=1)
        dense_ms = median_ms(dense_fn(per_query), (q, k, v), args.iters)
        pq = jax.jit(lambda q, k, v: htree_attention(q, k, v, per_query, backend="pallas"))
        row = dict(inputs=kind, T=T, **shape, top_k=args.top_k, dense_ms=dense_ms,
                   per_query_ms=median_ms(pq, (q, k, v), args.iters) if args.per_query else None)
        backward = T in int_list(args.backward_sizes)
        if backward:
            row["dense_fwd_bwd_ms"] = median_ms(jax.jit(grad_of_sum(dense_fn(per_query))), (q, k, v), args.iters)
        dense_fwd_bwd_ms = row.get("dense_fwd_bwd_ms")
        print(row, flush=True)
        rows.append(row)
        for source in args.sources.split(","):
            config = HTreeConfig(top_k=args.top_k, selection_block=16, block_source=source)
            full = jax.jit(lambda q, k, v, c=config: htree_attention(q, k, v, c, backend="pallas"))
            select = jax.jit(lambda q, k, v, c=config: blocks_of(q, k, v, c))
            blocks = select(q, k, v)
            flops = merge_flops(blocks, config, T, H // H_kv, K, V)
            row = dict(inputs=kind, T=T, **shape, top_k=args.top_k, source=source, dense_ms=dense_ms,
                       block_ms=median_ms(full, (q, k, v), args.iters),
                       selection_ms=median_ms(select, (q, k, v), args.iters), merge_tflop=flops / 1e12)
            row["speedup"] = dense_ms / row["block_ms"]
            for tile, warps in parse_variants(args.variants):
                merge = jax.jit(lambda q, k, v, s, c=config, t=tile, w=warps:
                                block_forward_pallas(q, k, v, s, config=c, block=BlockConfig(merge_tile=t,
                                                                                   merge_num_warps=w))[0])
                try:
                    ms = median_ms(merge, (q, k, v, blocks), args.iters)
                    row[f"merge_{tile}x{warps}_ms"] = ms
                    row[f"merge_{tile}x{warps}_tflops"] = flops / ms / 1e9
                except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported
                    row[f"merge_{tile}x{warps}_ms"] = f"{type(e).__name__}: {str(e)[:120]}"
            if backward:
                o, lse = block_forward_pallas(q, k, v, blocks, config=config)
                for (tile, warps), summed in itertools.product(parse_variants(args.backward_variants),
                                                               args.backward_sums.split(",")):
                    key = f"backward_{tile}x{warps}" + ("" if summed == "atomics" else "_" + summed.replace(":", "_"))
                    sums = sum_and_walk(summed)
                    grads = jax.jit(lambda q, k, v, o, lse, s, c=config, t=tile, w=warps, m=sums:
                                    block_backward_pallas(q, k, v, o, lse, o, s, config=c, kernels=m,
                                                          block=BlockConfig(backward_tile=t, backward_num_warps=w,
                                                                            backward_partial_bytes=budget)))
                    try:
                        ms = median_ms(grads, (q, k, v, o, lse, blocks), args.iters)
                        row[f"{key}_ms"] = ms
                        row[f"{key}_tflops"] = 2.5 * flops / ms / 1e9
                        row[f"{key}_bitwise"] = bitwise_repeatable(grads, (q, k, v, o, lse, blocks))
                    except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported
                        row[f"{key}_ms"] = f"{type(e).__name__}: {str(e)[:120]}"
                del o, lse
                row["fwd_bwd_ms"] = median_ms(jax.jit(grad_of_sum(full)), (q, k, v), args.iters)
                row["fwd_bwd_speedup"] = dense_fwd_bwd_ms / row["fwd_bwd_ms"]
                for summed in args.backward_sums.split(","):  # the default's sums are the row's own
                    if summed == BlockKernels().sums:
                        continue
                    tuning = KernelConfigs.resolve(None, K, V).with_changes({"block.backward_partial_bytes": budget})
                    step = jax.jit(grad_of_sum(lambda q, k, v, c=config, t=tuning, m=sum_and_walk(summed):
                                               htree_attention(q, k, v, c, backend="pallas", block_sizes=t,
                                                               block_kernels=m)))
                    name = summed.replace(":", "_")
                    row[f"fwd_bwd_{name}_ms"] = median_ms(step, (q, k, v), args.iters)
                    row[f"fwd_bwd_{name}_speedup"] = dense_fwd_bwd_ms / row[f"fwd_bwd_{name}_ms"]
            print(row, flush=True)
            rows.append(row)
            del blocks
        del q, k, v
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter, description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="131072,524288", help="sequence lengths")
    ap.add_argument("--shapes", default="32/4", help="H/H_kv pairs, comma-separated (32/8: G=4 on 8 kv heads)")
    ap.add_argument("--top-k", type=int, default=512)
    ap.add_argument("--sources", default="first,previous", help="block_source values")
    ap.add_argument("--kinds", default="random,correlated", help="input kinds (htree_jax.bench.INPUTS)")
    ap.add_argument("--variants", default="64x8", help="the merge's tile x warps to time apart")
    ap.add_argument("--backward-variants", default="32x8", help="the backward's tile x warps to time apart")
    ap.add_argument("--backward-sums", default="atomics", help="BlockKernels.sums values to time apart, each "
                    "optionally "
                    "':WALK' (BlockKernels.walk: partials:mosaic_gpu, partials:pallas_triton)")
    ap.add_argument("--backward-partial-bytes", type=int, default=BlockConfig().backward_partial_bytes,
                    help="BlockConfig.backward_partial_bytes with --backward-sums partials")
    ap.add_argument("--backward-sizes", default="131072", help="lengths also timed forward+backward")
    ap.add_argument("--per-query", action="store_true", help="also time per-query htree at the same top_k")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu":
        sys.exit("bench_block: needs a CUDA GPU")
    print(run_header("benchmarks/bench_block.py", argv), flush=True)
    rows = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
