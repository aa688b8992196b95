"""Where the latent-attention (MLA) forward stands: launch variants of the wide-head
block sizes, the plain-bfloat16 importance operands, and the top layer alone (`L = 1`:
the flash-shaped merge kernel over 16-row virtual heads), at one size.

    python -m benchmarks.probe_mla [--T 8192] [--top-k 64] [--iters 2]

Prints forward medians (ms) with the counted FLOPs of each run's products, so the rate
the kernels reach (TFLOP/s) stands beside the 600 TFLOP/s of the ideal dense time.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax

from htree_jax import HTreeConfig
from htree_jax.bench import MLA, ideal_dense_ms, median_ms, mla_inputs
from pallas_kernels.backward import htree_backward_pallas
from pallas_kernels.forward import htree_forward_pallas
from pallas_kernels.plan import BlockSizes
from pallas_kernels.precision import Precisions


def product_flops(T: int, config: HTreeConfig, K: int, V: int, importance_products: int = 3) -> float:
    """The forward's products, counted per query and head over the mean candidate
    counts (the top layer: `t / r^(L-1) + 1` on average `N_top / 2`; below it `top_k * r`
    each): the top layer's two importance passes and its merge (scores, values), the
    selecting layers' importance pass (scores stored) and merge (values), the bottom's
    merge (scores, values). `importance_products`: 3 for BF16X3, 1 for plain bf16."""
    sizes = config.layer_sizes(T)
    L, H = len(sizes), MLA["H"]
    below = config.top_k * config.compression_rate
    top_n = sizes[-1] / 2
    macs = top_n * (K + V if L == 1 else 2 * importance_products * K + K + V)
    for l in range(1, L - 1):
        macs += below * (importance_products * K + V)
    if L > 1:
        macs += below * (K + V)
    return 2.0 * macs * T * H


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--top-k", type=int, default=64)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--backward", action="store_true", help="also time the backward of each variant")
    p.add_argument("--set", default="single", choices=["single", "stages", "fit"],
                   help="single: one change at a time; stages: the changes combined with 2-3 pipeline stages")
    args = p.parse_args(argv)
    T = args.T
    q, k, v = mla_inputs(T)
    # The single-change set starts from the first wide defaults (16-candidate tiles, one
    # stage); `for_dims` now holds the winner of the `stages` set.
    wide = dataclasses.replace(BlockSizes.for_dims(MLA["K"], MLA["V"]), span=16, tile=16, num_stages=1,
                               top_keys_stages=1)
    base = Precisions.for_dtype(q.dtype)
    variants = [
        ("wide defaults", wide, base, args.top_k),
        ("8 warps everywhere", dataclasses.replace(wide, num_warps=8, merge_num_warps=8, scored_merge_num_warps=8,
                                                   top_num_warps=8), base, args.top_k),
        ("span = tile = 32", dataclasses.replace(wide, span=32, tile=32), base, args.top_k),
        ("top layer: 32 rows, tile 32", dataclasses.replace(wide, top_rows=32, top_tile=32, top_keys_tile=32),
         base, args.top_k),
        ("2 pipeline stages", dataclasses.replace(wide, num_stages=2, top_keys_stages=2), base, args.top_k),
        ("plain bf16 importance operands", wide, dataclasses.replace(base, importance_operands="bfloat16"),
         args.top_k),
        ("top layer alone (L = 1, top_k = T/16)", wide, base, max(args.top_k, T // 16)),
    ]
    if args.set == "stages":
        two = dataclasses.replace(wide, num_stages=2, top_keys_stages=2)
        variants = [
            ("2 stages", two, base, args.top_k),
            ("2 stages, span = tile = 32", dataclasses.replace(two, span=32, tile=32), base, args.top_k),
            ("2 stages, span 32, tile 64", dataclasses.replace(two, span=32, tile=64), base, args.top_k),
            ("3 stages", dataclasses.replace(wide, num_stages=3, top_keys_stages=3), base, args.top_k),
            ("2 stages, 2 warps per query", dataclasses.replace(two, num_warps=2, merge_num_warps=2,
                                                                scored_merge_num_warps=2), base, args.top_k),
            ("2 stages, plain bf16 importance", two, dataclasses.replace(base, importance_operands="bfloat16"),
             args.top_k),
        ]
    if args.set == "fit":  # what fits shared memory where a middle layer selects (L >= 3)
        two = dataclasses.replace(wide, num_stages=2, top_keys_stages=2)
        variants = [
            ("2 stages, span = tile = 32", dataclasses.replace(two, span=32, tile=32), base, args.top_k),
            ("top keys 2 stages, others 1, span 32", dataclasses.replace(two, span=32, tile=32, num_stages=1),
             base, args.top_k),
            ("2 stages, span = tile = 16", two, base, args.top_k),
            ("top keys 2 stages, others 1, span 16", dataclasses.replace(two, num_stages=1), base, args.top_k),
        ]
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, MLA {MLA}, bf16 random, T={T}; "
          f"ideal dense forward {ideal_dense_ms(T):.1f} ms at 600 TFLOP/s")
    print("| variant | top_k | layers | forward ms | counted TFLOP | TFLOP/s | ideal dense / htree |\n|---|---|---|---|---|---|---|")
    for name, bs, prec, top_k in variants:
        config = HTreeConfig(top_k=top_k, rope_dim=MLA["rope_dim"])
        fn = jax.jit(lambda q, k, v, c=config, bs=bs, prec=prec: htree_forward_pallas(q, k, v, c, bs,
                                                                                     precisions=prec)[0])
        t0 = time.perf_counter()
        try:
            ms = median_ms(fn, (q, k, v), args.iters)
        except Exception as e:  # noqa: BLE001 - a launch that does not fit: report it, go on
            print(f"| {name} | {top_k} | - | failed: {type(e).__name__}: {str(e)[:120]} | | | |", flush=True)
            continue
        products = 1 if prec.importance_operands == "bfloat16" else 3
        flops = product_flops(T, config, 1024, MLA["V"], products)  # K as the kernels run it: padded to 1024
        print(f"| {name} | {top_k} | {config.layer_sizes(T)} | {ms:.1f} | {flops / 1e12:.2f} | "
              f"{flops / ms / 1e9:.1f} | {ideal_dense_ms(T) / ms:.4f} |  (with compile {time.perf_counter() - t0:.0f} s)",
              flush=True)
        if args.backward:  # does the backward compile and run with these sizes?
            o, _, lse = htree_forward_pallas(q, k, v, config, bs, precisions=prec, return_lse=True)
            try:
                bwd = jax.jit(lambda q, k, v, o, lse, c=config, bs=bs: htree_backward_pallas(q, k, v, o, lse, o, c, bs))
                b_ms = median_ms(bwd, (q, k, v, o, lse), args.iters)
                print(f"|   backward | | | {b_ms:.1f} | | | |", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"|   backward | | | failed: {type(e).__name__}: {str(e)[:120]} | | | |", flush=True)


if __name__ == "__main__":
    main()
