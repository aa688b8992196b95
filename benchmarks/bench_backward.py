"""Forward+backward benchmark (GPU): htree (Pallas) vs dense cuDNN attention.

    python benchmarks/bench_backward.py [--sizes 8192,32768,131072] [--long ""] [--top-k 512,64] [--inputs both]

Times `jax.grad` (w.r.t. q, k, v) of `sum(o * w)` for each, same configs as the forward
benchmark (B=1 unless --batch, H=32, H_kv=4, K=V=128, bfloat16): medians after one warm-up, the ratio
`dense_ms / htree_ms` (> 1: htree faster) and XLA's planned peak memory.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from htree_jax import HTreeConfig, htree_attention
from htree_jax.backends import kernel_route
from htree_jax.bench import (
    B,
    H,
    H_KV,
    INPUTS,
    K,
    V,
    dense_fn,
    gpu_header,
    input_kinds,
    inputs_setting,
    int_list,
    median_ms,
    planned_gb,
)
from htree_jax.cli import DefaultsHelpFormatter
from htree_jax.kernel_trace import kernel_times, print_kernel_times


def grad_fn(forward, cotangent: str = "weights"):
    """`weights`: `jax.grad` of `sum(o * w)`, `w` float32; `bf16`: the vjp of `o` with a
    bfloat16 cotangent passed in (what a training step sends through attention)."""
    if cotangent == "bf16":
        def step(q, k, v, do):
            return jax.vjp(forward, q, k, v)[1](do)
        return jax.jit(step)

    def loss(q, k, v, w):
        return jnp.sum(forward(q, k, v).astype(jnp.float32) * w)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def kernels_fn(config, save_selections: bool):
    """The Pallas forward then backward, called directly (no SPEC 10 guard), the
    backward given the forward's selections or recomputing them."""
    def step(q, k, v, do):
        route = kernel_route(q, k, v, config)
        o, selected, lse = route.forward(q, k, v, config=config, return_lse=True)
        return route.backward(q, k, v, o, lse, do, config=config, selections=selected if save_selections else None)
    return jax.jit(step)


def peak_gib():
    """The device's peak memory in use so far in this process, GiB."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use", float("nan")) / 2**30


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    p.add_argument("--sizes", default="8192,32768,131072", help="sequence lengths T, comma-separated")
    p.add_argument("--long", default="", help="more lengths, comma-separated, after --sizes")
    p.add_argument("--top-k", default="512,64", help="HTreeConfig.top_k values, comma-separated")
    p.add_argument("--iters", type=int, default=3, help="timed calls per measurement after one warm-up (median)")
    p.add_argument("--batch", type=int, default=B, help=f"batch rows B (default {B})")
    p.add_argument("--inputs", default="random", help="random, correlated (htree_jax.bench.correlated_inputs) or both")
    p.add_argument("--cotangent", default="weights", choices=["weights", "bf16"],
                   help="weights: grad of sum(o * w), w float32; bf16: vjp with a bfloat16 cotangent argument")
    p.add_argument("--no-dense", action="store_true", help="htree only (e.g. T=1M, where dense takes a minute)")
    p.add_argument("--rules", default="bound", help="HTreeConfig.selection rules, comma-separated (bound, mean)")
    p.add_argument("--kernels", action="store_true",
                   help="also each kernel's device time in the htree call (a profiler trace; htree_jax.kernel_trace)")
    p.add_argument("--selections", action="store_true",
                   help="also time the kernels alone, the backward given / recomputing the forward's selections")
    args = p.parse_args(argv)
    kinds = input_kinds(args.inputs)
    print(gpu_header("backward", f"B={args.batch} H={H} H_kv={H_KV} K=V={K} bfloat16, {inputs_setting(kinds)}; forward+backward",
                     f"python benchmarks/bench_backward.py {' '.join(sys.argv[1:] if argv is None else argv)}"),
          flush=True)
    parse = int_list
    lines = [f"cotangent: {args.cotangent}",
             "| inputs | T | top_k | layers | htree fwd+bwd ms | dense cuDNN fwd+bwd ms | dense/htree | htree GB | "
             "dense GB | device peak GiB so far |", "|---|---|---|---|---|---|---|---|---|---|"]
    rules = [x for x in args.rules.split(",") if x]
    dense_measured = {}
    for kind, top_k, rule in [(kind, top_k, rule) for kind in kinds for top_k in parse(args.top_k) for rule in rules]:
        config = HTreeConfig(top_k=top_k, selection=rule, selection_block=1)
        htree = grad_fn(lambda q, k, v, c=config: htree_attention(q, k, v, c, backend="pallas"), args.cotangent)
        dense = grad_fn(dense_fn(config), args.cotangent)
        label = f"{top_k}" + ("" if rule == "mean" else f" {rule}")
        for T in parse(args.sizes) + parse(args.long):
            q, k, v = INPUTS[kind](T, batch=args.batch)
            w = jax.random.normal(jax.random.key(1), (args.batch, T, H, V),
                                  jnp.bfloat16 if args.cotangent == "bf16" else jnp.float32)
            h_ms, h_gb = median_ms(htree, (q, k, v, w), args.iters), planned_gb(htree, (q, k, v, w))
            peak = peak_gib()
            try:
                if args.no_dense:
                    raise RuntimeError("--no-dense")
                if (kind, T) not in dense_measured:  # once for every top_k and rule (dense has neither)
                    dense_measured[kind, T] = (median_ms(dense, (q, k, v, w), args.iters),
                                                      planned_gb(dense, (q, k, v, w)))
                d_ms, d_gb = dense_measured[kind, T]
                ratio = f"{d_ms / h_ms:.3f}"
            except Exception as e:  # noqa: BLE001 - report, e.g. out of memory
                d_ms = d_gb = float("nan")
                ratio = "-"
                print(f"dense T={T}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            lines.append(f"| {kind} | {T} | {label} | {', '.join(map(str, config.layer_sizes(T)))} | {h_ms:.1f} | "
                         f"{d_ms:.1f} | {ratio} | {h_gb:.2f} | {d_gb:.2f} | {peak:.1f} |")
            print(lines[-1], flush=True)
            if args.kernels:
                print_kernel_times(kernel_times(lambda: htree(q, k, v, w), 2), f"{kind} T={T} top_k={label}: "
                                   "the htree forward+backward's kernels", top=16)
            if args.selections:
                do = w.astype(q.dtype)
                for save in (True, False):
                    fn = kernels_fn(config, save)
                    ms, gb = median_ms(fn, (q, k, v, do), args.iters), planned_gb(fn, (q, k, v, do))
                    lines.append(f"| {kind} | {T} | {top_k} | kernels only, selections "
                                 f"{'saved' if save else 'recomputed'} | {ms:.1f} | | | {gb:.2f} | | |")
                    print(lines[-1], flush=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
