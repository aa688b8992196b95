"""Block selection's one-launch decode step (`pallas_kernels/decode/kept.py`) alone, by
its launch shape, beside the decode walk keeping the same selection and dense decode
attention (cuDNN) over the same context (GPU).

    python benchmarks/bench_kept_step.py [--context 131072] [--batches 1,8] [--top-k 512]
                                         [--spans 64,128] [--stages 1,2,3] [--warps 4]
                                         [--targets 512]

H=32, H_kv=4, K=V=128, bf16, random tokens (`bench_decode.filled_cache`), rows at a block's
start plus one; the selections a walk of random ranking rows made at the block's start.
Attention only (no append, no projections): ms a call, the median of `--repeats` means
of `--calls` calls after a warm-up, and the kept step's bytes (keys and values of every
layer's candidate buffer) over its time.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_decode import DTYPE, H, H_KV, K, V, block_start_lengths, filled_cache
from htree_jax import DecodeBlockSizes, HTreeConfig
from htree_jax.bench import gpu_header, int_list
from htree_jax.cli import DefaultsHelpFormatter
from htree_jax.core.tree import CacheTree
from pallas_kernels.decode.kept import kept_step_pallas
from pallas_kernels.decode.walk import attend_cache_pallas


def call_ms(fn, calls: int, repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) * 1e3 / calls)
    return statistics.median(times)


def candidate_bytes(config: HTreeConfig, ctx: int, B: int) -> int:
    """Keys and values of every layer's candidate buffer a query reads (upper bound:
    `min(N_l, top_k * r)` candidates a layer), all rows and kv heads."""
    sizes = config.layer_sizes(ctx)
    per_row = sum(min(n, config.max_candidates) for n in sizes)
    return per_row * B * H_KV * (K + V) * jnp.dtype(DTYPE).itemsize


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--top-k", default="512")
    p.add_argument("--spans", default="64,128")
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--warps", default="4")
    p.add_argument("--targets", default="512")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    print(gpu_header("kept decode step", f"H={H} H_kv={H_KV} K=V={K} bf16 random, ctx={args.context}",
                     f"python benchmarks/bench_kept_step.py {' '.join(sys.argv[1:] if argv is None else argv)}"),
          flush=True)
    print("| B | top_k | what | span | stages | warps | target | ms | TB/s |\n|---|---|---|---|---|---|---|---|---|",
          flush=True)
    ctx = args.context
    for B, top_k in itertools.product(int_list(args.batches), int_list(args.top_k)):
        config = HTreeConfig(top_k=top_k, selection_block=16)
        lengths = block_start_lengths(np.full((B,), ctx - 64, np.int32), config)
        cache = filled_cache(B, ctx, config, lengths)
        starts = jnp.asarray(lengths, jnp.int32)
        ranking = jax.random.normal(jax.random.key(8), (B, 1, H, K), DTYPE)
        q = jax.random.normal(jax.random.key(9), (B, H, K), DTYPE)
        # Every array a jitted call reads is its argument: captured, the cache's 2 GB would be
        # compiled in as constants (minutes a compile).
        walk = jax.jit(lambda q, keys, values, radii, positions, chosen: attend_cache_pallas(
            q, CacheTree(keys, values, radii), positions, config, zero_unmerged=False, chosen=chosen))
        _, kept = walk(ranking, cache.keys, cache.values, cache.radii, starts[:, None], ())
        kept = tuple(x[:, 0] for x in kept)
        positions = starts + 1
        total = candidate_bytes(config, ctx, B)
        chosen = tuple(x[:, None] for x in kept)
        ms = call_ms(lambda: walk(q[:, None], cache.keys, cache.values, cache.radii, positions[:, None], chosen)[0],
                     args.calls, args.repeats)
        print(f"| {B} | {top_k} | walk keeping it | | | | | {ms:.4f} | {total / ms / 1e9:.2f} |", flush=True)
        lengths_d = jnp.full((B,), ctx - 63, jnp.int32)
        kc = jax.random.normal(jax.random.key(0), (B, ctx, H_KV, K), DTYPE)
        vc = jax.random.normal(jax.random.key(1), (B, ctx, H_KV, V), DTYPE)
        dense = jax.jit(lambda q, kc, vc, lengths: jax.nn.dot_product_attention(
            q[:, None], kc, vc, key_value_seq_lengths=lengths, implementation="cudnn"))
        ms = call_ms(lambda: dense(q, kc, vc, lengths_d), args.calls, args.repeats)
        dense_bytes = B * ctx * H_KV * (K + V) * jnp.dtype(DTYPE).itemsize
        print(f"| {B} | {top_k} | dense cuDNN | | | | | {ms:.4f} | {dense_bytes / ms / 1e9:.2f} |", flush=True)
        for span, stages, warps, target in itertools.product(int_list(args.spans), int_list(args.stages),
                                                             int_list(args.warps), int_list(args.targets)):
            sizes = DecodeBlockSizes(span=span, kept_num_stages=stages, num_warps=warps, target_programs=target)
            step = jax.jit(lambda q, keys, values, positions, kept, sizes=sizes: kept_step_pallas(
                q, keys, values, positions, kept, config, sizes))
            try:
                ms = call_ms(lambda: step(q, cache.keys, cache.values, positions, kept), args.calls, args.repeats)
            except Exception as e:  # a launch shape that does not fit: say so, go on
                print(f"| {B} | {top_k} | kept step | {span} | {stages} | {warps} | {target} | failed: "
                      f"{str(e).splitlines()[0][:80]} | |", flush=True)
                continue
            print(f"| {B} | {top_k} | kept step | {span} | {stages} | {warps} | {target} | {ms:.4f} | "
                  f"{total / ms / 1e9:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
