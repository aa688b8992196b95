"""Where the Pallas backward's time goes, per launch, at one size (GPU).

    python -m benchmarks.profile --pass backward --T 131072 --top-k 512

Times (median of `--iters` after a warm-up) every launch of the backward for one chunk
of query positions in the middle of the sequence, scaled by the number of chunks: the
selections recomputed (top layer, then each layer that selects), each layer's `dq`
kernel, the inverse index and the node kernel (`dk`, `dv`). Then the whole backward
and the forward, for scale.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from htree_jax import HTreeConfig
from htree_jax.backends import kernel_route
from htree_jax.bench import H_KV, INPUTS, B, H, V, median_ms
from htree_jax.cli import DefaultsHelpFormatter
from pallas_kernels.gqa.chunks import chunk_queries, select_below_top, valid_candidates
from pallas_kernels.gqa.layer_backward import layer_backward_pallas
from pallas_kernels.gqa.node_backward import layer_node_grads_pallas
from pallas_kernels.gqa.plan import group_rows, prepare
from pallas_kernels.gqa.top_backward import (
    top_backward_queries,
    top_backward_statics,
    top_dq_pallas,
    top_node_grads_pallas,
)
from pallas_kernels.shared.common import LayerInputs, RowStats, TopInputs, next_power_of_two
from pallas_kernels.shared.configs import UNIT_ENTRIES, KernelConfigs
from pallas_kernels.shared.guarded import KernelCall
from pallas_kernels.shared.node_index import UNIT, node_buffers, node_index
from pallas_kernels.shared.precision import Precisions


def node_index_load(index) -> str:
    """How evenly a node kernel's work spreads: the entries (pairs) per unit of the
    inverse index (its first entries and its spilled segments'), total, mean over units
    with any, and the most one unit has (without the split one program walks a unit's
    entries in order, so the most bounds the launch from below), and the segments that
    spilled."""
    first = np.asarray(index.bounds[..., 1] - index.bounds[..., 0])  # [B, H_kv, units]
    segments = np.asarray(index.segments)  # [B, H_kv, X, 4]: unit, begin, end, count
    counts = first.copy()
    for b, h in np.ndindex(first.shape[:2]):
        np.add.at(counts[b, h], segments[b, h, :, 0], segments[b, h, :, 2] - segments[b, h, :, 1])
    busy = counts[counts > 0]
    spilled = int(np.sum(segments[..., 2] > segments[..., 1]))
    return (f"{int(counts.sum())} entries, {busy.size} busy units of {counts.size}, mean {busy.mean():.1f}, "
            f"max {int(counts.max())}; {spilled} spilled segments")


def main(argv=None):
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    p.add_argument("--T", type=int, default=131072)
    p.add_argument("--top-k", type=int, default=512)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--node-variants", default="",
                   help="also time the node kernel at entries:warps[:stages], e.g. 32:4,8:2:3")
    p.add_argument("--dq-variants", default="", help="also time the per-query dq kernel at warps:stages, e.g. 4:2")
    p.add_argument("--inputs", default="random", choices=sorted(INPUTS),
                   help="random, or correlated (htree_jax.bench.correlated_inputs)")
    p.add_argument("--entries-per-program", type=int, default=UNIT_ENTRIES,
                   help="the node kernels' entries per program before a unit's list spills (node_index)")
    p.add_argument("--selection", default="bound", choices=("mean", "bound"), help="HTreeConfig.selection")
    p.add_argument("--interpret", action="store_true", help="CPU smoke test of this script")
    args = p.parse_args(argv)
    ip, T = args.interpret, args.T
    config = HTreeConfig(top_k=args.top_k, selection=args.selection)
    q, k, v = INPUTS[args.inputs](T)
    bs = KernelConfigs.resolve(None, q.shape[-1], v.shape[-1])
    prep = jax.jit(lambda q, k, v: prepare(q, k, v, KernelCall(config, bs, ip), Precisions.for_dtype(q.dtype),
                                           for_backward=True))(q, k, v)
    st, Qc, P, L = prep.st, prep.chunk, prep.parents_width, len(prep.layers) + 1
    st_dq, st_dkv, segments = top_backward_statics(prep.st_top, bs.top_backward, jnp.dtype(q.dtype).itemsize,
                                                   prep.q4.shape[-1],
                                                   prep.top_v.shape[-1], prep.top_v.shape[2], prep.cos.shape[0],
                                                   B * H_KV, Qc)
    G = H // H_KV
    gt, gp = next_power_of_two(G), group_rows(G, bs)
    chunks = prep.q4.shape[1] // Qc
    c = jnp.int32(chunks // 2)
    vp, kp = prep.top_v.shape[-1], prep.q4.shape[-1]
    sizes = config.layer_sizes(T)
    key = jax.random.split(jax.random.key(3), 3)
    lse = jax.random.normal(key[0], (B, Qc, H_KV, gp), jnp.float32) + 8.0
    delta = jax.random.normal(key[1], (B, Qc, H_KV, gp), jnp.float32)
    do = jax.random.normal(key[2], (B, Qc, H_KV, gp, vp), jnp.float32)
    stats = lambda g: RowStats(lse[..., :g], do[..., :g, :], delta[..., :g])
    rows = []

    def timed(name, fn, *a):
        rows.append((name, median_ms(jax.jit(fn), a, args.iters), chunks))
        return jax.jit(fn)(*a)

    print(f"{args.inputs} inputs, T={T} top_k={args.top_k} selection={args.selection} layers={sizes} "
          f"chunk {Qc} x {chunks}", flush=True)
    rows, t, n_top, first, q_top, (keys, tau, parents) = timed(
        "chunk set-up + top layer importance and top-K (recomputed)", lambda: chunk_queries(prep, c, T, L, ip))
    top = (top_backward_queries(q_top, prep.st_top), TopInputs(n_top, first, keys, tau, prep.top_k_merge, prep.top_v),
           stats(gt))
    top_acc = (jnp.zeros(prep.top_k_merge[0].shape, jnp.float32), jnp.zeros(prep.top_v.shape, jnp.float32))
    timed("top: dq kernel", lambda *a: top_dq_pallas(*a, st_dq, ip), *top)
    timed("top: node kernel (dk, dv)", lambda *a: top_node_grads_pallas(*a, top_acc, st_dkv, ip, segments), *top)
    if L > 1:
        q_rows = rows.per_query
        for l in reversed(range(L - 1)):
            _, k_merge, vl = prep.layers[l]
            n = valid_candidates(parents, t, l, prep)
            keys = tau = None
            if l > 0:
                keys, nxt, tau, _, _ = timed(f"layer {l}: importance keys and top-K (recomputed)",
                                             lambda *a: select_below_top(prep, rows, *a, l, ip), parents, n)
            la = (LayerInputs(parents, n, keys, tau, k_merge, vl, prep.cos, prep.sin),)
            timed(f"layer {l}: dq kernel", lambda *a: layer_backward_pallas(q_rows, *a, stats(gp), st, ip), *la)
            for variant in filter(None, args.dq_variants.split(",")):
                w, stages = (int(x) for x in variant.split(":"))
                stv = dataclasses.replace(st, merge_num_warps=w, num_stages=stages)
                timed(f"  variant: layer {l} dq kernel, {w} warps, {stages} stages",
                      lambda *a, stv=stv: layer_backward_pallas(q_rows, *a, stats(gp), stv, ip), *la)
            units = -(-sizes[l] // UNIT)
            index = timed(f"layer {l}: inverse index (sort)",
                          lambda p_, n_: node_index(p_, n_, st.r, units, args.entries_per_program), parents, n)
            print(f"layer {l}: inverse index of the chunk: {node_index_load(index)}", flush=True)
            nacc = node_buffers(B, H_KV, sizes[l], kp, vp)
            timed(f"layer {l}: node kernel (dk, dv)",
                  lambda *a: layer_node_grads_pallas(rows.top, *a, stats(gt), index, nacc, st, ip,
                                                     num_warps=bs.layer.node_num_warps), *la)
            for variant in filter(None, args.node_variants.split(",")):
                e, w, *stages = (int(x) for x in variant.split(":"))
                stv = dataclasses.replace(st, num_stages=stages[0]) if stages else st
                timed(f"  variant: layer {l} node kernel, {e} pairs/step, {w} warps, {stv.num_stages} stages",
                      lambda *a, e=e, w=w, stv=stv: layer_node_grads_pallas(rows.top, *a, stats(gt),
                                                                            index, nacc, stv, ip, e, w), *la)
            if l > 0:
                parents = nxt[..., :P]
    for name, ms, times in rows:
        print(f"| {name} | {ms:.2f} | x{times} = {ms * times:.1f} ms |", flush=True)

    route = kernel_route(q, k, v, config)
    o, _, lse_all = jax.jit(lambda q, k, v: route.forward(q, k, v, config=config, interpret=ip, return_lse=True))(
        q, k, v)
    dout = jax.random.normal(key[0], (B, T, H, V), q.dtype)
    fwd = jax.jit(lambda q, k, v: route.forward(q, k, v, config=config, interpret=ip)[0])
    print(f"| whole forward | {median_ms(fwd, (q, k, v), args.iters):.1f} ms |", flush=True)
    bwd = jax.jit(lambda *a: route.backward(*a, config=config, interpret=ip))
    print(f"| whole backward | {median_ms(bwd, (q, k, v, o, lse_all, dout), args.iters):.1f} ms |", flush=True)


if __name__ == "__main__":
    main()
