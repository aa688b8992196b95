"""Block selection over packed rows (SPEC 6 with SPEC 12) on the block kernels (the
merge on Pallas-Triton or Mosaic GPU, the backward's walk on Pallas-Triton or, for
partial sums on a Hopper GPU, Mosaic GPU: `backward.chosen_walk`): the queries laid
out virtually as the tree is (`htree_jax.core.packing`), so that each document's blocks
start at multiples of `b` (a document starts at a multiple of `A = r^(L-1)`) and no block
spans two documents. Every layer below the top is then walked as in an unpacked row
(`t0 mod r^(l+1)` does not change with a document's start); on the top layer a block
walks and merges only its document's nodes, from `firsts` (its first top node) on
(`merge.walk_tiles`: from the tile that holds it), and RoPE being
relative, the positions counted from the row's start score as those counted from the
document's (`merge.layer_walk`).

The merge and the backward run on the virtual rows (`T_v` of them, padding rows zero:
their scores are 0 and their cotangents 0, so they add nothing) and the tree is
`build_packed_tree`'s; the key and value gradients come back through the transpose of
that tree and layout (`jax.vjp` of it, in float32). Device memory beyond the unpacked
kernels': the virtual copies of `q`, `k`, `v` and of the rows' outputs (`T_v / T`
times theirs). The selections are the caller's (`htree_jax.routes`): virtual tree rows,
one list a virtual block.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from htree_jax.core.config import HTreeConfig
from htree_jax.core.packing import Packing, build_packed_tree, tokens_to_virtual, virtual_exists, virtual_to_tokens
from pallas_kernels.block.backward import (block_backward_launch, chosen_sum, chosen_walk, launch_by_partials,
                                           sum_launch)
from pallas_kernels.block.mosaic_backward import TILE as MOSAIC_TILE
from pallas_kernels.block.forward import MERGES, block_layout, block_static, check_merge_route, merge_static
from pallas_kernels.block.merge import BlockStatic, layer_arrays, selection_lists
from pallas_kernels.shared.common import next_power_of_two, pad_axis, pad_rope_halves, unpad_rope_halves
from pallas_kernels.shared.configs import BlockConfig


def packed_static(st: BlockStatic, packing: Packing) -> BlockStatic:
    """A launch for `T_v` virtual positions with the packing's layer count (that of its
    longest document, SPEC 6: `T_v` alone may count one more)."""
    return dataclasses.replace(st, num_layers=packing.num_layers)


def packed_table_positions(config: HTreeConfig, packing: Packing, st: BlockStatic) -> int:
    """RoPE positions the kernels read: every layer's `n` (at most `top_k * r` below the
    top, the virtual top layer's node count there), rounded up to the tile."""
    top = packing.virtual_len // config.compression_rate ** (packing.num_layers - 1)
    return next_power_of_two(max(config.max_candidates, top), st.tile)


def packed_layers(k, v, packing: Packing, config: HTreeConfig, st: BlockStatic):
    """The packed tree of `k`, `v` (token layout) as the block kernels read it
    (`merge.layer_arrays`)."""
    tree = build_packed_tree(tokens_to_virtual(k, packing), tokens_to_virtual(v, packing), virtual_exists(packing),
                             config, packing.num_layers)
    return layer_arrays(tree, st)


@functools.partial(jax.jit, static_argnames=("config", "block", "merge", "interpret"))
def block_forward_packed(q, k, v, selections, firsts, packing: Packing, *, config: HTreeConfig,
                         block: BlockConfig = BlockConfig(), merge: str = "pallas_triton", interpret: bool = False):
    """`forward.block_forward_pallas` over packed rows: `q [B, T, H, K]`, `k`, `v` as
    there (rope layout), `selections` the virtual blocks' lists (layers `L-1 .. 1`, each
    `[B, T_v / b, H_kv, top_k]` virtual tree rows, `-1` padded), `firsts [B, T_v / b]`
    int32 each virtual block's document's first top node; `merge` the merge's kernel
    (`forward.MERGES`; each takes `firsts`, where its top layer's walk starts: Mosaic
    GPU's masks the rest of that step by its refined bitmap). Returns `(o [B, T, H, V]`, `lse [B, T, H]` float32)`."""
    B, T, H, K = q.shape
    H_kv, V = k.shape[2], v.shape[-1]
    G, Tv = H // H_kv, packing.virtual_len
    st = packed_static(merge_static(config, Tv, G, K, V, q.dtype, block, merge), packing)
    check_merge_route(merge, st, K, V, q.dtype, interpret)
    q5 = block_layout(pad_rope_halves(tokens_to_virtual(q, packing), st.half), H_kv, st, Tv)
    o, lse = MERGES[merge].launch(q5, packed_layers(k, v, packing, config, st), selection_lists(selections, st),
                                  config, st, K, packed_table_positions(config, packing, st), interpret=interpret,
                                  firsts=firsts)
    o = virtual_to_tokens(o[:, :, :, :G, :V].reshape(B, Tv, H, V), packing)
    return o, virtual_to_tokens(lse[:, :, :, :G].reshape(B, Tv, H), packing)


@functools.partial(jax.jit, static_argnames=("config", "block", "interpret"))
def block_backward_packed(q, k, v, o, lse, do, selections, firsts, packing: Packing, *, config: HTreeConfig,
                          block: BlockConfig = BlockConfig(), interpret: bool = False, dead_rows=None):
    """`backward.block_backward_pallas` of `block_forward_packed`'s output `o` with its
    `lse`, cotangent `do`, and the selections and `firsts` it was given: `(dq, dk, dv)`
    in the dtypes of `q, k, v`. The key and value gradients by atomics, or with
    `BlockConfig(backward_sum="partials")` (the default on a GPU) summed by node from
    partial sums (bitwise reproducible)."""
    B, T, H, K = q.shape
    H_kv, V = k.shape[2], v.shape[-1]
    G, Tv = H // H_kv, packing.virtual_len
    static = lambda tile: packed_static(block_static(config, Tv, G, K, V, q.dtype, tile, block.backward_num_warps),
                                        packing)
    st = static(MOSAIC_TILE)
    walk = chosen_walk(block, st, K, V, q.dtype, packed_table_positions(config, packing, st), interpret)
    if walk != "mosaic_gpu":
        st = static(block.backward_tile)
    if dead_rows is not None:
        do = jnp.where(dead_rows[..., None], jnp.zeros((), do.dtype), do)
        o = jnp.where(dead_rows[..., None], jnp.zeros((), o.dtype), o)
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)  # [B, T, H]
    layout = lambda x: block_layout(tokens_to_virtual(x, packing), H_kv, st, Tv)
    rows = (layout(pad_rope_halves(q, st.half)), layout(pad_axis(do, -1, st.vp)), layout(lse), layout(delta))

    layers = packed_layers(k, v, packing, config, st)  # as the forward merged them
    node_counts = tuple(Tv // config.compression_rate**l for l in range(st.num_layers))
    lists, table_rows = selection_lists(selections, st), packed_table_positions(config, packing, st)
    if chosen_sum(block, interpret) == "partials":
        dq5, grads = launch_by_partials(rows, layers, selections, lists, config=config, st=st, head_dim=K, T=Tv,
                                        table_rows=table_rows, node_counts=node_counts,
                                        budget=block.backward_partial_bytes, interpret=interpret, firsts=firsts,
                                        walk=walk, sum_launch=sum_launch(block), sum_kernel=block.backward_sum_kernel)
    else:
        dq5, *grads = block_backward_launch(*rows, layers, lists, config, st, K, table_rows, node_counts, interpret,
                                            firsts=firsts)
    dq = virtual_to_tokens(unpad_rope_halves(dq5[:, :, :, :G], K).reshape(B, Tv, H, K), packing)
    # The layers' gradients back through the tree and the layout: the transpose of
    # `packed_layers` (linear), taken in float32. A layer's rows past its nodes (padding,
    # and the spare row the atomics add to) get nothing back.
    _, pull = jax.vjp(lambda k32, v32: packed_layers(k32, v32, packing, config, st), k.astype(jnp.float32),
                      v.astype(jnp.float32))
    dk, dv = pull([pad_axis(g[:, :, : x.shape[2]], 2, x.shape[2]) for g, x in zip(grads, layers)])
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


__all__ = ["block_backward_packed", "block_forward_packed"]
