"""The top layer's kernels at one chunk, in variants: where its time goes and what each
knob buys (issue 33).

    python -m benchmarks.probe_top_layer [--T 131072] [--top-k 512] [--inputs random]

One chunk of queries in the middle of the sequence (the top layer's work grows
linearly with `t`, so the middle chunk is the mean), through the importance keys kernel,
the shared top-K and the merge, each timed alone (median of `--iters` after a warm-up)
and scaled by the number of chunks; the rate counts the products over the valid
candidates only (`sum_t n_t * H * K * 2` FLOP per product).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import jax
import jax.numpy as jnp

from htree_jax import HTreeConfig
from htree_jax.bench import H_KV, INPUTS, B, H, K, median_ms
from htree_jax.core.indexing import top_layer_parents
from pallas_kernels.common import next_power_of_two, pad_axis
from pallas_kernels.plan import BlockSizes, prepare
from pallas_kernels.precision import Precisions
from pallas_kernels.rope import rotate_queries
from pallas_kernels.top_k import select_top_k_pallas
from pallas_kernels.top_layer import top_importance_keys_pallas, top_merge_pallas


def middle_chunk(prep, T: int):
    """The chunk of queries in the middle of the sequence (the top layer's work grows
    linearly with `t`, so it is the mean chunk) as the top layer's kernels take it: `(c,
    chunks, t [1, Qc, 1, 1], n_top [B, Qc, H_kv, 1], q_top (rotated, Gt rows),
    product_tflop)`, the last one product over the chunk's valid candidates."""
    Qc, L = prep.chunk, len(prep.layers) + 1
    chunks = prep.q4.shape[1] // Qc
    c = chunks // 2
    qc = prep.q4[:, c * Qc: (c + 1) * Qc]
    t = jnp.minimum(c * Qc + jnp.arange(Qc, dtype=jnp.int32), T - 1)[None, :, None, None]
    n_top = jnp.broadcast_to(t // prep.st.r ** (L - 1) + 1, (B, Qc, H_KV, 1))
    gt = next_power_of_two(H // H_KV)
    q_top = jax.jit(lambda qc, n: rotate_queries(pad_axis(qc, 3, gt), n, prep.cos, prep.sin))(qc, n_top)
    product_tflop = float(jnp.sum(n_top[0, :, 0, 0].astype(jnp.float32))) * H * K * 2 / 1e12
    return c, chunks, t, n_top, q_top, product_tflop


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, default=131072)
    p.add_argument("--top-k", type=int, default=512)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--inputs", default="random", choices=sorted(INPUTS))
    p.add_argument("--keys", default="64:2:8,64:3:8,32:3:8,128:2:8,64:2:4",
                   help="importance kernel variants, tile:stages:warps")
    p.add_argument("--merge", default="64:2:8,64:3:8,128:2:8,32:2:4,64:2:4", help="merge variants, tile:stages:warps")
    p.add_argument("--rows", default="128", help="query rows per program (top_rows) to try")
    p.add_argument("--select-warps", default="2,4,8")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over all variants")
    p.add_argument("--packed-form", action="store_true", help="also time each kernel with `first` given (packing)")
    p.add_argument("--interpret", action="store_true")
    args = p.parse_args(argv)
    ip = args.interpret
    T, config = args.T, HTreeConfig(top_k=args.top_k)
    q, k, v = INPUTS[args.inputs](T)
    prep = jax.jit(lambda q, k, v: prepare(q, k, v, config, BlockSizes(), ip, Precisions.for_dtype(q.dtype)))(q, k, v)
    st, Qc, P, L = prep.st, prep.chunk, prep.parents_width, len(prep.layers) + 1
    gt = next_power_of_two(H // H_KV)
    c, chunks, t, n_top, q_top, product_tflop = middle_chunk(prep, T)
    vp, Mp = prep.top_v.shape[-1], prep.cos.shape[0]
    zeros = jnp.zeros_like(n_top)
    empty = (jnp.full((B, Qc, H_KV, gt), -jnp.inf, jnp.float32), jnp.zeros((B, Qc, H_KV, gt), jnp.float32),
             jnp.zeros((B, Qc, H_KV, gt, vp), jnp.float32))
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}: {args.inputs} inputs, T={T} top_k={args.top_k}, "
          f"chunk {c} of {chunks} ({Qc} queries, mean n {float(jnp.mean(n_top)):.0f}); one product over the valid "
          f"candidates = {product_tflop * chunks:.2f} TFLOP for the whole sequence", flush=True)
    print("| kernel | variant | per chunk ms | whole sequence ms | TFLOP/s of its products | spread of the rounds |\n"
          "|---|---|---|---|---|---|")
    documents = [(None, "one document per row")] + ([(zeros, "first given (while loop)")] if args.packed_form else [])

    timed = []  # (kernel, variant, products, fn, args), timed in interleaved rounds below

    def report(kernel, variant, fn, args, products):
        try:
            jax.block_until_ready(fn(*args))
            timed.append((kernel, variant, products, fn, args))
        except Exception as e:  # a variant that does not compile is reported, not fatal
            print(f"| {kernel} | {variant} | FAIL {type(e).__name__}: {str(e).splitlines()[0][:120]} | | |", flush=True)

    def top_static(tile, stages, warps, rows):
        return dataclasses.replace(prep.st_top, block_queries=max(1, rows // gt), tile=tile, num_stages=stages,
                                   num_warps=warps)

    keys = None
    for rows in [int(x) for x in args.rows.split(",")]:
        for spec in args.keys.split(","):
            tile, stages, warps = (int(x) for x in spec.split(":"))
            stv = top_static(tile, stages, warps, rows)
            for first, name in documents:
                call = jax.jit(lambda q, n, f, k, stv=stv: top_importance_keys_pallas(q, n, f, k, Mp, stv, ip))
                kargs = (q_top, n_top, first, prep.top_k_imp)
                report("importance keys (2 passes of BF16X3)", f"rows {rows}, tile {tile}, {stages} stages, "
                       f"{warps} warps, {name}", call, kargs, 6)
                if keys is None:
                    keys = call(*kargs)
    parents = jnp.broadcast_to(top_layer_parents(t[..., 0], st.r, L, P), (B, Qc, H_KV, P))
    tau = None
    for warps in [int(x) for x in args.select_warps.split(",")]:
        stw = dataclasses.replace(st, num_warps=warps)
        call = jax.jit(lambda *a, stw=stw: select_top_k_pallas(*a, stw, ip))
        report("shared top-K", f"{warps} warps", call, (keys, parents, n_top), 0)
        tau = call(keys, parents, n_top)[1]
    for rows in [int(x) for x in args.rows.split(",")]:
        for spec in args.merge.split(","):
            tile, stages, warps = (int(x) for x in spec.split(":"))
            stv = dataclasses.replace(top_static(tile, stages, warps, rows), tile=tile)
            v_pad = prep.top_v
            for first, name in documents:
                call = jax.jit(lambda q, n, f, kk, ta, km, vv, s, stv=stv: top_merge_pallas(q, n, f, kk, ta, km, vv, s,
                                                                                           stv, ip))
                report("merge (1 score + 1 value product)", f"rows {rows}, tile {tile}, {stages} stages, "
                       f"{warps} warps, {name}", call,
                       (q_top, n_top, first, keys, tau, prep.top_k_merge, v_pad, empty), 2)
    # Interleaved rounds: each round times every variant once (median of --iters), so a
    # drift of the GPU's clocks during the run moves every variant alike.
    rounds = [[median_ms(fn, a, args.iters) for _, _, _, fn, a in timed] for _ in range(args.rounds)]
    for j, (kernel, variant, products, _, _) in enumerate(timed):
        ms = statistics.median(r[j] for r in rounds)
        spread = max(r[j] for r in rounds) / min(r[j] for r in rounds) - 1
        rate = f"{products * product_tflop / ms * 1e3:.0f}" if products else "-"
        print(f"| {kernel} | {variant} | {ms:.2f} | {ms * chunks:.1f} | {rate} | {100 * spread:.0f}% |", flush=True)


if __name__ == "__main__":
    main()
