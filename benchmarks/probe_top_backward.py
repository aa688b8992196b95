"""The top layer's backward kernels at one chunk, in variants, against the floor of a
Pallas-Triton flash attention backward with the same products (issue 34).

    python -m benchmarks.probe_top_backward [--T 131072] [--top-k 512] [--inputs random]

One chunk of queries in the middle of the sequence (the top layer's work grows linearly
with `t`, so the middle chunk is the mean), the forward's selections as the backward is
given them (`kept_keys`), through `top_dq_pallas` (3 products: scores, `do . v`, `dq`)
and `top_node_grads_pallas` (4: scores, `do . v`, `dk`, `dv`), each timed alone (median
of `--iters`, interleaved rounds) and scaled by the number of chunks; the rate counts
the products over the valid candidates only (`sum_t n_t * H * K * 2` FLOP per product).

The floor (`--floor`): JAX's Pallas-Triton `mha` (jax.experimental.pallas.ops.gpu.attention,
forward and backward) and cuDNN on `B = 32` sequences of 4096 queries over 4096 keys,
non-causal, H=32, K=V=128: the same multiply-adds per product as the top layer at
T=131072, top_k=512 (131072 queries over 4096 nodes on average). Its backward time is
that of `vjp` less its forward's.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention as pallas_attention

from htree_jax import HTreeConfig
from benchmarks.probe_top_layer import middle_chunk
from htree_jax.bench import H_KV, INPUTS, B, H, median_ms
from pallas_kernels.common import next_power_of_two
from pallas_kernels.forward import htree_forward_pallas
from pallas_kernels.plan import BlockSizes, prepare
from pallas_kernels.precision import Precisions
from pallas_kernels.top_backward import top_backward_queries, top_dq_pallas, top_node_grads_pallas
from pallas_kernels.tree_backward import kept_keys


def floor_rows(iters: int, rounds: int):
    """Pallas `mha` forward, forward+backward and backward alone, and cuDNN's, at the
    top layer's multiply-adds (see the module docstring): `[(name, ms, products)]`."""
    Bf, T, H_, D = 32, 4096, 32, 128
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(x, (Bf, T, H_, D), jnp.bfloat16) for x in ks)
    out = []
    variants = [("pallas mha default blocks (32)", pallas_attention.BlockSizes.get_default(), None),
                ("pallas mha bwd blocks 64", pallas_attention.BlockSizes(128, 64, 64, 64, 64, 64), None),
                ("pallas mha bwd blocks 64/128", pallas_attention.BlockSizes(128, 64, 64, 128, 128, 64), 8)]
    for name, blocks, warps in variants:
        mha = lambda q, k, v, blocks=blocks, warps=warps: pallas_attention.mha(
            q, k, v, segment_ids=None, causal=False, block_sizes=blocks, num_warps=warps)
        fwd = jax.jit(mha)
        both = jax.jit(lambda q, k, v, do, mha=mha: jax.vjp(mha, q, k, v)[1](do))
        try:
            f_ms = statistics.median(median_ms(fwd, (q, k, v), iters) for _ in range(rounds))
            b_ms = statistics.median(median_ms(both, (q, k, v, do), iters) for _ in range(rounds))
        except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported
            print(f"| {name} | FAIL {type(e).__name__}: {str(e).splitlines()[0][:150]} | | |", flush=True)
            continue
        out += [(f"{name}: forward", f_ms, 2), (f"{name}: forward + backward", b_ms, 9),
                (f"{name}: backward (difference)", b_ms - f_ms, 7)]
    cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
    both = jax.jit(lambda q, k, v, do: jax.vjp(cudnn, q, k, v)[1](do))
    f_ms = median_ms(jax.jit(cudnn), (q, k, v), iters)
    b_ms = median_ms(both, (q, k, v, do), iters)
    out += [("cuDNN: forward", f_ms, 2), ("cuDNN: forward + backward", b_ms, 7),
            ("cuDNN: backward (difference)", b_ms - f_ms, 5)]
    return out, 2 * Bf * T * T * H_ * D / 1e12


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, default=131072)
    p.add_argument("--top-k", type=int, default=512)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--inputs", default="random", choices=sorted(INPUTS))
    p.add_argument("--dq", default="128:64:8:2,64:64:4:2,64:64:4:3,32:64:4:2",
                   help="dq kernel variants, rows:tile:warps:stages")
    p.add_argument("--dkv", default="128:64:8:1:1,64:64:4:2:1,64:64:4:2:4,64:64:4:2:8,64:32:4:2:4",
                   help="node kernel variants, rows:tile:warps:stages[:programs per tile]")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over all variants")
    p.add_argument("--floor", action="store_true", help="also the flash-attention floor (see the docstring)")
    p.add_argument("--interpret", action="store_true", help="CPU smoke test (small T)")
    args = p.parse_args(argv)
    ip, T, config = args.interpret, args.T, HTreeConfig(top_k=args.top_k)
    q, k, v = INPUTS[args.inputs](T)
    prep = jax.jit(lambda q, k, v: prepare(q, k, v, config, BlockSizes(), ip, Precisions.for_dtype(q.dtype),
                                           for_backward=True))(q, k, v)
    st, Qc, L = prep.st, prep.chunk, len(prep.layers) + 1
    gt = next_power_of_two(H // H_KV)
    c, chunks, _, n_top, q_top, product_tflop = middle_chunk(prep, T)
    vp, Mp = prep.top_v.shape[-1], prep.cos.shape[0]
    q_ops = top_backward_queries(q_top, prep.st_top)
    keys = tau = None
    if L > 1:  # the forward's kept top nodes of the chunk, marked as the backward marks them
        selected = jax.jit(lambda q, k, v: htree_forward_pallas(q, k, v, config, interpret=ip)[1][0])(q, k, v)
        keys = kept_keys(None, selected[:, c * Qc: (c + 1) * Qc], Mp, st.r)
        tau = jnp.ones(n_top.shape, jnp.int32)
    key = jax.random.split(jax.random.key(3), 3)
    lse = jax.random.normal(key[0], (B, Qc, H_KV, gt), jnp.float32) + 8.0
    delta = jax.random.normal(key[1], (B, Qc, H_KV, gt), jnp.float32)
    do = jax.random.normal(key[2], (B, Qc, H_KV, gt, vp), jnp.bfloat16)
    top = (q_ops, n_top, None, keys, tau, prep.top_k_merge, prep.top_v, lse, do, delta)
    acc = (jnp.zeros(prep.top_k_merge[0].shape, jnp.float32), jnp.zeros(prep.top_v.shape, jnp.float32))
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}: {args.inputs} inputs, T={T} top_k={args.top_k}, "
          f"chunk {c} of {chunks} ({Qc} queries, mean n {float(jnp.mean(n_top)):.0f}); one product over the valid "
          f"candidates = {product_tflop * chunks:.2f} TFLOP for the whole sequence", flush=True)
    timed = []  # (kernel, variant, products, fn, args)

    def variant(kernel, spec, products, kernel_of):
        fields = [int(x) for x in spec.split(":")]
        rows, tile, warps, stages = fields[:4]
        segments = fields[4] if len(fields) > 4 else 1
        stv = dataclasses.replace(prep.st_top, block_queries=max(1, rows // gt), tile=tile, num_warps=warps,
                                  num_stages=stages)
        fn = jax.jit(kernel_of(stv, segments))
        name = f"rows {rows}, tile {tile}, {warps} warps, {stages} stages"
        if kernel.startswith("dk"):
            name += f", {segments} programs per tile"
        try:
            jax.block_until_ready(fn(*top))
            timed.append((kernel, name, products, fn))
        except Exception as e:  # a variant that does not compile is reported, not fatal
            print(f"| {kernel} | {name} | FAIL {type(e).__name__}: {str(e).splitlines()[0][:150]} | | |", flush=True)

    for spec in filter(None, args.dq.split(",")):
        variant("dq (3 products)", spec, 3, lambda stv, *_: lambda *a: top_dq_pallas(*a, stv, ip))
    for spec in filter(None, args.dkv.split(",")):
        variant("dk, dv (4 products)", spec, 4, lambda stv, segments: lambda *a: top_node_grads_pallas(
            *a, acc, stv, ip, segments))
    print("| kernel | variant | per chunk ms | whole sequence ms | TFLOP/s of its products | spread of the rounds |\n"
          "|---|---|---|---|---|---|")
    # Interleaved rounds: a drift of the GPU's clocks during the run moves every variant alike.
    rounds = [[median_ms(fn, top, args.iters) for *_, fn in timed] for _ in range(args.rounds)]
    for j, (kernel, name, products, _) in enumerate(timed):
        ms = statistics.median(r[j] for r in rounds)
        spread = max(r[j] for r in rounds) / min(r[j] for r in rounds) - 1
        print(f"| {kernel} | {name} | {ms:.2f} | {ms * chunks:.1f} | {products * product_tflop / ms * 1e3:.0f} | "
              f"{100 * spread:.0f}% |", flush=True)
    if args.floor and not ip:
        rows, tflop = floor_rows(args.iters, args.rounds)
        print(f"\nFloor: {tflop:.2f} TFLOP per product (the top layer's at T=131072, top_k=512: "
              f"{product_tflop * chunks:.2f})\n| what | ms | products | TFLOP/s |\n|---|---|---|---|")
        for name, ms, products in rows:
            print(f"| {name} | {ms:.2f} | {products} | {products * tflop / ms * 1e3:.0f} |", flush=True)


if __name__ == "__main__":
    main()
