"""Where a one-layer tree's time goes (GPU): htree (`T <= top_k * compression_rate`, RoPE
then cuDNN under SPEC 10's guard) against dense cuDNN with RoPE, forward and
forward+backward, each kernel's device time from a profiler trace.

    python -m benchmarks.profile --pass one-layer [--sizes 4096,8192] [--batch 1,4]

B rows, H=32, H_kv=4, K=V=128, bfloat16, `top_k=512`, random inputs.
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from benchmarks.bench_backward import grad_fn
from htree_jax import HTreeConfig, htree_attention
from htree_jax.bench import H, V, dense_fn, gpu_header, inputs, int_list, median_ms
from htree_jax.cli import DefaultsHelpFormatter
from htree_jax.kernel_trace import kernel_times, print_kernel_times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    p.add_argument("--sizes", default="4096,8192", help="sequence lengths T, comma-separated")
    p.add_argument("--batch", default="1,4", help="batch sizes B, comma-separated")
    p.add_argument("--steps", type=int, default=5, help="profiled calls per function")
    args = p.parse_args(argv)
    print(gpu_header("one layer", "H=32 H_kv=4 K=V=128 bfloat16 top_k=512, random inputs",
                     f"python -m benchmarks.profile --pass one-layer {' '.join(sys.argv[1:] if argv is None else argv)}"))
    config = HTreeConfig(top_k=512)
    htree = jax.jit(lambda q, k, v: htree_attention(q, k, v, config, backend="pallas"))
    dense = dense_fn(config)
    fns = {"htree fwd": htree, "dense fwd": dense, "htree fwd+bwd": grad_fn(htree), "dense fwd+bwd": grad_fn(dense)}
    for B in int_list(args.batch):
        for T in int_list(args.sizes):
            q, k, v = inputs(T, batch=B)
            w = jax.random.normal(jax.random.key(1), (B, T, H, V), jnp.float32)
            for name, fn in fns.items():
                call = (q, k, v, w) if "bwd" in name else (q, k, v)
                ms = median_ms(fn, call, 9)
                print_kernel_times(kernel_times(lambda: fn(*call), args.steps), f"B={B} T={T} {name}: {ms:.3f} ms "
                                   "per call (host-timed median)", top=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
