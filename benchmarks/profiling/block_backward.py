"""Where block selection's backward time goes at one size (GPU): the whole backward at
the default (`block_backward_pallas`), then its pieces with partial sums: the inverted
index and the chunks' bounds (once a call), one chunk's walk and one chunk's sums a
layer, each timed on the first chunk and scaled by the chunks (the last, a remainder,
counted as a whole one), for each `--budgets` of `BlockConfig.backward_partial_bytes`.

    python -m benchmarks.profile --pass block-backward --T 131072 [--budgets 4,16,32] [--walk auto]

The benchmark shape (B=1, H=32, H_kv=4, K=V=128, bf16), `selection_block=16`,
`block_source="first"`; medians after a warm-up (`median_ms`).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jax import lax

from htree_jax import HTreeConfig
from htree_jax.backends import blocks_of
from htree_jax.bench import INPUTS, median_ms
from htree_jax.cli import DefaultsHelpFormatter
from htree_jax.core.tree import build_tree
from pallas_kernels.block.backward import block_backward_launch, block_backward_pallas, chosen_walk
from pallas_kernels.block.forward import block_forward_pallas, block_static
from pallas_kernels.block.layout import block_layout, table_positions
from pallas_kernels.block.inverted import inverted_index
from pallas_kernels.block.merge import BlockLaunch, layer_arrays, rope_tables, selection_lists
from pallas_kernels.block.mosaic_backward import TILE, block_backward_mosaic, walk_layers
from pallas_kernels.block.mosaic_sums import mosaic_sum_partials
from pallas_kernels.block.partials import (LANES, SumLaunch, chunk_blocks, chunk_edges, entry_keys, slab_widths,
                                         sum_partials, zero_totals)
from pallas_kernels.shared.common import pad_axis, pad_rope_halves
from pallas_kernels.shared.configs import BlockConfig
from pallas_kernels.shared.kernels import BlockKernels


def main(argv=None):
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter, description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, default=131072)
    p.add_argument("--top-k", type=int, default=512)
    p.add_argument("--budgets", default="16", help="backward_partial_bytes to profile, GiB")
    p.add_argument("--walk", default="auto", help="BlockKernels.walk")
    p.add_argument("--inputs", default="random", choices=sorted(INPUTS))
    p.add_argument("--sum-variants", default="8:1", help="the sums' warps:stages to time (the first is the whole "
                   "backward's), or 'mosaic' (BlockKernels.sum_kernel='mosaic_gpu', with the Mosaic GPU walk)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--interpret", action="store_true", help="CPU smoke test of this script (Pallas-Triton, interpreted)")
    args = p.parse_args(argv)
    ip = args.interpret
    T = args.T
    config = HTreeConfig(top_k=args.top_k, selection_block=16, block_source="first")
    q, k, v = INPUTS[args.inputs](T)
    B, _, H, K = q.shape
    H_kv, V = k.shape[2], v.shape[-1]
    G, r = H // H_kv, config.compression_rate
    selections = jax.jit(lambda q, k, v: blocks_of(q, k, v, config, impl="pallas_interpret" if ip else "pallas"))(
        q, k, v)
    o, lse = jax.jit(lambda *a: block_forward_pallas(*a, config=config, interpret=ip))(q, k, v, selections)
    print(f"{args.inputs} inputs, T={T} top_k={args.top_k} layers={config.layer_sizes(T)}", flush=True)
    for gib in (float(x) for x in args.budgets.split(",")):
        budget = int(gib * 2**30)
        variants = [item if item == "mosaic" else tuple(int(x) for x in item.split(":"))
                    for item in args.sum_variants.split(",")]
        mosaic_sums = variants[0] == "mosaic"
        launch_of = {} if mosaic_sums else dict(backward_sum_num_warps=variants[0][0],
                                                backward_sum_num_stages=variants[0][1])
        block = BlockConfig(backward_partial_bytes=budget, **launch_of)
        kernels = BlockKernels(sums="partials", walk=args.walk,
                               sum_kernel="mosaic_gpu" if mosaic_sums else "pallas_triton")
        whole = jax.jit(lambda *a, b=block: block_backward_pallas(*a, config=config, block=b, kernels=kernels,
                                                                  interpret=ip))
        whole_ms = median_ms(whole, (q, k, v, o, lse, o, selections), args.iters)
        # The launch's operands as `block_backward_pallas` lays them out.
        st = block_static(config, T, G, K, V, q.dtype, TILE, block.backward_num_warps)
        walk = chosen_walk(kernels, st, K, V, q.dtype, table_positions(config, T, st), ip)
        if walk != "mosaic_gpu":
            st = block_static(config, T, G, K, V, q.dtype, block.backward_tile, block.backward_num_warps)
        Tp, NB = -(-T // r) * r, -(-T // r)
        delta = jnp.sum(o.astype(jnp.float32) ** 2, axis=-1)
        layout = lambda x: block_layout(x, H_kv, st, Tp)
        rows = (layout(pad_rope_halves(q, st.half)), layout(pad_axis(o, -1, st.vp)), layout(lse), layout(delta))
        layers, table_rows = layer_arrays(build_tree(k, v, config), st), table_positions(config, T, st)
        lists, nodes = selection_lists(selections, st), tuple(config.layer_sizes(T))
        widths = slab_widths(nodes, table_rows, st)
        itemsize = q.dtype.itemsize if walk == "mosaic_gpu" else 4
        count = chunk_blocks(NB, r // st.queries, B * H_kv * sum(widths) * (2 * st.half + st.vp) * itemsize, budget)
        chunks = -(-NB // count)

        def index_of(selections):
            index = inverted_index(selections, r=r, b=r, T=T, num_layers=st.num_layers, layer_sizes=nodes,
                                   shape=(B, NB, H_kv))
            edges = [c * count for c in range(NB // count + 1)] + ([NB] if NB % count else [])
            return index, [chunk_edges(entry_keys(ix, NB), -(-n // r), NB, edges) for ix, n in zip(index, nodes)]

        index_ms = median_ms(jax.jit(index_of), (selections,), args.iters)
        index, bounds = jax.jit(index_of)(selections)
        launch = block_backward_mosaic if walk == "mosaic_gpu" else block_backward_launch
        cut = lambda x, per: lax.slice_in_dim(x, 0, count * per, axis=1)

        # The Mosaic GPU walk's layers are laid out once a backward (`walk_layers`), as there.
        settings = BlockLaunch(config, st, K, table_rows, nodes, ip, widths)
        prepared = jax.jit(lambda layers: walk_layers(layers, settings))(layers) if walk == "mosaic_gpu" else None

        def walk_chunk(rows, layers, lists, prepared):
            more = {} if prepared is None else dict(prepared=prepared)
            return launch(tuple(cut(x, r) for x in rows), layers, [cut(x, 1) for x in lists], settings,
                          sums="partials", offset=jnp.int32(0), **more)

        walk_ms = median_ms(jax.jit(walk_chunk), (rows, layers, lists, prepared), args.iters)
        dq5, *out = jax.jit(walk_chunk)(rows, layers, lists, prepared)
        slabs, ranges = (out[0], out[1]) if walk == "mosaic_gpu" else (out[:-1], out[-1])
        tables = None
        if walk == "mosaic_gpu":
            cos, sin = rope_tables(config, K, table_rows, st)
            pad = ((0, max(0, max(widths) - table_rows)), (0, 0))
            tables = (jnp.pad(cos, pad, constant_values=1.0), jnp.pad(sin, pad))
        sum_ms = {}
        for variant in variants:
            for l, ix in enumerate(index):
                totals = zero_totals(B, H_kv, -(-nodes[l] // r), r, 2 * st.half, st.vp)
                if variant == "mosaic":
                    sums, kernel = SumLaunch(r, widths[l], r // st.queries, l), mosaic_sum_partials
                else:
                    sums = SumLaunch(r, widths[l], r // st.queries, l, variant[0], variant[1], ip)
                    kernel = sum_partials
                add = jax.jit(lambda ix, lo, hi, ranges, pk, pv, tables, totals, s=sums, f=kernel: f(
                    jnp.zeros((LANES,), jnp.int32), (lo, hi), ix, ranges, (pk, pv), launch=s, tables=tables,
                    totals=totals))
                sum_ms.setdefault(variant, []).append(median_ms(
                    add, (ix, bounds[l][0], bounds[l][1], ranges, slabs[2 * l], slabs[2 * l + 1], tables, totals),
                    args.iters))
        del dq5, slabs, ranges, out, prepared
        first_sums = sum_ms[variants[0]]
        pieces = index_ms + chunks * (walk_ms + sum(first_sums))
        print(f"budget {gib:g} GiB ({walk} walk): {count} blocks a chunk, {chunks} chunks; backward {whole_ms:.1f} ms; "
              f"index {index_ms:.1f}; a chunk's walk {walk_ms:.2f} (x{chunks} = {chunks * walk_ms:.1f}); "
              f"its sums by layer " + "; ".join(
                  ("mosaic" if v == "mosaic" else f"{v[0]}:{v[1]}") + " " + ", ".join(f"{x:.2f}" for x in ms)
                  + f" (x{chunks} = {chunks * sum(ms):.1f})" for v, ms in sum_ms.items())
              + f"; pieces {pieces:.1f}, the rest (XLA: layouts, the tree, dq's turn, the push down) "
              f"{whole_ms - pieces:.1f}", flush=True)
    return 0


__all__ = ["main"]
