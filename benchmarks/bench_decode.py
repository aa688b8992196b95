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
import itertools
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from htree_jax import HTreeCache, HTreeConfig, build_tree, decode_step
from htree_jax.bench import gpu_header, int_list
from htree_jax.core.bounds import tree_radii

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


def filled_cache(B, ctx, config, lengths):
    """A cache whose tree is `build_tree` of `ctx` random tokens per row, each row at its
    `lengths[b]` (with `strict_causal`, the nodes past a row's length change nothing),
    with the tree's radii under `selection="bound"`."""
    k = jax.random.normal(jax.random.key(0), (B, ctx, H_KV, K), DTYPE)
    v = jax.random.normal(jax.random.key(1), (B, ctx, H_KV, V), DTYPE)
    layers = build_tree(k, v, config)
    keys = tuple(kl for kl, _ in layers)
    radii = tuple(tree_radii(keys, config.compression_rate, config.rope_dim)[1:]) if config.selection == "bound" else ()
    return HTreeCache(keys, tuple(vl for _, vl in layers), jnp.asarray(lengths, jnp.int32), radii)


def start_lengths(B, ctx, steps, repeats, spread: bool):
    """Every row at `ctx - (repeats + 1) * steps - 1`, or (`spread`) uniform in
    `[ctx / 8, that]` (a fixed seed)."""
    top = ctx - (repeats + 1) * steps - 1
    if not spread:
        return np.full((B,), top, np.int32)
    return np.random.default_rng(0).integers(ctx // 8, top + 1, size=B).astype(np.int32)


def htree_case(B, ctx, config, steps, repeats, backend, spread=False):
    """`decode_step` under `jax.jit` with the cache donated."""
    cache = filled_cache(B, ctx, config, start_lengths(B, ctx, steps, repeats, spread))
    q_t = jax.random.normal(jax.random.key(2), (B, H, K), DTYPE)
    k_t = jax.random.normal(jax.random.key(3), (B, H_KV, K), DTYPE)
    v_t = jax.random.normal(jax.random.key(4), (B, H_KV, V), DTYPE)
    fn = jax.jit(lambda c: decode_step(q_t, k_t, v_t, c, config, backend=backend), donate_argnums=0)

    def step(i, c):
        return fn(c)[1]
    ms, _ = per_step_ms(step, cache, steps, repeats)
    return ms


def decode_module(B, ctx, config, backend):
    from flax import nnx

    from htree_jax import HTreeAttention

    m = HTreeAttention(H, H * K, num_kv_heads=H_KV, head_dim=K, config=config, backend=backend, decode=True,
                       dtype=DTYPE, param_dtype=DTYPE, rngs=nnx.Rngs(0))
    m.init_cache(B, ctx)
    return m


def module_case(B, ctx, config, steps, repeats, backend):
    """The same step through `HTreeAttention(decode=True)` (projections included,
    in_features = H * K), the functional nnx way: `nnx.split` once, a jitted step over
    the module's state (donated), `nnx.merge` inside."""
    from flax import nnx

    m = decode_module(B, ctx, config, backend)
    m.cache.set_value(filled_cache(B, ctx, config, start_lengths(B, ctx, steps, repeats, False)))
    graphdef, state = nnx.split(m)
    x = jax.random.normal(jax.random.key(5), (B, 1, H * K), DTYPE)

    @functools.partial(jax.jit, donate_argnums=0)
    def fn(carry):
        module = nnx.merge(graphdef, carry[0])
        y = module(x)  # returned: an output nobody reads would be compiled away
        return nnx.state(module), y

    ms, _ = per_step_ms(lambda i, c: fn(c), (state, jnp.zeros((B, 1, H * K), DTYPE)), steps, repeats)
    return ms


def dense_module_case(B, ctx, steps, repeats):
    """Dense decode with the module's own projections (the same `LinearGeneral` layers,
    the same jitted nnx step): q, k, v projected, k, v written into a `[B, ctx, H_kv,
    K]` cache, cuDNN attention of the one query, the output projection. What the module
    column compares with."""
    from flax import nnx

    m = decode_module(B, 8, HTreeConfig(), "reference")  # only its projections are used
    graphdef, state = nnx.split(m)
    x = jax.random.normal(jax.random.key(5), (B, 1, H * K), DTYPE)
    kc = jax.random.normal(jax.random.key(0), (B, ctx, H_KV, K), DTYPE)
    vc = jax.random.normal(jax.random.key(1), (B, ctx, H_KV, V), DTYPE)
    start = ctx - (repeats + 1) * steps - 1

    @functools.partial(jax.jit, donate_argnums=0)
    def fn(carry):
        state, kc, vc, length, _ = carry
        module = nnx.merge(graphdef, state)
        o, kc, vc = dense_decode(module.query(x), kc, vc, module.key(x), module.value(x), length, "cudnn")
        return nnx.state(module), kc, vc, length + 1, module.out(o)

    carry = (state, kc, vc, jnp.asarray(start, jnp.int32), jnp.zeros((B, 1, H * K), DTYPE))
    ms, _ = per_step_ms(lambda i, c: fn(c), carry, steps, repeats)
    return ms


def dense_decode(q_t, kc, vc, k_t, v_t, length, implementation):
    """Dense decode attention: `k_t, v_t [B, 1, H_kv, D]` written at `length` into the
    `[B, ctx, H_kv, D]` caches, then the one query over the valid keys. Returns
    `(o, kc, vc)`."""
    kc = jax.lax.dynamic_update_slice_in_dim(kc, k_t, length, axis=1)
    vc = jax.lax.dynamic_update_slice_in_dim(vc, v_t, length, axis=1)
    lengths = jnp.full((q_t.shape[0],), length + 1, jnp.int32)
    o = jax.nn.dot_product_attention(q_t, kc, vc, key_value_seq_lengths=lengths, implementation=implementation)
    return o, kc, vc


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
            o, kc, vc = dense_decode(q_t, kc, vc, k_t, v_t, length, implementation)
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
    p.add_argument("--selections", default="mean", help="HTreeConfig.selection rules, comma-separated")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-module", action="store_true", help="skip the HTreeAttention(decode=True) column")
    p.add_argument("--spread", action="store_true",
                   help="also rows at lengths uniform in [ctx/8, ctx] (the pallas backend, batches > 1)")
    args = p.parse_args(argv)
    print(gpu_header("decode", f"H={H} H_kv={H_KV} K=V={K} bfloat16; per-token decode",
                     f"python benchmarks/bench_decode.py {' '.join(sys.argv[1:] if argv is None else argv)}"),
          flush=True)
    parse = int_list
    backends = [b for b in args.backends.split(",") if b]
    extra = ([] if args.no_module else ["module pallas"]) + (["pallas, spread lengths"] if args.spread else [])
    if not args.no_module:
        lines_note = ("module: HTreeAttention(decode=True) with its projections; dense module: the same "
                      "projections around cuDNN decode attention")
        print(lines_note, flush=True)
    columns = [f"htree {b} ms" for b in backends] + [f"htree {e} ms" for e in extra]
    module_cols = [] if args.no_module else ["dense module ms", "dense module/module"]
    lines = ["| context | B | top_k | selection | layers | " + " | ".join(columns) + " | dense ms | dense | "
             + " | ".join(f"dense/{c.split(' ms')[0].removeprefix('htree ')}" for c in columns)
             + "".join(f" | {c}" for c in module_cols) + " |",
             "|---" * (7 + 2 * len(columns) + len(module_cols)) + "|"]
    for B in parse(args.batches):
        for ctx in parse(args.contexts):
            d_ms, impl = dense_case(B, ctx, args.steps, args.repeats)
            dm_ms = None if args.no_module else dense_module_case(B, ctx, args.steps, args.repeats)
            for top_k, selection in itertools.product(parse(args.top_k), args.selections.split(",")):
                config = HTreeConfig(top_k=top_k, selection=selection)
                h_ms = [htree_case(B, ctx, config, args.steps, args.repeats, b) for b in backends]
                if not args.no_module:
                    h_ms.append(module_case(B, ctx, config, args.steps, args.repeats, "pallas"))
                if args.spread:
                    h_ms.append(htree_case(B, ctx, config, args.steps, args.repeats, "pallas", spread=True)
                                if B > 1 else float("nan"))
                lines.append(f"| {ctx} | {B} | {top_k} | {selection} | {', '.join(map(str, config.layer_sizes(ctx)))} | "
                             + " | ".join(f"{x:.3f}" for x in h_ms) + f" | {d_ms:.3f} | {impl} | "
                             + " | ".join(f"{d_ms / x:.2f}" for x in h_ms)
                             + ("" if dm_ms is None else f" | {dm_ms:.3f} | {dm_ms / h_ms[len(backends)]:.2f}")
                             + " |")
                print(lines[-1], flush=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
