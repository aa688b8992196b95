"""Decode benchmark (GPU): per-token latency of `htree_jax.decode_step` against dense
decode attention over the same context.

    python benchmarks/bench_decode.py [--contexts 32768,131072,524288] [--batches 1,8] [--top-k 512,64]
                                      [--backends pallas,reference]

B rows, H=32, H_kv=4, K=V=128, bfloat16. Each side runs `--steps` consecutive jitted
steps with its cache donated (updated in place), one new token per row per step, the
context growing from `ctx - steps`; the figure is the median over `--repeats` of the
per-step mean. htree: `decode_step` (tree update + walk), per `--backends` (the Pallas
decode kernels, the JAX reference walk). Dense: write the token into a
`[B, ctx, H_kv, K]` cache and `jax.nn.dot_product_attention` of the one query over the
valid keys (cuDNN where it takes the shapes, else XLA). The htree cache is filled by
`build_tree` of random keys (a prefill of 512K tokens with the reference walk would take
long); with `strict_causal` the nodes past the current length change nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from htree_jax import HTreeCache, HTreeConfig, build_tree, decode_step
from htree_jax.bench import gpu_header, int_list

H, H_KV, K, V = 32, 4, 128, 128
DTYPE = jnp.bfloat16


def per_step_ms(step, state, steps: int, repeats: int):
    """Median over `repeats` of the mean time of `steps` consecutive calls; `step(i, state)
    -> state` consumes (donates) the state it is given."""
    state = jax.block_until_ready(step(0, state))  # compile, warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(steps):
            state = step(i, state)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - start) * 1e3 / steps)
    return statistics.median(times), state


def htree_case(B, ctx, config, steps, repeats, check_length, backend):
    key = jax.random.key(0)
    k = jax.random.normal(key, (B, ctx, H_KV, K), DTYPE)
    v = jax.random.normal(jax.random.key(1), (B, ctx, H_KV, V), DTYPE)
    layers = build_tree(k, v, config)
    del k, v
    start = ctx - (repeats + 1) * steps - 1
    cache = HTreeCache(tuple(kl for kl, _ in layers), tuple(vl for _, vl in layers), jnp.asarray(start, jnp.int32))
    q_t = jax.random.normal(jax.random.key(2), (B, H, K), DTYPE)
    k_t = jax.random.normal(jax.random.key(3), (B, H_KV, K), DTYPE)
    v_t = jax.random.normal(jax.random.key(4), (B, H_KV, V), DTYPE)
    fn = jax.jit(lambda c: decode_step(q_t, k_t, v_t, c, config, backend=backend, check_length=check_length), donate_argnums=0)

    def step(i, c):
        return fn(c)[1]

    ms, _ = per_step_ms(step, cache, steps, repeats)
    return ms


def dense_case(B, ctx, steps, repeats):
    kc = jax.random.normal(jax.random.key(0), (B, ctx, H_KV, K), DTYPE)
    vc = jax.random.normal(jax.random.key(1), (B, ctx, H_KV, V), DTYPE)
    q_t = jax.random.normal(jax.random.key(2), (B, 1, H, K), DTYPE)
    k_t = jax.random.normal(jax.random.key(3), (B, 1, H_KV, K), DTYPE)
    v_t = jax.random.normal(jax.random.key(4), (B, 1, H_KV, V), DTYPE)
    start = ctx - (repeats + 1) * steps - 1

    def make(implementation):
        def fn(state):
            kc, vc, length = state
            kc = jax.lax.dynamic_update_slice_in_dim(kc, k_t, length, axis=1)
            vc = jax.lax.dynamic_update_slice_in_dim(vc, v_t, length, axis=1)
            lengths = jnp.full((B,), length + 1, jnp.int32)
            o = jax.nn.dot_product_attention(q_t, kc, vc, key_value_seq_lengths=lengths,
                                             implementation=implementation)
            return (kc, vc, length + 1), o
        return jax.jit(fn, donate_argnums=0)

    for implementation in ("cudnn", None):
        try:
            fn = make(implementation)
            state = (kc, vc, jnp.asarray(start, jnp.int32))
            ms, _ = per_step_ms(lambda i, s: fn(s)[0], state, steps, repeats)
            return ms, implementation or "xla"
        except Exception as e:  # noqa: BLE001 - cuDNN refuses some shapes: fall back to XLA
            print(f"dense B={B} ctx={ctx} {implementation}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            kc = jax.random.normal(jax.random.key(0), (B, ctx, H_KV, K), DTYPE)
            vc = jax.random.normal(jax.random.key(1), (B, ctx, H_KV, V), DTYPE)
    return float("nan"), "-"


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--contexts", default="32768,131072,524288")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--top-k", default="512,64")
    p.add_argument("--backends", default="pallas,reference")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-length-check", action="store_true", help="decode_step(check_length=False)")
    args = p.parse_args(argv)
    print(gpu_header("decode", f"H={H} H_kv={H_KV} K=V={K} bfloat16; per-token decode",
                     f"python benchmarks/bench_decode.py {' '.join(sys.argv[1:] if argv is None else argv)}"),
          flush=True)
    parse = int_list
    backends = [b for b in args.backends.split(",") if b]
    lines = ["| context | B | top_k | layers | " + " | ".join(f"htree {b} ms" for b in backends)
             + " | dense ms | dense | " + " | ".join(f"dense/{b}" for b in backends) + " |",
             "|---" * (6 + 2 * len(backends)) + "|"]
    for B in parse(args.batches):
        for ctx in parse(args.contexts):
            d_ms, impl = dense_case(B, ctx, args.steps, args.repeats)
            for top_k in parse(args.top_k):
                config = HTreeConfig(top_k=top_k)
                h_ms = [htree_case(B, ctx, config, args.steps, args.repeats, not args.no_length_check, b)
                        for b in backends]
                lines.append(f"| {ctx} | {B} | {top_k} | {', '.join(map(str, config.layer_sizes(ctx)))} | "
                             + " | ".join(f"{x:.3f}" for x in h_ms) + f" | {d_ms:.3f} | {impl} | "
                             + " | ".join(f"{d_ms / x:.2f}" for x in h_ms) + " |")
                print(lines[-1], flush=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
