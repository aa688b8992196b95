"""Where a decode step's time goes (GPU): the per-call figure `bench_decode.py` reports,
against the same steps run inside one jitted `lax.fori_loop` (device time, no host
dispatch per step), the host's dispatch floor (a jitted step that only bumps the lengths
of the same donated cache), and the step's two parts (the tree append alone; the walk
alone), each the same two ways. Dense cuDNN decode beside it, both ways.

    python -m benchmarks.profile --pass decode [--context 131072] [--batches 1,8] [--top-k 64]

Same shapes and cache filling as `bench_decode.py` (H=32, H_kv=4, K=V=128, bf16).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp

from benchmarks.bench_decode import DTYPE, H, H_KV, K, V, dense_decode, filled_cache, per_step_ms, start_lengths
from htree_jax import HTreeConfig, decode_step
from htree_jax.backends import attend_cache
from htree_jax.bench import gpu_header, int_list
from htree_jax.cache import append_to_cache
from htree_jax.cli import DefaultsHelpFormatter


def per_call_and_loop(body, state, steps, repeats):
    """`body(state) -> (state, out)`: ms per step called once per step from the host, and
    ms per step of `steps` steps inside one jitted `fori_loop` (outputs summed so that
    none is compiled away)."""
    one = jax.jit(body, donate_argnums=0)
    per_call, state = per_step_ms(lambda i, s: one(s)[0], state, steps, repeats)

    @functools.partial(jax.jit, donate_argnums=0)
    def loop(carry):
        def step(_, c):
            s, acc = c
            s, out = body(s)
            return s, acc + jnp.sum(out.astype(jnp.float32))
        return jax.lax.fori_loop(0, steps, step, carry)

    in_loop, _ = per_step_ms(lambda i, c: loop(c), (state, jnp.zeros((), jnp.float32)), 1, repeats)
    return per_call, in_loop / steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--top-k", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backend", default="pallas", help="pallas, or pallas_interpret for a CPU smoke run")
    args = p.parse_args(argv)
    header = gpu_header if args.backend == "pallas" else (lambda *a: " ".join(a[1:]))
    print(header("decode profile", f"H={H} H_kv={H_KV} K=V={K} bf16, ctx={args.context}, top_k={args.top_k}",
                     f"python -m benchmarks.profile --pass decode {' '.join(sys.argv[1:] if argv is None else argv)}"),
          flush=True)
    config = HTreeConfig(top_k=args.top_k)
    ctx, steps, repeats = args.context, args.steps, args.repeats
    print("| B | case | per call ms | in one jitted loop ms/step |\n|---|---|---|---|", flush=True)
    for B in int_list(args.batches):
        q_t = jax.random.normal(jax.random.key(2), (B, H, K), DTYPE)
        k_t = jax.random.normal(jax.random.key(3), (B, H_KV, K), DTYPE)
        v_t = jax.random.normal(jax.random.key(4), (B, H_KV, V), DTYPE)
        lengths = start_lengths(B, ctx, steps, 2 * repeats + 3, False)

        def bump(c):
            c = dataclasses.replace(c, lengths=c.lengths + 1)
            return c, c.lengths

        def step(c):
            o, c = decode_step(q_t, k_t, v_t, c, config, backend=args.backend)
            return c, o

        def append(c):
            c = append_to_cache(c, k_t[:, None], v_t[:, None], config, jnp.ones((B,), jnp.int32))
            return c, c.lengths

        def walk(c):  # the cache unchanged: the walk at a fixed length
            o, _ = attend_cache(q_t[:, None], c.tree, c.lengths[:, None] - 1, config, args.backend)
            return c, o

        cases = [("dispatch floor (lengths + 1)", bump), ("decode_step", step), ("tree append only", append),
                 ("walk only (pallas kernels)", walk)]
        for name, body in cases:
            pc, lp = per_call_and_loop(body, filled_cache(B, ctx, config, lengths), steps, repeats)
            print(f"| {B} | {name} | {pc:.4f} | {lp:.4f} |", flush=True)

        kc = jax.random.normal(jax.random.key(0), (B, ctx, H_KV, K), DTYPE)
        vc = jax.random.normal(jax.random.key(1), (B, ctx, H_KV, V), DTYPE)

        def dense(s):
            kc, vc, length = s
            impl = "cudnn" if jax.default_backend() == "gpu" else None
            o, kc, vc = dense_decode(q_t[:, None], kc, vc, k_t[:, None], v_t[:, None], length, impl)
            return (kc, vc, length + 1), o

        pc, lp = per_call_and_loop(dense, (kc, vc, jnp.asarray(int(lengths[0]), jnp.int32)), steps, repeats)
        print(f"| {B} | dense cuDNN | {pc:.4f} | {lp:.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
