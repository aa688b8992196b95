"""The sharded paths on several real GPUs (issue 22): batch sharding's scaling and
context parallelism, through the public `htree_attention` under `jax.jit` with
`NamedSharding` inputs (the custom-partitioned forward and backward,
`htree_jax/sharding.py`).

    NCCL_NVLS_ENABLE=0 python benchmarks/bench_multi_gpu.py [--T 131072] [--top-k 512,64]
        [--cp-T 1048576,2097152] [--iters 3]

- Batch: forward + backward (gradient of a float32 sum), bf16, H=32, H_kv=4, K=V=128,
  B = N rows sharded one per GPU, against B = 1 on one GPU (the unsharded call): scaling
  efficiency = time on 1 GPU / time on N; dense cuDNN the same way.
- Context parallelism (`top_k` 64): T sharded over the N GPUs, forward + backward,
  time and every device's peak memory (`memory_stats`), and one GPU's time where it fits.
- The compiled HLO of each sharded run: collectives, and whether any all-gather carries
  q's shard (it must not).
"""

from __future__ import annotations

import argparse
import re
import sys

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from htree_jax import HTreeConfig, htree_attention
from htree_jax.backends import attend
from htree_jax.bench import dense_fn, gpu_header, grad_of_sum, int_list, median_ms

H, H_KV, K, V = 32, 4, 128, 128


def make_inputs(B: int, T: int, seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (B, T, H, K), jnp.bfloat16),
            jax.random.normal(ks[1], (B, T, H_KV, K), jnp.bfloat16),
            jax.random.normal(ks[2], (B, T, H_KV, V), jnp.bfloat16))


def collectives(fn, args) -> str:
    """The compiled program's collective ops, counted, and whether an all-gather's
    operand has q's per-device shape."""
    text = fn.lower(*args).compile().as_text()
    counts = {op: len(re.findall(rf"\b{op}(?:-start)?\(", text)) for op in
              ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")}
    return ", ".join(f"{op} {n}" for op, n in counts.items() if n) or "none"


def q_gathered(fn, args, q_local_shape) -> bool:
    text = fn.lower(*args).compile().as_text()
    dims = ",".join(map(str, q_local_shape))
    return any(f"[{dims}]" in line for line in text.splitlines() if "all-gather" in line)


def peak_gib() -> list[float]:
    return [d.memory_stats().get("peak_bytes_in_use", 0) / 2**30 for d in jax.devices()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, default=131072)
    p.add_argument("--top-k", default="512,64")
    p.add_argument("--cp-T", default="1048576,2097152")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--skip-batch", action="store_true", help="context parallelism only")
    p.add_argument("--single-max-T", type=int, default=2097152, help="the longest T also run on one GPU")
    args = p.parse_args(argv)
    N = jax.device_count()
    print(gpu_header("multi-GPU", f"{N} x {jax.devices()[0].device_kind}, H={H} H_kv={H_KV} K=V={K} bf16 random",
                     f"python benchmarks/bench_multi_gpu.py {' '.join(sys.argv[1:] if argv is None else argv)}"))
    mesh = jax.make_mesh((N,), ("x",), axis_types=(AxisType.Auto,))
    dev0 = jax.devices()[0]

    if not args.skip_batch:
        batch_scaling(args, mesh, dev0, N)
    context_parallel(args, mesh, dev0, N)
    return 0


def batch_scaling(args, mesh, dev0, N: int) -> None:
    print(f"\n## Batch sharding: B={N} on {N} GPUs vs B=1 on one, T={args.T}, forward + backward")
    print("| attention | top_k | 1 GPU B=1 ms | N GPUs B=N ms | efficiency | collectives | q all-gathered |")
    print("|---|---|---|---|---|---|---|")
    one = [jax.device_put(x, dev0) for x in make_inputs(1, args.T)]
    many = [jax.device_put(x, NamedSharding(mesh, P("x"))) for x in make_inputs(N, args.T, seed=1)]
    for top_k in int_list(args.top_k):
        config = HTreeConfig(top_k=top_k)
        single = jax.jit(grad_of_sum(lambda q, k, v, c=config: attend(q, k, v, c, "pallas", None)[0]))
        sharded = jax.jit(grad_of_sum(lambda q, k, v, c=config: htree_attention(q, k, v, c, backend="pallas")))
        t1, tn = median_ms(single, one, args.iters), median_ms(sharded, many, args.iters)
        print(f"| htree | {top_k} | {t1:.1f} | {tn:.1f} | {t1 / tn:.3f} | {collectives(sharded, many)} | "
              f"{q_gathered(sharded, many, (1, args.T, H, K))} |", flush=True)
    dense = jax.jit(grad_of_sum(dense_fn(HTreeConfig())))
    t1, tn = median_ms(dense, one, args.iters), median_ms(dense, many, args.iters)
    print(f"| dense cuDNN | - | {t1:.1f} | {tn:.1f} | {t1 / tn:.3f} | {collectives(dense, many)} | - |", flush=True)
    del one, many


def context_parallel(args, mesh, dev0, N: int) -> None:
    print(f"\n## Context parallelism: T sharded over {N} GPUs, top_k=64, forward + backward")
    print("| T | 1 GPU ms | N GPUs ms | speed-up | peak GiB per device (N GPUs) | collectives | q all-gathered |")
    print("|---|---|---|---|---|---|---|")
    config = HTreeConfig(top_k=64)
    sharded = jax.jit(grad_of_sum(lambda q, k, v: htree_attention(q, k, v, config, backend="pallas")))
    single = jax.jit(grad_of_sum(lambda q, k, v: attend(q, k, v, config, "pallas", None)[0]))
    for T in int_list(args.cp_T):
        xs = make_inputs(1, T)
        t1 = "-"
        try:
            if T <= args.single_max_T:
                t1 = f"{median_ms(single, [jax.device_put(x, dev0) for x in xs], 1):.1f}"
        except Exception as e:  # noqa: BLE001 - one GPU out of memory: report it
            t1 = f"failed ({type(e).__name__})"
        spread = [jax.device_put(x, NamedSharding(mesh, P(None, "x"))) for x in xs]
        for d in jax.devices():
            d.memory_stats()  # (peaks are cumulative; the 1-GPU run above counts on device 0 only)
        try:
            tn = median_ms(sharded, spread, 1)
            ratio = f"{float(t1) / tn:.3f}" if t1[0].isdigit() else "-"
            print(f"| {T} | {t1} | {tn:.1f} | {ratio} | {', '.join(f'{g:.1f}' for g in peak_gib())} | "
                  f"{collectives(sharded, spread)} | {q_gathered(sharded, spread, (1, T // N, H, K))} |", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"| {T} | {t1} | failed: {type(e).__name__}: {str(e)[:150]} | | | | |", flush=True)
        del xs, spread


if __name__ == "__main__":
    raise SystemExit(main())
