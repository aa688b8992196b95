"""Where the Pallas forward's time goes, per kernel, at one size.

    python -m benchmarks.profile --pass forward --T 131072 --top-k 512

Times (median of `--iters`, after a warm-up) the tree build once, and every layer's
launches for one chunk of query positions in the middle of the sequence (the top
layer's work grows linearly with t, so the middle chunk is the mean); per-chunk times
are scaled by the number of chunks. Also prints the counted floor per query.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp

from htree_jax import HTreeConfig
from htree_jax.backends import kernel_route
from htree_jax.bench import H_KV, INPUTS, B, H, K, dense_fn, median_ms
from htree_jax.cli import DefaultsHelpFormatter
from htree_jax.core.indexing import top_layer_parents
from htree_jax.kernel_trace import kernel_times, print_kernel_times
from pallas_kernels.gqa.chunks import valid_candidates
from pallas_kernels.gqa.merge import merge_pallas, merge_scored_pallas
from pallas_kernels.gqa.plan import group_rows, prepare
from pallas_kernels.gqa.top_layer import top_importance_keys_pallas, top_merge_pallas
from pallas_kernels.shared.common import LayerInputs, TopInputs, next_power_of_two, pad_axis
from pallas_kernels.shared.configs import KernelConfigs
from pallas_kernels.shared.guarded import KernelCall
from pallas_kernels.shared.importance import importance_keys_pallas
from pallas_kernels.shared.precision import Precisions
from pallas_kernels.shared.rope import rotate_queries
from pallas_kernels.shared.top_k import select_top_k_pallas


def precisions_from(merge_operands: str, importance_operands: str, dtype) -> Precisions:
    """The backend's defaults for `dtype`, with the operands named on the command line
    ("auto": the default; "float32": float32 operands, 3xTF32 for the importance dots)."""
    chosen = Precisions.for_dtype(dtype)
    if merge_operands != "auto":
        chosen = dataclasses.replace(chosen, merge_operands=None if merge_operands == "float32" else merge_operands)
    if importance_operands != "auto":
        chosen = dataclasses.replace(chosen, importance_operands=None if importance_operands == "float32"
                                     else importance_operands)
    return chosen


def variants(spec: str, st, warps_field: str):
    """`(LayerStatic, label)` per `tile:warps:stages` of `spec`."""
    for item in [x for x in spec.split(",") if x]:
        tile, warps, stages = (int(x) for x in item.split(":"))
        yield (dataclasses.replace(st, tile=tile, num_stages=stages, **{warps_field: warps}),
               f"tile {tile}, {warps} warps, {stages} stages")


def gathered(n, arrays) -> float:
    """Bytes a chunk gathers: the rows of `arrays` (key parts, values) at every valid
    candidate of its queries and kv heads."""
    row_bytes = sum(x.shape[-1] * x.dtype.itemsize for x in arrays)
    return float(jnp.sum(n.astype(jnp.float32))) * row_bytes


TUNED = KernelConfigs.resolve(None, 128, 128)  # the shape this profiler runs (htree_jax.bench)


def main(argv=None):
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    p.add_argument("--T", type=int, default=131072)
    p.add_argument("--top-k", type=int, default=512)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--span", type=int, default=TUNED.layer.span)
    p.add_argument("--tile", type=int, default=TUNED.layer.tile)
    p.add_argument("--top-tile", type=int, default=TUNED.top.tile)
    p.add_argument("--top-rows", type=int, default=TUNED.top.rows)
    p.add_argument("--top-warps", type=int, default=TUNED.top.num_warps)
    p.add_argument("--top-keys-tile", type=int, default=TUNED.top.keys_tile)
    p.add_argument("--chunk-gb", type=float, default=TUNED.chunk_budget_bytes / 2**30)
    p.add_argument("--top-keys-stages", type=int, default=TUNED.top.keys_stages)
    p.add_argument("--warps", type=int, default=TUNED.layer.num_warps, help="per-query importance kernel")
    p.add_argument("--min-rows", type=int, default=TUNED.layer.min_query_rows, help="per-query kernels' least rows")
    p.add_argument("--merge-warps", type=int, default=TUNED.layer.merge_num_warps, help="per-query merges")
    p.add_argument("--merge-operands", default="auto", help="auto, float32, or a dtype name")
    p.add_argument("--importance-operands", default="auto", help="auto, float32 (3xTF32), bf16x3 or a dtype name")
    p.add_argument("--merge-variants", action="store_true", help="time warp/tile variants of the scored merge too")
    p.add_argument("--inputs", default="random", choices=sorted(INPUTS),
                   help="random, or correlated (htree_jax.bench.correlated_inputs)")
    p.add_argument("--bottom-variants", default="", help="bottom merge variants to time, tile:warps:stages,...")
    p.add_argument("--keys-variants", default="", help="importance kernel variants below the top, tile:warps:stages")
    p.add_argument("--kernels", action="store_true", help="also each kernel's device time in the end-to-end call")
    p.add_argument("--interpret", action="store_true", help="CPU smoke test of this script")
    args = p.parse_args(argv)
    ip = args.interpret
    T, config = args.T, HTreeConfig(top_k=args.top_k)
    q, k, v = INPUTS[args.inputs](T)
    bs = TUNED.with_changes({
        "layer.min_query_rows": args.min_rows, "layer.span": args.span, "layer.tile": args.tile,
        "top.tile": args.top_tile, "top.rows": args.top_rows, "top.num_warps": args.top_warps,
        "top.keys_tile": args.top_keys_tile, "chunk_budget_bytes": int(args.chunk_gb * 2**30),
        "top.keys_stages": args.top_keys_stages, "layer.num_warps": args.warps,
        "layer.merge_num_warps": args.merge_warps})
    precisions = precisions_from(args.merge_operands, args.importance_operands, q.dtype)
    prep_fn = jax.jit(lambda q, k, v: prepare(q, k, v, KernelCall(config, bs, ip), precisions))
    tree_ms = median_ms(prep_fn, (q, k, v), args.iters)
    prep = prep_fn(q, k, v)
    st, st_top, Qc, P, L = prep.st, prep.st_top, prep.chunk, prep.parents_width, len(prep.layers) + 1
    G = H // H_KV
    gt, gp = next_power_of_two(G), group_rows(G, bs)
    chunks = prep.q4.shape[1] // Qc
    c = chunks // 2
    qc = prep.q4[:, c * Qc : (c + 1) * Qc]
    t = jnp.minimum(c * Qc + jnp.arange(Qc, dtype=jnp.int32), T - 1)[None, :, None, None]
    vp, Mp = prep.top_v.shape[-1], prep.cos.shape[0]
    empty = lambda g: (jnp.full((B, Qc, H_KV, g), -jnp.inf, jnp.float32), jnp.zeros((B, Qc, H_KV, g), jnp.float32),
                       jnp.zeros((B, Qc, H_KV, g, vp), jnp.float32))
    rows = [("tree build + padding + top-layer key rotation (whole call)", tree_ms, 1)]
    n_top = jnp.broadcast_to(t // st.r ** (L - 1) + 1, (B, Qc, H_KV, 1))
    rot_call = jax.jit(lambda qc, n: rotate_queries(pad_axis(qc, 3, gt), n, prep.cos, prep.sin))
    rows.append(("top layer query rotation", median_ms(rot_call, (qc, n_top), args.iters), chunks))
    q_top = rot_call(qc, n_top)
    first = None  # one document per row (what the forward passes without packing)
    mean_n = float(jnp.mean(n_top))
    blk = f"{st_top.block_queries} queries/program, tile {st_top.tile}"
    kblk = f"{st_top.block_queries} queries/program, tile {prep.st_top_keys.tile}, {prep.st_top_keys.num_stages} stages"
    if L == 1:
        call = jax.jit(lambda *a: top_merge_pallas(*a, st_top, ip, out_dtype=q.dtype))
        margs = (q_top, TopInputs(n_top, first, None, None, prep.top_k_merge, prep.top_v), empty(gt))
        rows.append((f"layer 0 (top) merge + normalise ({blk}, mean n={mean_n:.0f})",
                     median_ms(call, margs, args.iters), chunks))
    else:
        keys_call = jax.jit(lambda *a: top_importance_keys_pallas(*a, Mp, prep.st_top_keys, ip))
        kargs = (q_top, TopInputs(n_top, first, None, None, prep.top_k_imp, None))
        rows.append((f"layer {L - 1} (top) importance keys ({kblk}, 2 score passes, mean n={mean_n:.0f})",
                     median_ms(keys_call, kargs, args.iters), chunks))
        keys = keys_call(*kargs)
        parents = jnp.broadcast_to(top_layer_parents(t[..., 0], st.r, L, P), (B, Qc, H_KV, P))
        select_call = jax.jit(lambda *a: select_top_k_pallas(*a, prep.st_select, ip))
        rows.append((f"layer {L - 1} shared top-K (threshold search + compaction)",
                     median_ms(select_call, (keys, parents, n_top), args.iters), chunks))
        nxt, tau = select_call(keys, parents, n_top)
        merge_call = jax.jit(lambda *a: top_merge_pallas(*a, st_top, ip))
        margs = (q_top, TopInputs(n_top, first, keys, tau, prep.top_k_merge, prep.top_v), empty(gt))
        rows.append((f"layer {L - 1} (top) merge ({blk}, 1 score pass + values)",
                     median_ms(merge_call, margs, args.iters), chunks))
        state = tuple(pad_axis(x, 3, gp) for x in merge_call(*margs))
        parents = nxt[..., :P]
        q_rows = pad_axis(qc, 3, gp)
    for l in reversed(range(L - 1)):
        kl, kl_rot, vl = prep.layers[l]
        n = valid_candidates(parents, t, l, prep)
        mean_n = float(jnp.mean(n))
        if l > 0:
            keys_call = jax.jit(lambda *a: importance_keys_pallas(*a, st, ip, return_scores=True))
            kargs = (q_rows, LayerInputs(parents, n, None, None, kl, None, prep.cos, prep.sin))
            rows.append((f"layer {l} importance keys (1 query/program, 1 score pass, scores stored, "
                         f"mean n={mean_n:.0f})", median_ms(keys_call, kargs, args.iters), chunks, gathered(n, kl)))
            for stv, label in variants(args.keys_variants, st, "num_warps"):
                call = jax.jit(lambda *a, stv=stv: importance_keys_pallas(*a, stv, ip, return_scores=True))
                rows.append((f"  variant: {label}", median_ms(call, kargs, args.iters), chunks, gathered(n, kl)))
            keys, scores = keys_call(*kargs)
            select_call = jax.jit(lambda *a: select_top_k_pallas(*a, prep.st_select, ip))
            rows.append((f"layer {l} shared top-K (threshold search + compaction)",
                         median_ms(select_call, (keys, parents, n), args.iters), chunks))
            nxt, tau = select_call(keys, parents, n)
            st_scored = dataclasses.replace(st, merge_num_warps=bs.layer.scored_merge_num_warps)
            merge_call = jax.jit(lambda *a: merge_scored_pallas(*a, st_scored, ip))
            margs = (scores, parents, n, keys, tau, vl, state)
            rows.append((f"layer {l} merge (1 query/program, stored scores + values, {bs.layer.scored_merge_num_warps} warps)",
                         median_ms(merge_call, margs, args.iters), chunks))
            if args.merge_variants:
                for warps, tile in [(2, 64), (8, 64), (4, 128), (8, 128), (4, 32)]:
                    if Mp % tile:
                        continue
                    stv = dataclasses.replace(st, merge_num_warps=warps, tile=tile)
                    call = jax.jit(lambda *a, stv=stv: merge_scored_pallas(*a, stv, ip))
                    rows.append((f"  variant: stored scores, {warps} warps, tile {tile}",
                                 median_ms(call, margs, args.iters), chunks))
            state = merge_call(*margs)
            parents = nxt[..., :P]
        else:
            bottom = jax.jit(lambda *a: merge_pallas(*a, st, ip, out_dtype=q.dtype))
            bargs = (q_rows, LayerInputs(parents, n, None, None, kl_rot, vl, prep.cos, prep.sin), state)
            rows.append((f"layer 0 merge + normalise (1 query/program, 1 score pass + values, mean n={mean_n:.0f})",
                         median_ms(bottom, bargs, args.iters), chunks, gathered(n, (*kl_rot, vl))))
            for stv, label in variants(args.bottom_variants, st, "merge_num_warps"):
                call = jax.jit(lambda *a, stv=stv: merge_pallas(*a, stv, ip, out_dtype=q.dtype))
                rows.append((f"  variant: {label}", median_ms(call, bargs, args.iters), chunks,
                             gathered(n, (*kl_rot, vl))))
    dense_ms = float("nan") if ip else median_ms(dense_fn(config), (q, k, v), args.iters)
    route = kernel_route(q, k, v, config, bs)
    whole = jax.jit(lambda q, k, v: route.forward(q, k, v, config=config, block_sizes=bs, interpret=ip,
                                                  precisions=precisions)[0])
    whole_ms = median_ms(whole, (q, k, v), args.iters)
    if args.kernels and not ip:  # device time per kernel inside the end-to-end call
        print_kernel_times(kernel_times(lambda: whole(q, k, v), 2), "the end-to-end call's kernels", top=12)
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}: {args.inputs} inputs, T={T} top_k={args.top_k} "
          f"layers={config.layer_sizes(T)} B={B} H={H} H_kv={H_KV} K=V={K} bf16, score dots {st.precision}, "
          f"span {st.span}, tile {st.tile} (top: {st_top.tile}), warps {st.num_warps}/{st.merge_num_warps}, merge operands {st.merge_operands}, importance operands {st.importance_operands}, {chunks} chunks of {Qc} positions")
    print("| stage | per chunk ms | chunks | total ms | TB/s gathered |\n|---|---|---|---|---|")
    total = 0.0
    for name, ms, times, *moved in rows:
        total += 0.0 if name.startswith("  variant") else ms * times
        rate = f"{moved[0] / ms / 1e9:.2f}" if moved else ""
        print(f"| {name} | {ms:.2f} | {times} | {ms * times:.1f} | {rate} |")
    print(f"| sum | | | {total:.1f} |\n| end to end (one call) | | | {whole_ms:.1f} |\n"
          f"| dense cuDNN (whole attention) | | | {dense_ms:.1f} |")


if __name__ == "__main__":
    main()
