"""Forward benchmark: htree (Pallas) vs the JAX reference vs dense cuDNN attention (GPU).

    python -m htree_jax bench [--sizes 8192,32768,131072] [--long 524288]
    python benchmarks/bench_forward.py ...   (the same)

B=1, H=32, H_kv=4, K=V=128, bfloat16, causal. Times are medians of `--iters` runs after
one warm-up; `dense/htree` > 1 means htree is faster. Peak device memory is XLA's
compiled plan (arguments + outputs + temporaries) for each function.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from htree_jax import HTreeConfig, htree_attention
from htree_jax.reference import htree_attention_reference
from htree_jax.rope import rope_absolute

B, H, H_KV, K, V = 1, 32, 4, 128, 128


def int_list(text: str) -> list[int]:
    """A size flag, `"8192,32768"` -> `[8192, 32768]`."""
    return [int(x) for x in text.split(",") if x]


def gpu_header(benchmark: str, setting: str, command: str) -> str:
    """The first line a benchmark prints (date, device, jax, its setting, the command that
    reproduces it); refuses to run off a GPU, where there is nothing to time against."""
    if jax.default_backend() != "gpu":
        raise ValueError(f"the {benchmark} benchmark needs a CUDA GPU (it times cuDNN and the Pallas kernels)")
    return f"# {datetime.date.today()} {jax.devices()[0].device_kind}, jax {jax.__version__}, {setting}; command: {command}"


def median_ms(fn, args, iters):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def planned_gb(fn, args):
    m = jax.jit(fn).lower(*args).compile().memory_analysis()
    if m is None:
        return float("nan")
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    return total / 2**30


def inputs(T, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, T, H, K), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, T, H_KV, K), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, T, H_KV, V), jnp.bfloat16)
    return q, k, v


def dense_fn(config):
    def f(q, k, v):
        qr = rope_absolute(q, config.rope_base).astype(q.dtype)
        kr = rope_absolute(k, config.rope_base).astype(k.dtype)
        return jax.nn.dot_product_attention(qr, kr, v, is_causal=True, implementation="cudnn",
                                            scale=config.score_scale(K))
    return jax.jit(f)


def run(sizes, long_sizes, top_ks, iters, reference_max_t):
    rows = []
    for top_k in top_ks:
        config = HTreeConfig(top_k=top_k)
        # The public entry point, as users call it (input checks, the non-finite guard).
        htree = jax.jit(lambda q, k, v, c=config: htree_attention(q, k, v, c, backend="pallas"))
        ref = jax.jit(lambda q, k, v, c=config: htree_attention_reference(q, k, v, c)[0])
        dense = dense_fn(config)
        for T in sizes + long_sizes:
            args = inputs(T)
            row = dict(T=T, top_k=top_k, layers=config.layer_sizes(T))
            row["htree_ms"] = median_ms(htree, args, iters)
            row["htree_gb"] = planned_gb(htree, args)
            row["ref_ms"] = median_ms(ref, args, max(1, iters // 3)) if T <= reference_max_t else None
            try:
                row["dense_ms"] = median_ms(dense, args, iters)
                row["dense_gb"] = planned_gb(dense, args)
            except Exception as e:  # noqa: BLE001 - report, e.g. out of memory
                row["dense_ms"], row["dense_gb"] = None, None
                print(f"dense T={T}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            rows.append(row)
            print(row, flush=True)
    return rows


def table(rows):
    fmt = lambda x, spec: "-" if x is None else format(x, spec)
    lines = ["| T | top_k | layers | htree pallas ms | reference ms | dense cuDNN ms | dense/htree | htree GB | dense GB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = None if r["dense_ms"] is None else r["dense_ms"] / r["htree_ms"]
        lines.append(
            f"| {r['T']} | {r['top_k']} | {', '.join(map(str, r['layers']))} | {r['htree_ms']:.1f} | "
            f"{fmt(r['ref_ms'], '.1f')} | {fmt(r['dense_ms'], '.1f')} | {fmt(ratio, '.3f')} | "
            f"{r['htree_gb']:.2f} | {fmt(r['dense_gb'], '.2f')} |")
    return "\n".join(lines)


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="8192,32768,131072")
    p.add_argument("--long", default="524288")
    p.add_argument("--top-k", default="512,64")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--reference-max-t", type=int, default=32768)


def run_bench(args, argv=()) -> int:
    print(gpu_header("forward", f"B={B} H={H} H_kv={H_KV} K=V={K} bfloat16",
                     f"python -m htree_jax bench {' '.join(argv)}"))
    rows = run(int_list(args.sizes), int_list(args.long), int_list(args.top_k), args.iters, args.reference_max_t)
    print(table(rows))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench_forward")
    add_bench_arguments(p)
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_bench(p.parse_args(argv), argv)
