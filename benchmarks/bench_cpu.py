"""What a new user on a CPU meets: the default config against dense attention with RoPE
(`jax.nn.dot_product_attention`, XLA's on a CPU), and the first call of an oversized
`top_k` (compilation included), on the local device.

    python benchmarks/bench_cpu.py [--sizes 512,2048] [--iters 5] [--out cpu.json]

At these sizes the default's tree has one layer (`T <= top_k * compression_rate`), which
is causal attention and runs as such (`htree_jax.core.one_layer`). Inputs: B=1, H=8,
H_kv=2, K=V=64, float32, random normals. Prints one markdown table; writes its rows to
`--out`.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from htree_jax import HTreeConfig, htree_attention, rope
from htree_jax.bench import int_list, median_ms, run_header
from htree_jax.cli import DefaultsHelpFormatter

SHAPE = dict(B=1, H=8, H_kv=2, K=64)


def cpu_inputs(T: int, seed: int = 0):
    """`q [1, T, 8, 64]`, `k, v [1, T, 2, 64]` float32 normals."""
    rng = np.random.default_rng(seed)
    B, H, H_kv, K = SHAPE.values()
    return tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((B, T, H, K), (B, T, H_kv, K),
                                                                           (B, T, H_kv, K)))


def rows(sizes, iters: int, oversized_top_k: int) -> list[dict]:
    """`{what, T, htree_ms, dense_ms, htree_over_dense}` per size (medians after a warm-up),
    and the first call's seconds of `top_k=oversized_top_k` at the smallest size."""
    dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(rope(q), rope(k), v, is_causal=True))
    default = jax.jit(lambda q, k, v: htree_attention(q, k, v))
    out = []
    for T in sizes:
        args = cpu_inputs(T)
        h, d = median_ms(default, args, iters), median_ms(dense, args, iters)
        out.append(dict(what="HTreeConfig() against dense with RoPE", T=T, htree_ms=h, dense_ms=d,
                        htree_over_dense=h / d, device=jax.devices()[0].device_kind, jax=jax.__version__))
    T = min(sizes)
    args = cpu_inputs(T)
    tic = time.perf_counter()
    jax.block_until_ready(htree_attention(*args, HTreeConfig(top_k=oversized_top_k)))
    out.append(dict(what=f"first call, top_k={oversized_top_k}", T=T, seconds=time.perf_counter() - tic,
                    device=jax.devices()[0].device_kind, jax=jax.__version__))
    return out


def table(result: list[dict]) -> str:
    lines = ["| what | T | htree | dense | htree / dense |", "|---|---|---|---|---|"]
    for r in result:
        if "seconds" in r:
            lines.append(f"| {r['what']} | {r['T']} | {r['seconds']:.2f} s | | |")
        else:
            lines.append(f"| {r['what']} | {r['T']} | {r['htree_ms']:.1f} ms | {r['dense_ms']:.1f} ms | "
                         f"{r['htree_over_dense']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter, description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int_list, default=[512, 2048], help="sequence lengths")
    p.add_argument("--iters", type=int, default=5, help="timed samples a size")
    p.add_argument("--oversized-top-k", type=int, default=2**20, help="the top_k of the first-call row")
    p.add_argument("--out", default=None, help="a JSON file for the rows")
    a = p.parse_args(argv)
    print(run_header("benchmarks/bench_cpu.py", argv), flush=True)
    result = rows(a.sizes, a.iters, a.oversized_top_k)
    print(table(result), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
