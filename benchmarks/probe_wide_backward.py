"""The wide backward's kernels alone at latent attention's shape
(`pallas_kernels/wide_backward.py`), on the terms of `probe_wide.py`: Q queries of 128
heads over one latent kv head, each with `Mp` valid candidates (random ascending
parents of a layer of `N` nodes), K = 512 latent + 64 RoPE, values the first 512 latent
features, bf16, as a bottom layer (every candidate merged). Times the `dq` kernel and
the node kernel (`dk`, `dv`) with their useful FLOPs: per (query, head, candidate) the
score (576) and `do . v` (512) products, then `dq` (576) for the first, `dk` (576) and
`dv` (512) for the second.

    python -m benchmarks.probe_wide_backward [--Q 4096] [--N 131072] [--Mp 1024] [--variants 64:64:8,...]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks.probe_wide import inputs
from htree_jax.bench import MLA, median_ms
from pallas_kernels.importance import feature_pieces
from pallas_kernels.node_backward import node_index
from pallas_kernels.precision import Precisions, key_operands
from pallas_kernels.wide import WideStatic
from pallas_kernels.wide_backward import wide_dq_pallas, wide_node_grads_pallas


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--Q", type=int, default=4096)
    p.add_argument("--N", type=int, default=131072)
    p.add_argument("--Mp", type=int, default=1024)
    p.add_argument("--entries", type=int, default=512, help="node kernel: entries a program walks before spilling")
    p.add_argument("--variants", default="64:64:8:1", help="rows:tile:warps:stages,...")
    p.add_argument("--kernels", default="dq,node")
    p.add_argument("--iters", type=int, default=3)
    args = p.parse_args(argv)
    pr = Precisions.for_dtype(jnp.bfloat16)
    r, H, V = 16, MLA["H"], 512
    print(f"# probe_wide_backward Q={args.Q} N={args.N} Mp={args.Mp} H={H} {jax.devices()[0].device_kind}", flush=True)
    print("| kernel | rows | tile | warps/stages | ms | useful TFLOP/s |\n|---|---|---|---|---|---|", flush=True)
    for variant in args.variants.split(","):
        rows, tile, warps, stages = (int(x) for x in variant.split(":"))
        d = inputs(args.Q, args.N, args.Mp, r, 64)
        ws = WideStatic(r=r, tile=64, rows=rows, alpha=576 ** -0.5, importance="softmax", strict_causal=True,
                        lat_pieces=feature_pieces(512), value_pieces=feature_pieces(V), precision=pr.scores,
                        importance_operands=pr.importance_operands, merge_precision=pr.merge,
                        merge_operands=pr.merge_operands, num_warps=warps, num_stages=stages)
        q_lat, q_rope, _ = d["queries"]
        rope = key_operands(d["copies"], pr.merge, pr.merge_operands)
        ks = jax.random.split(jax.random.key(1), 3)
        shape = (1, args.Q, 1, H)
        lse = 3.0 + jax.random.normal(ks[0], shape, jnp.float32)
        delta = jax.random.normal(ks[1], shape, jnp.float32)
        do = jax.random.normal(ks[2], shape + (V,), jnp.bfloat16)
        dq = (jnp.zeros(q_lat.shape, jnp.float32), jnp.zeros(q_rope.shape, jnp.float32))
        layer = (None, None, d["lat"], rope, None, d["tables"], lse, delta, do)
        count = 2.0 * args.Q * H * args.Mp
        if "dq" in args.kernels:
            f = jax.jit(lambda dq: wide_dq_pallas(q_lat, q_rope, d["parents"], d["n"], *layer, dq, ws, tile))
            report("dq", rows, tile, f"{warps}/{stages}", f, (dq,), count * (2 * 576 + 512), args.iters)
        if "node" in args.kernels:
            index = jax.jit(lambda p, n: node_index(p, n, r, args.N // 16, args.entries))(d["parents"], d["n"])
            acc = tuple(jnp.zeros((1, 1, args.N, w), jnp.float32) for w in (512, 64, V))
            g = jax.jit(lambda acc: wide_node_grads_pallas(q_lat, q_rope, *layer, index, acc, ws))
            report("node", rows, "-", f"{warps}/{stages}", g, (acc,), count * (2 * 576 + 2 * 512), args.iters)


def report(kernel, rows, tile, warps, fn, args, flops, iters):
    try:
        ms = median_ms(fn, args, iters)
        print(f"| {kernel} | {rows} | {tile} | {warps} | {ms:.2f} | {flops / ms / 1e9:.1f} |", flush=True)
    except Exception as e:  # noqa: BLE001 - a variant that does not compile: say so, go on
        print(f"| {kernel} | {rows} | {tile} | {warps} | failed: {type(e).__name__}: {str(e)[:200]} | |", flush=True)

if __name__ == "__main__":
    main()
