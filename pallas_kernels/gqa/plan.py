"""What the Pallas forward and backward passes plan before their loop over chunks of
queries: the launches their kernel families' configs (`configs.py`) give at the
shapes, and the padded tree and keys as the kernels read them (`prepare`). Each
chunk's walk: `chunks.py`. The passes (`forward.py`, `backward.py`) compose these
with the merge and gradient kernels.

Device memory beyond inputs, tree and output: the rotated copies of the tree's keys
(the top layer once in float32, and as the merge and importance dots read it; each lower
layer in `span / r` copies, `rotate_phases`, as the dots that read them take them, the
bottom's merge dots and the other layers' importance dots: one bfloat16 array or two
bfloat16 / float32 parts, `key_operands`); per chunk of `Qc` positions the packed keys
(`B * Qc * H_kv * Mp` int32) and next parents (`2 * B * Qc * H_kv * P`), the scores of
a layer below the top that selects (`B * Qc * H_kv * Gp * Mp` float32, `Gp` the
query rows, `group_rows`, only when `L >= 3`; the chunk sized as for 16 rows),
the queries padded and rotated for the top layer (`B * Qc * H_kv * Gt * Kp` float32)
and the softmax state (`B * Qc * H * (V + 2)` float32); the selections
(`(L-1) * B*T*H_kv*top_k` int32).
`Qc` is chosen so that `Qc * Mp <= T * top_k` (so nothing is `O(T * M)`) and the
buffers stay under `chunk_budget_bytes`. With `selection="bound"` (SPEC 11) also the
radii of every layer above the bottom (`B * H_kv * N_l * bound_width` as the importance
dots read them: float32, or two bfloat16 parts) and, per chunk, the bound scores beside
the stored scores (the chunk sized as without the bound).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from htree_jax.core.bounds import group_count, tree_radii
from htree_jax.core.config import HTreeConfig
from htree_jax.core.packing import build_packed_tree, layer_exists, tokens_to_virtual, virtual_exists
from htree_jax.core.rope import apply_rope
from pallas_kernels.shared import shared_memory
from pallas_kernels.shared.common import (
    dividing_chunk,
    MAX_HEAD_DIM,
    MAX_VALUE_DIM,
    MIN_DIM,
    LayerStatic,
    check_group,
    head_split,
    next_power_of_two,
    pad_axis,
    pad_nodes,
    pad_rope_halves,
)
from pallas_kernels.shared.configs import KernelConfigs
from pallas_kernels.shared.guarded import KernelCall
from pallas_kernels.shared.precision import Precisions, key_operands
from pallas_kernels.shared.rope import padded_rope_table, rotate_keys, rotate_phases
from pallas_kernels.shared.tree_build import PoolBlockSizes, pool_layer_pallas

def top_pipeline(tuning: KernelConfigs, precisions: Precisions, kp: int, vp: int, G: int, Mp: int,
                 bound_width: int = 0) -> tuple:
    """`(merge stages, (importance queries per program, tile, stages))` of the top layer
    for padded head dims `kp, vp`, `G` heads per kv head and `bound_width` feature
    groups of `selection="bound"` (0 without). The merge: the block sizes' stages for
    heads up to 128 features (float32 operands at most 2), one stage past them (two
    overflow shared memory at K=192). The importance kernel: the first of
    `top_importance_candidates` that fits shared memory (`shared_memory.top_importance`)."""
    stages = tuning.top.num_stages if precisions.merge_operands else min(tuning.top.num_stages, 2)
    if kp > 128 or vp > 128:
        stages = 1
    gt = next_power_of_two(G)
    footprint = lambda c: shared_memory.top_importance(c[0] * gt, c[0], c[1], kp, bound_width, precisions.scores,
                                                       precisions.importance_operands)
    return stages, shared_memory.first_fitting(top_importance_candidates(tuning, precisions, gt, Mp), footprint)


def bound_groups(config: HTreeConfig, K: int) -> tuple:
    """`(bound_rope, bound_width)` of `selection="bound"` in the kernels' layout: the
    rotated features once K is padded (each RoPE half padded; the padding pairs rotated
    groups of norm 0) and the feature-group count the importance dots read per node,
    padded; `(0, 0)` with the mean."""
    if not config.ranks_by_bound:
        return 0, 0
    kp = next_power_of_two(K, 32)
    bound_rope = kp - (K - (config.partial_rope(K) or K))
    return bound_rope, next_power_of_two(group_count(kp, bound_rope), 16)


def top_importance_launch(config: HTreeConfig, tuning: KernelConfigs, dtype, K: int, V: int, G: int) -> tuple:
    """`((queries per program, tile, stages), bytes)`: the top layer's importance launch
    `prepare` picks for `G <= KERNEL_GROUP` heads per (virtual) kv head, and its shared
    memory by the model (`shared_memory.top_importance`)."""
    precisions = Precisions.for_dtype(jnp.dtype(dtype))
    kp, vp = next_power_of_two(K, 32), next_power_of_two(V, 16)
    width = bound_groups(config, K)[1]
    launch = top_pipeline(tuning, precisions, kp, vp, G, layout(config, tuning)[3], width)[1]
    queries, tile, stages = launch
    footprint = shared_memory.top_importance(queries * next_power_of_two(G), queries, tile, kp, width,
                                             precisions.scores, precisions.importance_operands)
    return launch, footprint.bytes(stages)


def top_importance_candidates(tuning: KernelConfigs, precisions: Precisions, gt: int, Mp: int) -> list:
    """`(queries per program, tile, stages)` of the top layer's importance kernel, fastest
    first (journal, 2026-11-26 (5)): the block sizes' (float32 operands at most 64
    candidates a step), then their tile in one stage, 64 candidates in two stages (the bound's setting before
    2026-11-26), one stage, smaller tiles, then half and a quarter of the query rows
    (wide heads with the bound)."""
    bq = max(1, next_power_of_two(tuning.top.rows) // gt, 16 // gt)
    tile = next_power_of_two(tuning.top.keys_tile, 16)
    if precisions.importance_operands is None:
        tile = min(tile, 64)
    out = []
    for queries in (bq, max(1, bq // 2, 16 // gt), max(1, bq // 4, 16 // gt)):
        for t, s in ((tile, tuning.top.keys_stages), (tile, 1), (64, 2), (64, 1), (32, 1), (16, 1)):
            c = (queries, min(t, tile, Mp), s)
            if c not in out:
                out.append(c)
    return out


def group_rows(G: int, tuning: KernelConfigs) -> int:
    """`Gp`: the product rows of one query's `G` heads in the kernels below the top layer."""
    return next_power_of_two(G, tuning.layer.min_query_rows)


def check_pallas_dims(dims, backend: str = "pallas") -> None:
    """The Pallas kernels' limits, checked before any launch; the errors name `backend`
    (`"pallas"` or `"pallas_interpret"`, the same kernels)."""
    if not MIN_DIM <= dims.head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"backend {backend!r} supports head dim K in [{MIN_DIM}, {MAX_HEAD_DIM}], "
                         f"got K = {dims.head_dim}")
    if not MIN_DIM <= dims.value_dim <= MAX_VALUE_DIM:
        raise ValueError(f"backend {backend!r} supports value dim V in [{MIN_DIM}, {MAX_VALUE_DIM}], "
                         f"got V = {dims.value_dim}")
    check_group(dims.group_size, f"backend {backend!r}")


def layout(config: HTreeConfig, tuning: KernelConfigs):
    """`(span, tile, P, Mp)`: candidates per product and per step below the top layer,
    and the padded candidate-buffer geometry (`P` parent slots, `Mp = P * r` positions)."""
    r, M = config.compression_rate, config.max_candidates
    span = max(16, r, min(next_power_of_two(tuning.layer.span), 16 * r, M))
    tile = max(span, min(next_power_of_two(tuning.layer.tile), M))
    per_tile = tile // r
    P = -(-config.top_k // per_tile) * per_tile
    return span, tile, P, P * r


def chunk_size(config: HTreeConfig, tuning: KernelConfigs, B, T, H_kv, Mp, score_rows=0):
    """Query positions per chunk: the per-chunk buffers (packed keys and next parents,
    int32, and `score_rows` float32 scores per candidate where a layer below the top
    selects) within `chunk_budget_bytes`, and `Qc * Mp <= T * top_k`."""
    per_query = (8 + 4 * score_rows) * B * H_kv * Mp
    limit = max(1, min(tuning.chunk_budget_bytes // per_query, T // config.compression_rate, T))
    return int(limit)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["layers", "top_k_imp", "top_k_merge", "top_v", "cos", "sin", "q4", "packing",
                                "top_local", "positions", "radii", "top_radii", "query_packing"],
                   meta_fields=["st", "st_scores", "st_merge", "st_top", "st_top_keys", "st_select", "parents_width",
                                "chunk", "sizes", "head_split", "bound_rope", "bound_width", "query_rows"])
@dataclasses.dataclass(frozen=True)
class Prepared:
    """Everything the per-layer launches share: padded tree, RoPE tables, queries."""

    # [(importance keys, merge keys, V_l [B, H_kv, N_l, Vp]), ...], bottom first, the top
    # layer left out. The keys: `key_operands` of `rotate_phases(K_l)` for the dots that
    # read them. The bottom layer only merges (no importance keys: None); the layers
    # above it merge from their stored scores (no merge keys: None, except for the
    # backward, which scores them again with the merge dots).
    layers: list
    top_k_imp: tuple  # key_operands of the top layer's keys rotated by position, tile-padded
    top_k_merge: tuple  # the same for the merge dots (often the same arrays)
    top_v: jax.Array  # the top layer's values, tile-padded
    cos: jax.Array  # [Mp, Kp/2]
    sin: jax.Array
    q4: jax.Array  # [B, chunks * Qc, H_kv, G, Kp]; heads padded per chunk, per kernel
    st: LayerStatic  # the layers below the top: one query per program
    st_scores: LayerStatic  # the forward's scores kernel below the top (its own pipeline depth)
    st_merge: LayerStatic  # the forward's merges below the top (theirs)
    st_top: LayerStatic  # the top layer: `block_queries` queries per program
    st_top_keys: LayerStatic  # its importance kernel (its own tile and pipeline depth)
    st_select: LayerStatic  # the shared top-K kernel of every layer (its own warps)
    parents_width: int  # P
    chunk: int  # Qc, a multiple of st_top.block_queries
    sizes: tuple  # the tree's layer sizes (virtual ones when packed)
    packing: object = None  # `htree_jax.core.packing.Packing`, or None: one document per row
    top_local: object = None  # packed: `[B, N_top]` int32, each top node's place in its document
    positions: object = None  # `[S]` int32: the queries' token positions (None: `0 .. S-1`)
    head_split: int = 1  # virtual kv heads per kv head (`head_split`): `H_kv` above counts them
    # `selection="bound"` (SPEC 11): each lower layer's radii (None for the bottom) and the
    # top layer's, as `key_operands` of `[B, H_kv, N, bound_width]` (groups padded with
    # zeros); `bound_rope`: the `rope_dim` that gives the groups of the kernels' padded
    # halves to `core.bounds.group_norms`. Without the bound: None and 0.
    radii: object = None
    top_radii: object = None
    bound_rope: int = 0
    bound_width: int = 0
    query_rows: int = 0  # Gp: a query's G heads padded for the kernels below the top (`group_rows`)
    # Packed: where the queries sit (`position`, `doc_start` `[B, S]` virtual) where they
    # are not the tokens of `packing` (block selection's ranking rows); None: they are.
    query_packing: object = None


def packed_tree(k, v, packing, config: HTreeConfig):
    """The tree of packed rows (`htree_jax.core.packing`): `[(K_l, V_l) [B, N_l, H_kv, *]]` in
    the virtual layout, bottom first, and each top node's index inside its document
    `[B, N_top]` (its RoPE position on the top layer)."""
    exists = virtual_exists(packing)
    layers = build_packed_tree(tokens_to_virtual(k, packing), tokens_to_virtual(v, packing), exists, config,
                               packing.num_layers)
    A = config.compression_rate ** (packing.num_layers - 1)
    top_local = jnp.zeros((k.shape[0], layers[-1][0].shape[1]), jnp.int32)
    top_local = jax.vmap(lambda x, node, first: x.at[node].set(node - first))(
        top_local, packing.position // A, packing.doc_start // A)
    return layers, top_local


class Places(NamedTuple):
    """Where a call's queries and tokens sit, each None where it does not apply:
    `packing` the rows' packed documents (`htree_jax.core.packing.Packing`; the tree is
    then laid out virtually), `positions [S]` the queries' positions in the sequence of
    `k, v` (context parallelism: a shard's queries against every token; None: `q` holds
    them all), `query_packing` (with `packing`) the queries' own virtual places
    (`Packing.position`, `doc_start` `[B, S]`), where `q` is not the tokens of `k` (block
    selection's ranking rows)."""

    packing: Any = None
    positions: Any = None
    query_packing: Any = None


def prepare(q, k, v, call: KernelCall, precisions: Precisions, *, places: Places = Places(), for_backward: bool = False,
            split: int = 1) -> Prepared:
    """The padded tree, keys as the products read them, tables and queries, for `call`
    (its config, the kernels' configs and interpret mode) and the queries' `places`.
    With `for_backward`, every layer below the top keeps merge keys: the backward scores
    every merged candidate again with the merge dots. With `places.packing` the tree is
    laid out virtually (`htree_jax.core.packing`), its top keys rotated by their place
    in their document, the top layer padded by a tile more (tiles read from a
    document's start). `split`: `k, v` hold each kv head `split` times (`split_heads`)."""
    config, tuning, interpret = call.config, call.tuning, call.interpret
    packing, positions, query_packing = places
    B, T, H, K = q.shape
    H_kv, V = k.shape[2], v.shape[-1]
    G = H // H_kv
    r = config.compression_rate
    kp, vp = next_power_of_two(K, 32), next_power_of_two(V, 16)
    half = kp // 2
    span, tile, P, Mp = layout(config, tuning)
    bound_rope, bound_width = bound_groups(config, K)
    # The scores kernel holds the query rows' group norms and gathers radii with the
    # bound: one stage where two do not fit (packed latent attention).
    scores_footprint = shared_memory.per_query(group_rows(G, tuning), tile, kp, 0, jnp.dtype(q.dtype).itemsize,
                                               bound_width, precision=precisions.scores,
                                               operands=precisions.importance_operands)
    st = LayerStatic(
        r=r, tile=tile, span=span, group=G, alpha=config.score_scale(K), importance=config.importance,
        strict_causal=config.strict_causal, log_n=config.log_n, top_k=config.top_k,
        precision=precisions.scores, importance_operands=precisions.importance_operands,
        merge_precision=precisions.merge, merge_operands=precisions.merge_operands,
        num_warps=tuning.layer.num_warps, merge_num_warps=tuning.layer.merge_num_warps,
        num_stages=shared_memory.per_query_stages(tuning.layer.num_stages, scores_footprint),
    )
    st_scores = dataclasses.replace(st, num_stages=shared_memory.per_query_stages(tuning.layer.scores_num_stages,
                                                                                  scores_footprint))
    # The merges gather value rows too (and keys, at the bottom), in the merge dots' operands.
    merge_footprint = shared_memory.per_query(group_rows(G, tuning), tile, kp, vp, jnp.dtype(q.dtype).itemsize,
                                              precision=precisions.merge, operands=precisions.merge_operands)
    st_merge = dataclasses.replace(st, num_stages=shared_memory.per_query_stages(tuning.layer.merge_num_stages,
                                                                                 merge_footprint))
    as_kernel_layer = lambda kl, vl: (jnp.swapaxes(pad_rope_halves(kl, half), 1, 2),
                                      jnp.swapaxes(pad_axis(vl, -1, vp), 1, 2))
    top_local = None
    if packing is None:
        layers = [as_kernel_layer(k, v)]
        for _ in config.layer_sizes(k.shape[1])[1:]:
            keys, values = layers[-1]
            layers.append((pool_layer_pallas(keys, r, PoolBlockSizes(), interpret),
                           pool_layer_pallas(values, r, PoolBlockSizes(), interpret)))
    else:
        tree, top_local = packed_tree(k, v, packing, config)
        layers = [as_kernel_layer(kl, vl) for kl, vl in tree]
    sizes = tuple(x[0].shape[2] for x in layers)
    num_layers = len(layers)
    cos, sin = padded_rope_table(Mp, K, config.rope_base, half, config.partial_rope(K))
    # Top layer: rows = queries x next_power_of_two(G) heads, at least 16 (a dot's minimum).
    gt = next_power_of_two(G)
    bq = max(1, next_power_of_two(tuning.top.rows) // gt, 16 // gt)
    top_tile = min(next_power_of_two(tuning.top.tile, 16), Mp)
    merge_stages, (keys_queries, keys_tile, keys_stages) = top_pipeline(tuning, precisions, kp, vp, G, Mp,
                                                                        bound_width)
    st_top = dataclasses.replace(st, block_queries=bq, tile=top_tile, num_warps=tuning.top.num_warps,
                                 num_stages=merge_stages)
    st_top_keys = dataclasses.replace(st_top, block_queries=min(bq, keys_queries), tile=keys_tile,
                                      num_stages=keys_stages)
    # The top layer's nodes padded to a multiple of both kernels' tiles (powers of two).
    top_pad = max(top_tile, st_top_keys.tile)
    extra = 0 if packing is None else top_pad  # packed: tiles start at a document's first node
    top_v = pad_axis(pad_nodes(layers[-1][1], top_pad), 2, -(-sizes[-1] // top_pad) * top_pad + extra)
    # The keys as the products read them: rotated, then split for 3xTF32 or cast to the
    # operand dtype, once per layer (one array when both dots take the same operands).
    imp_spec = (precisions.scores, precisions.importance_operands)
    merge_spec = (precisions.merge, precisions.merge_operands)

    if packing is None:
        top_rotated = rotate_keys(layers[-1][0], cos, sin, top_pad)
    else:
        top_rotated = apply_rope(layers[-1][0].astype(jnp.float32), cos[top_local][:, None], sin[top_local][:, None])
        top_rotated = pad_axis(top_rotated, 2, top_v.shape[2])
    top_k_merge = key_operands(top_rotated, *merge_spec)
    top_k_imp = key_operands(top_rotated, *imp_spec, split=False) if imp_spec != merge_spec else top_k_merge
    # Below the top: the keys in span/r rotated copies, for the importance products of
    # the layers that select (their merges reuse the stored scores) and for the bottom
    # layer's merge (every layer's, for the backward).
    lower = []
    for l, (kl, vl) in enumerate(layers[:-1]):
        phases = rotate_phases(kl, cos, sin, st)
        lower.append((key_operands(phases, *imp_spec) if l > 0 else None,
                      key_operands(phases, *merge_spec) if l == 0 or for_backward else None, vl))
    radii = top_radii = None
    if config.ranks_by_bound:  # the radii of the stored layers, in the kernels' layout
        exists = None if packing is None else layer_exists(virtual_exists(packing), num_layers, r)
        rho = tree_radii([jnp.swapaxes(kl, 1, 2) for kl, _ in layers], r, bound_rope, exists)
        rho = [pad_axis(jnp.swapaxes(x, 1, 2), -1, bound_width) for x in rho]  # [B, H_kv, N_l, width]
        radii = [key_operands(x, *imp_spec) if l > 0 else None for l, x in enumerate(rho[:-1])]
        top_radii = key_operands(pad_axis(rho[-1], 2, top_rotated.shape[2]), *imp_spec, split=False)
    # Layers below the top that select (L >= 3) store their scores per chunk (and, with
    # the bound, its scores beside them: the chunks are sized as without, twice the
    # buffer for half the launches).
    # (Sized as for 16 score rows whatever `min_query_rows`: the buffers beside the scores,
    # the rotated queries and the softmax state, grow with the chunk; sized by 8 rows, the
    # forward at T=1M, top_k=64 planned 1.4 GiB more.)
    score_rows = next_power_of_two(G, 16) if num_layers >= 3 else 0
    Qc = -(-chunk_size(config, tuning, B, T, H_kv, Mp, score_rows) // bq) * bq
    if q.size * q.dtype.itemsize >= tuning.chunk_budget_bytes:
        Qc = dividing_chunk(T, Qc, bq)
    q4 = pad_rope_halves(q.reshape(B, T, H_kv, G, K), half)
    q4 = pad_axis(q4, 1, -(-T // Qc) * Qc)
    st_select = dataclasses.replace(st, num_warps=tuning.layer.select_num_warps)
    return Prepared(lower, top_k_imp, top_k_merge, top_v, cos, sin, q4, st, st_scores, st_merge, st_top, st_top_keys,
                    st_select, P, Qc, sizes, packing,
                    top_local, positions, split, radii, top_radii, bound_rope, bound_width,
                    group_rows(G, tuning), query_packing)


def split_heads(k, v, G: int):
    """`(k, v, split)`: groups of more than `KERNEL_GROUP` heads as `split` virtual kv
    heads of `KERNEL_GROUP` each, `k, v [B, T, H_kv * split, *]` (each kv head repeated:
    `split` times the keys' and values' memory, and their gathers; the heads' products
    are the same)."""
    split = head_split(G)
    if split == 1:
        return k, v, 1
    return jnp.repeat(k, split, axis=2), jnp.repeat(v, split, axis=2), split
