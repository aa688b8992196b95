"""Serving one stream (GPU, issue 52): the decode module's steps inside one compiled loop,
htree against dense attention with the same projections, and the launches of one htree
attention step.

    python benchmarks/bench_decode_loop.py [--contexts 131072] [--batches 1,8] [--top-k 64,512]
                                           [--selections mean,bound] [--sources query,first]

H=32, H_kv=4, K=V=128, bf16, random inputs (`bench_decode.filled_cache`'s caches; `--spread`:
ragged rows). Per (context, B):
- the projections alone (the floor under either module's step), in the loop;
- dense module: `bench_decode.dense_module_case`'s step (the module's projections, the token
  written into a `[B, ctx, H_kv, K]` cache, cuDNN attention), `--steps` of them inside one
  jitted `lax.fori_loop` (ms per step: the median over `--repeats` loops / steps), and one
  jitted call per step from the host (`bench_decode.per_step_ms`);
- htree module, per (top_k, selection, source): `HTreeAttention(decode=True)` the same
  two ways, the ratio dense / htree of each, and the kernels a jitted `decode_step`
  launches (the tree append and the walk; `kernel_trace`). `--sources`: `query`
  (per-query selection) and block selection's (SPEC 12, `selection_block=16`) `first` /
  `previous`, whose rows start at a block's first token (`block_start_lengths`), so one
  step in 16 walks the ranking rows and the others keep the cache's selection (with
  `--spread` a step walks where any row starts a block); the kernel trace is of a step
  that keeps it.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.bench_decode import (
    DTYPE,
    H,
    H_KV,
    K,
    V,
    decode_module,
    dense_decode,
    block_start_lengths,
    filled_cache,
    start_lengths,
)
from benchmarks.profiling.decode import per_call_and_loop
from htree_jax import HTreeConfig, decode_step
from htree_jax.bench import gpu_header, int_list
from htree_jax.cli import DefaultsHelpFormatter
from htree_jax.kernel_trace import kernel_times, print_kernel_times


def loop_and_call(body, state, steps: int, repeats: int):
    """`(ms a step inside one jitted fori_loop of `steps`, ms a step called once per
    step)` of `body(state) -> (state, y)` (`benchmarks.profiling.decode.per_call_and_loop`)."""
    per_call, in_loop = per_call_and_loop(body, state, steps, repeats)
    return in_loop, per_call


def module_body(graphdef, x):
    def body(state):
        module = nnx.merge(graphdef, state)
        y = module(x)
        return nnx.state(module), y
    return body


def htree_module_state(B, ctx, config, lengths):
    m = decode_module(B, ctx, config, "pallas")
    m.cache.set_value(filled_cache(B, ctx, config, lengths))
    return nnx.split(m)


def dense_module_state(B, ctx, start):
    """The dense module's state: the htree module's projections, `[B, ctx, H_kv, K]` caches."""
    m = decode_module(B, 8, HTreeConfig(), "reference")  # only its projections are used
    graphdef, state = nnx.split(m)
    kc = jax.random.normal(jax.random.key(0), (B, ctx, H_KV, K), DTYPE)
    vc = jax.random.normal(jax.random.key(1), (B, ctx, H_KV, V), DTYPE)
    return graphdef, (state, kc, vc, jnp.asarray(start, jnp.int32))


def projections_body(graphdef, x):
    """The module's four projections alone (the query's projection stands in for the
    attention's output): what neither attention's time includes."""
    def body(carry):
        state, kc, vc, length = carry
        module = nnx.merge(graphdef, state)
        k, v = module.key(x), module.value(x)
        y = module.out(module.query(x)) + jnp.sum(k) + jnp.sum(v)
        return (nnx.state(module), kc, vc, length + 1), y
    return body


def dense_body(graphdef, x):
    def body(carry):
        state, kc, vc, length = carry
        module = nnx.merge(graphdef, state)
        o, kc, vc = dense_decode(module.query(x), kc, vc, module.key(x), module.value(x), length, "cudnn")
        return (nnx.state(module), kc, vc, length + 1), module.out(o)
    return body


def step_launches(B, ctx, config, lengths, show: bool):
    """Launches (and us of kernels) per jitted `decode_step` (append + walk) from a trace
    of the five steps after a first (with block selection, rows at a block's start: the
    first walks the ranking rows, the five traced keep the cache's selection)."""
    q_t = jax.random.normal(jax.random.key(2), (B, H, K), DTYPE)
    k_t = jax.random.normal(jax.random.key(3), (B, H_KV, K), DTYPE)
    v_t = jax.random.normal(jax.random.key(4), (B, H_KV, V), DTYPE)
    fn = jax.jit(lambda c: decode_step(q_t, k_t, v_t, c, config, backend="pallas"),
                 donate_argnums=0)
    held = [filled_cache(B, ctx, config, lengths)]

    def call():
        o, held[0] = fn(held[0])
        return o

    jax.block_until_ready(call())
    times = kernel_times(call, 5)
    if show:
        print_kernel_times(times, f"decode_step B={B} ctx={ctx} top_k={config.top_k} {config.selection}", top=40)
    return sum(n for _, n in times.values()), sum(t for t, _ in times.values())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    p.add_argument("--contexts", default="131072")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--top-k", default="64,512")
    p.add_argument("--selections", default="mean,bound")
    p.add_argument("--sources", default="query", help="query (per-query selection), first, previous")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--spread", action="store_true", help="ragged rows (`bench_decode.start_lengths`)")
    p.add_argument("--show-kernels", action="store_true", help="print each traced step's kernels")
    args = p.parse_args(argv)
    print(gpu_header("decode module loop", f"H={H} H_kv={H_KV} K=V={K} bf16 random",
                     f"python benchmarks/bench_decode_loop.py {' '.join(sys.argv[1:] if argv is None else argv)}"),
          flush=True)
    print("| ctx | B | top_k | selection | source | htree loop ms/step | dense loop ms/step | dense / htree (loop) | "
          "htree call ms | dense call ms | dense / htree (call) | launches per decode_step | kernel us |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    steps, repeats = args.steps, args.repeats
    for ctx in int_list(args.contexts):
        for B in int_list(args.batches):
            lengths = start_lengths(B, ctx, steps, 2 * repeats + 2, args.spread)
            x = jax.random.normal(jax.random.key(5), (B, 1, H * K), DTYPE)
            graphdef, state = dense_module_state(B, 8, 0)
            floor, _ = loop_and_call(projections_body(graphdef, x), state, steps, repeats)
            graphdef, state = dense_module_state(B, ctx, int(lengths.max()))
            dense_loop, dense_call = loop_and_call(dense_body(graphdef, x), state, steps, repeats)
            print(f"ctx {ctx}, B {B}: the module's projections alone {floor:.4f} ms/step in the loop", flush=True)
            for top_k in int_list(args.top_k):
                for selection, source in itertools.product(args.selections.split(","), args.sources.split(",")):
                    block = dict(selection_block=1) if source == "query" else dict(selection_block=16, block_source=source)
                    config = HTreeConfig(top_k=top_k, selection=selection, **block)
                    rows = block_start_lengths(lengths, config)
                    graphdef, state = htree_module_state(B, ctx, config, rows)
                    loop_ms, call_ms = loop_and_call(module_body(graphdef, x), state, steps, repeats)
                    launches, us = step_launches(B, ctx, config, rows, args.show_kernels)
                    print(f"| {ctx} | {B} | {top_k} | {selection} | {source} | {loop_ms:.4f} | {dense_loop:.4f} | "
                          f"{dense_loop / loop_ms:.2f} | {call_ms:.4f} | {dense_call:.4f} | "
                          f"{dense_call / call_ms:.2f} | {launches:.0f} | {us:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
