"""Context parallelism on one GPU (issue 19): each shard's queries alone, as one device of
a `--shards`-way split along T runs them (`k`, `v` whole, queries at their positions),
forward and forward + backward, to see how unequal the shards' work is; and XLA's
planned memory of one shard's forward + backward at `--plan-T` (the per-device memory of
that split, the all-gather's and reduce-scatter's buffers aside).

    python benchmarks/bench_context_parallel.py [--T 1048576] [--shards 8] [--top-k 64]
                                                [--plan-T 4194304]

B=1, H=32, H_kv=4, K=V=128, bf16, random inputs.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from htree_jax import HTreeConfig
from htree_jax.backends import attend
from htree_jax.bench import grad_of_sum, gpu_header, inputs, median_ms, planned_gb
from htree_jax.cli import DefaultsHelpFormatter


def shard_call(config, grad: bool):
    """A shard's queries at `positions [S]` against every token (one compiled program
    for every shard)."""
    def forward(q_shard, k, v, positions):
        return attend(q_shard, k, v, config, "pallas", None, positions)[0]
    return jax.jit(grad_of_sum(forward) if grad else forward)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    p.add_argument("--T", type=int, default=1048576)
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--top-k", type=int, default=64)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--plan-T", type=int, default=4194304)
    args = p.parse_args(argv)
    print(gpu_header("context parallel", f"B=1 H=32 H_kv=4 K=V=128 bf16 random, top_k={args.top_k}",
                     f"python benchmarks/bench_context_parallel.py {' '.join(sys.argv[1:] if argv is None else argv)}"))
    config = HTreeConfig(top_k=args.top_k, selection_block=1)
    T, n = args.T, args.shards
    S = T // n
    q, k, v = inputs(T)
    print(f"T={T}, {n} shards of {S} queries, layers {config.layer_sizes(T)}")
    print("| shard | queries | forward ms | fwd+bwd ms |\n|---|---|---|---|")
    times = []
    fwd, fwd_bwd = shard_call(config, False), shard_call(config, True)
    for i in range(n):
        shard = (q[:, i * S:(i + 1) * S], k, v, jnp.arange(i * S, (i + 1) * S, dtype=jnp.int32))
        f_ms = median_ms(fwd, shard, args.iters)
        g_ms = median_ms(fwd_bwd, shard, args.iters)
        times.append((f_ms, g_ms))
        print(f"| {i} | {i * S}..{(i + 1) * S - 1} | {f_ms:.1f} | {g_ms:.1f} |", flush=True)
    for name, col in (("forward", 0), ("fwd+bwd", 1)):
        xs = [t[col] for t in times]
        print(f"{name}: slowest shard / mean = {max(xs) / (sum(xs) / n):.3f} (slowest {max(xs):.1f} ms, "
              f"fastest {min(xs):.1f} ms)")
    if args.plan_T:
        Tp, Sp = args.plan_T, args.plan_T // n
        shapes = (jax.ShapeDtypeStruct((1, Sp, 32, 128), jnp.bfloat16),
                  jax.ShapeDtypeStruct((1, Tp, 4, 128), jnp.bfloat16),
                  jax.ShapeDtypeStruct((1, Tp, 4, 128), jnp.bfloat16), jax.ShapeDtypeStruct((Sp,), jnp.int32))
        for name, grad in (("forward", False), ("fwd+bwd", True)):
            gb = planned_gb(shard_call(config, grad), shapes)
            print(f"planned memory of the last shard's {name} at T={Tp} over {n} devices: {gb:.2f} GiB "
                  "(arguments, outputs and temporaries)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
