"""The sharded code path on one GPU (issue 19): `htree_jax.sharding.partitioned_attention`
(the custom-partitioned forward and backward) under `jax.jit` with a 1-device mesh
(`NamedSharding` inputs), against the unsharded call, same run.

    python benchmarks/bench_sharded.py [--T 131072] [--top-k 512,64] [--iters 5]

B=1, H=32, H_kv=4, K=V=128, bf16, random inputs; forward, and forward + backward
(gradient of a float32 sum).
"""

from __future__ import annotations

import argparse
import sys

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from htree_jax import HTreeConfig
from htree_jax.backends import attend
from htree_jax.bench import grad_of_sum, gpu_header, inputs, int_list, median_ms
from htree_jax.cli import DefaultsHelpFormatter
from htree_jax.sharding import partitioned_attention


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    p.add_argument("--T", type=int, default=131072)
    p.add_argument("--top-k", default="512,64")
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args(argv)
    print(gpu_header("sharded", f"B=1 H=32 H_kv=4 K=V=128 bf16 random, T={args.T}, 1-device mesh",
                     f"python benchmarks/bench_sharded.py {' '.join(sys.argv[1:] if argv is None else argv)}"))
    mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    sharding = NamedSharding(mesh, P("data", None, "model", None))
    q, k, v = (jax.device_put(x, sharding) for x in inputs(args.T))
    print("| top_k | pass | unsharded ms | sharded path ms | sharded/unsharded |\n|---|---|---|---|---|")
    for top_k in int_list(args.top_k):
        config = HTreeConfig(top_k=top_k, selection_block=1)
        plain = lambda q, k, v: attend(q, k, v, config, "pallas")[0]
        sharded = lambda q, k, v: partitioned_attention(q, k, v, config, "pallas")[0]
        for name, a, b in (("forward", plain, sharded), ("fwd+bwd", grad_of_sum(plain), grad_of_sum(sharded))):
            a_ms = median_ms(jax.jit(a), (q, k, v), args.iters)
            b_ms = median_ms(jax.jit(b, in_shardings=(sharding,) * 3), (q, k, v), args.iters)
            print(f"| {top_k} | {name} | {a_ms:.1f} | {b_ms:.1f} | {b_ms / a_ms:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
