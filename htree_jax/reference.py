"""The jittable JAX reference of htree attention: SPEC section 2 with static shapes.

One query `(b, t, h_kv)` walks the tree top-down with a parent list `[top_k]` padded
with `-1` and a candidate buffer of `M = top_k * compression_rate` positions, position
`p = s*r + c` holding node `parents[s]*r + c`. The same step runs for every layer,
including the top one, whose (virtual) parents are `0 .. floor(i*_{L-1} / r)`.
Queries are processed in chunks of `query_chunk` positions (`lax.map`), so the
`[chunk, M, K]` gathers are the only large intermediates.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from htree_jax.core.blocks import block_rows
from htree_jax.core.bounds import bound_scores, tree_radii
from htree_jax.core.config import FORCED_IMPORTANCE, HTreeConfig
from htree_jax.core.indexer import (
    forced_index_key,
    index_kl,
    index_scores,
    index_tree,
    pack_index_scores,
    per_kv_head,
)
from htree_jax.core.indexing import (
    candidate_count,
    candidate_nodes,
    num_parents,
    pack_importance,
    top_layer_parents,
)
from htree_jax.core.one_layer import causal_attention_reference, one_layer
from htree_jax.core.packing import build_packed_tree, layer_exists, tokens_to_virtual, virtual_exists
from htree_jax.core.rope import apply_rope, rope_table
from htree_jax.core.softmax import importance, merge, normalize
from htree_jax.core.tree import build_tree

# Small chunks stay cache-resident: on a CPU 64 MiB ran faster than larger budgets (journal, 2026-11-21).
CPU_CHUNK_BUDGET_BYTES = 64 << 20
# A benchmark that runs the reference on a GPU (`benchmarks/frontier.py`'s block selection)
# may raise the budget for its process: a GPU runs a chunk's gathers in parallel and pays
# per `lax.map` step. Not the default: the GPU gate has not run with another budget.
CHUNK_BUDGET_ENV = "HTREE_REFERENCE_CHUNK_BYTES"


def chunk_budget_bytes() -> int:
    """The default bytes of one query chunk's intermediates: 64 MiB, or the environment's
    `HTREE_REFERENCE_CHUNK_BYTES`."""
    value = os.environ.get(CHUNK_BUDGET_ENV)
    if value is None:
        return CPU_CHUNK_BUDGET_BYTES
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{CHUNK_BUDGET_ENV} must be a positive number of bytes, got {value!r}")
    return int(value)


def chunk_bytes_per_query(config: HTreeConfig, batch, num_kv_heads, group, head_dim, value_dim):
    """Bytes of per-layer intermediates for one query position (all batch rows, kv heads).

    Per `(b, t, h_kv)` the layer step holds float32/int32 arrays: the gathered keys and
    values (`M * (K + V)`), the query rotated once per parent slot (`top_k * G * K`),
    scores, weights and their masked copies (`4 * G * M`), and node indices, masks and
    packed keys (`6 * M`).
    """
    M = config.max_candidates
    per_head = M * (head_dim + value_dim + 4 * group + 6) + config.top_k * group * head_dim
    if config.selects_by_block:  # SPEC 12's ranking rows: their rotations and scores
        rows = group * (config.selection_block if config.block_source == "previous" else 1)
        per_head += rows * (2 * M + config.top_k * head_dim + head_dim)
    return 4 * per_head * batch * num_kv_heads


def memory_limit_bytes() -> int:
    """The bytes one call can hold at most: this process's first device's limit where it
    reports one (a GPU), else the host's physical memory (the CPU). A local device: in a
    run of several processes another process's device answers nothing of its memory (a
    call to it left two processes' collectives waiting)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_candidate_buffer(config: HTreeConfig, batch, num_kv_heads, group, head_dim, value_dim) -> None:
    """A ValueError, before any work, where the reference's intermediates for a single
    query position (`chunk_bytes_per_query`: its candidate buffer of `M = top_k *
    compression_rate` nodes, for every batch row and kv head) exceed what the device
    holds (`memory_limit_bytes`): no chunking could run such a call."""
    need = chunk_bytes_per_query(config, batch, num_kv_heads, group, head_dim, value_dim)
    limit = memory_limit_bytes()
    if need > limit:
        raise ValueError(
            f"top_k * compression_rate = {config.top_k} * {config.compression_rate} = {config.max_candidates} "
            f"candidates a query: the reference needs {need / 2**30:.1f} GiB for one query position (B = {batch}, "
            f"H_kv = {num_kv_heads}), more than the {limit / 2**30:.1f} GiB of {jax.local_devices()[0].platform!r}; "
            "lower top_k or compression_rate (a tree of one layer, T <= top_k * compression_rate, takes any)")


def default_query_chunk(config, batch, seq_len, num_kv_heads, group, head_dim, value_dim, budget_bytes=None):
    budget_bytes = chunk_budget_bytes() if budget_bytes is None else budget_bytes
    per_query = chunk_bytes_per_query(config, batch, num_kv_heads, group, head_dim, value_dim)
    return int(max(1, min(seq_len, budget_bytes // per_query)))


# ---------------------------------------------------------------------------------------
# SPEC 2, one function per step (the index arithmetic and the softmax arithmetic they
# share with the kernels are in `htree_jax.core`); the float64 oracle
# (`reference_numpy/`) has its own, under the same names.


def rotate_relative(x, rel, cos, sin):
    """SPEC 2.2 by a signed relative angle: `rope(x, rel)` for `rel` of any sign, from
    tables of non-negative positions (`rope(x, -a)` rotates by `cos a, -sin a`).
    `x [..., K]`, `rel` broadcastable to `x[..., 0]`."""
    sign = jnp.where(rel < 0, -1.0, 1.0)[..., None]
    angle = jnp.abs(rel)
    return apply_rope(x, cos[angle], sign * sin[angle])


def scores(q, keys_by_slot, n, alpha, cos, sin, r: int):
    """SPEC 2.2: `s[g, p] = alpha * <rope(q, n-1), rope(K[j(p)], p)>`.

    RoPE is relative: `<rope(q, n-1), rope(k, s*r + c)> = <rope(q, n-1-s*r), rope(k, c)>`,
    so the keys come rotated by their child offset `c` (`rotate_by_child_offset`, once per
    layer) and each query is rotated once per parent slot instead of rotating `M`
    gathered keys. `q [C, G, K]` float32, `keys_by_slot [C, P, r, K]`, `n [C]` ->
    `[C, G, P * r]` float32.
    """
    C, P = keys_by_slot.shape[:2]
    rel = (n - 1)[:, None] - jnp.arange(P, dtype=jnp.int32)[None, :] * r  # [C, P], may be negative
    q_rot = rotate_relative(q[:, None], rel[..., None], cos, sin)  # [C, P, G, K]
    s = jnp.einsum("qsgk,qsck->qgsc", q_rot, keys_by_slot, precision=lax.Precision.HIGHEST)
    return alpha * s.reshape(C, q.shape[1], -1)




def select_top_k(importance_keys, valid, nodes, top_k, max_candidates, values=None):
    """Shared top-K on packed keys. `importance_keys, valid, nodes`: `[C, M]`.

    Returns `(selected [C, M] bool, next_parents [C, top_k] int32)`: the
    `min(top_k, n)` valid positions with the largest keys, and their node indices
    ascending, `-1` padded. Nodes increase with buffer position, so sorting the
    selected positions sorts the nodes. With `values [C, M]`, also theirs at the
    selected positions in the same order, 0 after (SPEC 8's importance export).
    """
    keys = jnp.where(valid, importance_keys, -1)
    top_keys, _ = lax.top_k(keys, top_k)  # descending; -1 where fewer than top_k valid
    selected = valid & (keys >= top_keys[:, -1:])
    mask = max_candidates - 1
    positions = jnp.where(top_keys >= 0, mask - (top_keys & mask), max_candidates)
    positions = jnp.sort(positions, axis=-1)
    picked = jnp.take_along_axis(nodes, jnp.minimum(positions, mask), axis=-1)
    next_parents = jnp.where(positions < max_candidates, picked, -1)
    if values is None:
        return selected, next_parents
    kept = jnp.take_along_axis(values, jnp.minimum(positions, mask), axis=-1)
    return selected, next_parents, jnp.where(positions < max_candidates, kept, 0.0)






@dataclasses.dataclass(frozen=True)
class TreeWalk:
    """How `attend_tree` walks a tree: the function (`config`), the queries a chunk
    (`query_chunk`), whether the layers' keys are rotated by child offset
    (`keys_rotated`; False: as stored, each gathered candidate rotated instead) and
    whether the selections' importance (SPEC 8) is returned."""

    config: HTreeConfig
    query_chunk: int
    keys_rotated: bool = True
    return_importance: bool = False


def _walk_one_head(q, t, layers, walk: TreeWalk, base=None, q_rank=None, index=None):
    """All layers for one `(b, h_kv)` and a chunk of positions (SPEC 2, top down), as
    `walk` says.

    `q [C, G, K]`, `t [C]` int32, `layers [(K_l [N_l, K], V_l [N_l, V]), ...]` bottom
    first, the keys rotated by child offset (`rotate_by_child_offset`), or as stored
    with `walk.keys_rotated=False` (then the gathered candidates are rotated, the same
    float32 arithmetic: what decoding does, rather than rotate a whole cache per step).
    With `config.selection == "bound"` each layer is `(K_l, V_l, rho_l [N_l, n_groups])`,
    its radii (SPEC 11), and the layers that select rank by the bound.
    Returns `o [C, G, V]` float32 and the selected node lists of layers
    `L-1 .. 1`, each `[C, top_k]` int32 (and, with `return_importance`, their
    importance, each `[C, top_k]` float32, SPEC 8).

    Packed sequences (`htree_jax.core.packing`): `t` is each query's position inside its
    document and `base [C]` its document's virtual start; node `i` of that document on
    layer `l` is row `base / r^l + i` of `layers`. Node lists stay document-local.

    Block selection (SPEC 12): `q_rank [C, R, K]`, each query's ranking rows (`block_rows`);
    the layers above 0 rank by their scores instead of the query's own.

    The indexer (SPEC 13, `config.selection == "indexer"`): `index = (iq [C, n_i, D_I],
    iw [C, n_i], [IK_l [N_l, D_I], ...])`, the ranking query's index heads and the index
    tree; the layers above 0 rank by the index scores, and the walk returns its loss
    `[C]` (summed over those layers) after everything else.
    """
    config, keys_rotated, return_importance = walk.config, walk.keys_rotated, walk.return_importance
    r, k_top, M = config.compression_rate, config.top_k, config.max_candidates
    L = len(layers)
    C, G, K = q.shape
    alpha = config.score_scale(K)
    Vd = layers[0][1].shape[-1]
    R = config.partial_rope(K)
    cos, sin = (jnp.asarray(a) for a in rope_table(M, K, float(config.rope_base), R))
    p = jnp.arange(M, dtype=jnp.int32)
    if not keys_rotated:
        child_cos, child_sin = (jnp.asarray(a[np.arange(M) % r]) for a in rope_table(r, K, float(config.rope_base), R))

    parents = top_layer_parents(t, r, L, k_top)
    state = (
        jnp.full((C, G), -jnp.inf, jnp.float32),
        jnp.zeros((C, G), jnp.float32),
        jnp.zeros((C, G, Vd), jnp.float32),
    )
    q = q.astype(jnp.float32)
    selections, importances = [], []
    index_loss = jnp.zeros((C,), jnp.float32)
    for l in reversed(range(L)):
        K_l, V_l = layers[l][:2]
        n = candidate_count(num_parents(parents)[:, 0], t, r, l)  # [C]
        nodes = candidate_nodes(parents, p, r)  # [C, M]
        valid = p[None, :] < n[:, None]
        safe_nodes = jnp.where(valid, nodes, 0)
        if base is not None:
            safe_nodes = safe_nodes + (base // r**l)[:, None]
        gathered = K_l[safe_nodes]  # [C, M, K]
        if not keys_rotated:
            gathered = apply_rope(gathered.astype(jnp.float32), child_cos, child_sin)
        s = scores(q, gathered.reshape(C, k_top, r, K), n, alpha, cos, sin, r)
        if l > 0:
            rightmost = p[None, :] == (n - 1)[:, None]
            in_norm = valid & ~rightmost if config.strict_causal else valid
            rows = q if q_rank is None else q_rank.astype(jnp.float32)
            # SPEC 12: the block's ranking rows score the same buffer (same n, same rotation).
            ranked = s if q_rank is None else scores(rows, gathered.reshape(C, k_top, r, K), n, alpha, cos, sin, r)
            if index is not None:  # SPEC 13: the indexer ranks; its loss against the attention's mass
                x = index_scores(index[0], index[1], index[2][l][safe_nodes])
                index_loss = index_loss + index_kl(ranked, x, in_norm)
                exported = lax.stop_gradient(x)
                keys = jnp.where(rightmost, forced_index_key(p[None, :], config.log_n),
                                 pack_index_scores(exported, p[None, :], config.log_n))
            else:
                if config.ranks_by_bound:  # SPEC 11: rank by what a token under the node could score
                    ranked = bound_scores(ranked, rows, layers[l][2][safe_nodes], alpha, R)
                # Selection is a discrete choice: no gradient flows through it.
                exported = importance(lax.stop_gradient(ranked), in_norm, config.importance)
                imp = jnp.where(rightmost, FORCED_IMPORTANCE, exported)
                keys = pack_importance(imp, p[None, :], config.log_n)
            selected, parents, kept = select_top_k(keys, valid, nodes, k_top, M, exported)
            merged = valid & ~selected
            selections.append(parents)
            importances.append(kept)
        else:
            merged = valid
        values = V_l[safe_nodes].astype(jnp.float32)
        state = merge(state, s, values, merged)
    extra = ([importances] if return_importance else []) + ([index_loss] if index is not None else [])
    return (normalize(state), selections, *extra)


def rotate_by_child_offset(layer_keys, config: HTreeConfig):
    """`K_l [B, N, H_kv, K]` -> float32 keys rotated by RoPE at `j mod r` (node `j`)."""
    N, K = layer_keys.shape[1], layer_keys.shape[-1]
    r = config.compression_rate
    cos, sin = rope_table(r, K, float(config.rope_base), config.partial_rope(K))
    child = np.arange(N) % r
    return apply_rope(
        layer_keys.astype(jnp.float32),
        jnp.asarray(cos[child])[None, :, None, :],
        jnp.asarray(sin[child])[None, :, None, :],
    )


@functools.partial(jax.jit, static_argnames=("config", "query_chunk", "return_importance"))
def reference_forward(q, k, v, config: HTreeConfig, query_chunk: int, positions=None, return_importance=False,
                      rank_rows=None, index=None):
    layers = build_tree(k, v, config)
    radii = with_radii(layers, config)
    layers = [(rotate_by_child_offset(kl, config), vl) + rho for (kl, vl), rho in zip(layers, radii)]
    positions = jnp.arange(q.shape[1], dtype=jnp.int32) if positions is None else positions
    return attend_tree(q, layers, positions, TreeWalk(config, query_chunk, return_importance=return_importance),
                       rank_rows=rank_rows, index=index)


def with_radii(layers, config: HTreeConfig, exists=None):
    """Per layer `()`, or `(rho_l,)` (its radii, SPEC 11) with `selection="bound"`:
    what `_walk_one_head` takes after each layer's keys and values. `layers` the stored
    `[(K_l, V_l)]`; `exists` each layer's occupancy (packed trees)."""
    if not config.ranks_by_bound:
        return [()] * len(layers)
    keys = [kl for kl, _ in layers]
    return [(rho,) for rho in tree_radii(keys, config.compression_rate, config.partial_rope(keys[0].shape[-1]),
                                         exists)]


def attend_tree(q, layers, positions, walk: TreeWalk, *, base=None, rank_rows=None, index=None):
    """Queries `q [B, S, H, K]` at token positions `positions [S]`, or `[B, S]` per batch
    row (int32, may be traced), walk the tree `layers` (bottom first, `[B, N_l, H_kv, *]`;
    keys as `_walk_one_head` takes them) as `walk` says (`TreeWalk`). Returns `(o [B, S,
    H, V] in q.dtype, selections)`. Packed sequences:
    `positions` inside each document and `base [B, S]` its virtual start (`_walk_one_head`).
    `walk.return_importance`: also the selections' importance (SPEC 8), `(o, selections,
    importance)`. Block selection (SPEC 12): `rank_rows [B, S, H_kv, R, K]`, each query's
    ranking rows (`block_rows`), where the rows above `q`'s first are elsewhere (a decode
    cache, a context shard's neighbour); None: from `q` itself. The indexer (SPEC 13):
    `index`, a `core.indexer.Index` over the same positions as `q` (one document a row):
    the layers above 0 rank by it, and its loss `[B, S, H_kv]` comes last.

    The tree may hold more tokens than `positions` reach (a decode cache sized for
    `max_len`): by strict causality (SPEC 3) nothing after a query changes its output."""
    config, return_importance = walk.config, walk.return_importance
    B, S, H, K = q.shape
    H_kv = layers[0][0].shape[2]
    G = H // H_kv
    C = walk.query_chunk
    num_chunks = -(-S // C)
    q5 = q.reshape(B, S, H_kv, G, K)
    per_row = positions.ndim == 2
    def pad_positions(x):
        tail = jnp.broadcast_to(x[..., -1:], x.shape[:-1] + (num_chunks * C - S,))
        return jnp.concatenate([x, tail], axis=-1)

    padded = pad_positions(positions)
    bases = None if base is None else pad_positions(base)
    # SPEC 12: each query's ranking rows, cut into the same chunks as q (no gradient: they only rank).
    ranks = None
    if config.selects_by_block:
        if rank_rows is None:
            rank_rows = block_rows(q5, jnp.arange(S, dtype=jnp.int32), jnp.broadcast_to(positions, (B, S)), config)
        ranks = lax.stop_gradient(rank_rows)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, num_chunks * C - S)) + ((0, 0),) * (x.ndim - 2))
    indexed = None
    if index is not None:  # SPEC 13: each query's ranking index heads (its block's first's), the index tree
        iq, iw, _ = per_kv_head(index, H_kv)  # [B, S, H_kv, n_i, D_I], [B, S, H_kv, n_i]
        if config.selects_by_block:
            rows = jnp.arange(S, dtype=jnp.int32)
            pos = jnp.broadcast_to(positions, (B, S))
            iq = block_rows(iq, rows, pos, config)
            iw = block_rows(iw[..., None], rows, pos, config)[..., 0]
        indexed = (iq, iw)
    if num_chunks * C != S:
        q5 = pad(q5)
        ranks = None if ranks is None else pad(ranks)
        indexed = None if indexed is None else tuple(pad(x) for x in indexed)
    ik_layers = None if index is None else index_tree(index, config, H_kv)

    # vmap over batch (axis 0 of everything) then kv heads (axis 2 of q5, the layers).
    one_head = lambda qh, t, lay, b, qr, ix: _walk_one_head(qh, t, lay, walk, b, qr, ix)
    ix_axes = lambda axis: None if index is None else (axis, axis, axis)
    per_head = jax.vmap(one_head, in_axes=(1, None, 1, None, None if ranks is None else 1, ix_axes(1)))
    per_batch = jax.vmap(per_head, in_axes=(0, 0 if per_row else None, 0, None if base is None else 0,
                                            None if ranks is None else 0, ix_axes(0)))

    def chunk(i):
        qc = lax.dynamic_slice_in_dim(q5, i * C, C, axis=1)  # [B, C, H_kv, G, K]
        t = lax.dynamic_slice_in_dim(padded, i * C, C, axis=padded.ndim - 1)
        b = None if bases is None else lax.dynamic_slice_in_dim(bases, i * C, C, axis=1)
        qr = None if ranks is None else lax.dynamic_slice_in_dim(ranks, i * C, C, axis=1)
        ix = None if index is None else tuple(lax.dynamic_slice_in_dim(x, i * C, C, axis=1) for x in indexed) + (
            ik_layers,)
        return per_batch(qc, t, layers, b, qr, ix)  # o [B, H_kv, C, G, V], sels [B, H_kv, C, k_top]

    # Rematerialised under autodiff: the backward keeps only each chunk's inputs, not its
    # [chunk, M, K] gathers, so gradient memory is bounded by the same chunking.
    o, sels, *extra = lax.map(jax.checkpoint(chunk), jnp.arange(num_chunks, dtype=jnp.int32))
    # o: [chunks, B, H_kv, C, G, V] -> [B, S, H, V]
    o = jnp.transpose(o, (1, 0, 3, 2, 4, 5)).reshape(B, num_chunks * C, H, -1)[:, :S]
    per_query = lambda s: jnp.transpose(s, (1, 0, 3, 2, 4)).reshape(B, num_chunks * C, H_kv, -1)[:, :S]
    result = (o.astype(q.dtype), [per_query(s) for s in sels])
    if return_importance:
        result += ([per_query(x) for x in extra[0]],)
    if index is not None:  # [chunks, B, H_kv, C] -> [B, S, H_kv]
        result += (jnp.transpose(extra[-1], (1, 0, 3, 2)).reshape(B, num_chunks * C, H_kv)[:, :S],)
    return result


def htree_attention_reference(q, k, v, config: HTreeConfig, *, query_chunk: int | None = None, positions=None,
                              return_importance: bool = False, rank_rows=None, index=None):
    """htree attention with static shapes; inputs already validated. `positions [S]`
    int32: the queries' positions among `k`'s tokens (`q [B, S, H, K]`; None: all).
    `rank_rows`: block selection's ranking rows where they are not `q`'s own (`attend_tree`).
    `index` (`core.indexer.Index`, with `selection="indexer"`, SPEC 13): the layers
    above 0 rank by the indexer, and SPEC 13's loss `[B, T, H_kv]` float32 comes last
    (zeros for a one-layer tree, where nothing selects).

    Returns `(o [B,T,H,V] in q.dtype, selections)`, selections being the selected node
    lists of layers `L-1 .. 1` (top first), each int32 `[B, T, H_kv, top_k]`, `-1` padded.

    Peak memory beyond the inputs and output: the tree (stored dtype) plus its keys
    rotated by child offset in float32 (`B * H_kv * K * sum_l N_l` floats,
    `sum_l N_l < T * r / (r - 1)`), the selections (`(L-1) * B*T*H_kv*top_k` int32),
    and one chunk of intermediates:
    `query_chunk * B * H_kv * 4 * (M * (K + V + 4G + 6) + top_k * G * K)` bytes,
    `M = top_k * compression_rate`. By default `query_chunk` is the largest that keeps
    the chunk under `chunk_budget_bytes()` (64 MiB unless `HTREE_REFERENCE_CHUNK_BYTES` says
    otherwise; at least 1): e.g. 6 positions for B=1, H_kv=2, G=4,
    K=V=64 with the default config, whose whole T=16384 call peaks at ~1.3 GB RSS.
    A one-layer tree (`T <= M`) is causal attention, computed as such
    (`core.one_layer.causal_attention_reference`, chunks of `[B, H, chunk, T]` under the
    same budget): no selections, and dense attention's cost whatever `top_k` is.
    """
    B, T, H, K = q.shape
    H_kv, Vd = k.shape[2], v.shape[-1]
    if (config.selection == "indexer") != (index is not None):
        raise ValueError("index goes with selection='indexer' (SPEC 13), and only with it: selection="
                         f"{config.selection!r}, index {'given' if index is not None else 'None'}")
    if query_chunk is None:
        query_chunk = default_query_chunk(config, B, T, H_kv, H // H_kv, K, Vd)
    elif isinstance(query_chunk, bool) or not isinstance(query_chunk, int) or query_chunk < 1:
        raise ValueError(f"query_chunk must be a positive int, got {query_chunk!r}")
    if one_layer(config, k.shape[1]):  # exact causal attention: nothing selects, nothing to walk
        o = causal_attention_reference(q, k, v, config, positions=positions, budget_bytes=chunk_budget_bytes())
        loss = () if index is None else (jnp.zeros((B, q.shape[1], H_kv), jnp.float32),)
        return (o, [], [], *loss) if return_importance else (o, [], *loss)
    check_candidate_buffer(config, B, H_kv, H // H_kv, K, Vd)
    return reference_forward(q, k, v, config, min(query_chunk, T), positions, return_importance, rank_rows, index)


def htree_attention_reference_packed(q, k, v, packing, config: HTreeConfig, *, query_chunk: int | None = None,
                                     return_importance: bool = False):
    """Packed rows (SPEC 6; `htree_jax.core.packing.Packing`): each document attended alone.
    Returns `(o, selections)` as `htree_attention_reference`, the selections counted
    inside each token's document. The tree is built in the virtual layout and walked
    with document-local positions; its keys are rotated as gathered (a top node's place
    in its document is not its row's)."""
    B, T, H, K = q.shape
    if config.selection == "indexer":
        raise ValueError("selection='indexer' (SPEC 13) does not take packed rows yet: one document a row")
    if packing.num_layers > 1:
        check_candidate_buffer(config, B, k.shape[2], H // k.shape[2], K, v.shape[-1])
    if query_chunk is None:
        query_chunk = default_query_chunk(config, B, T, k.shape[2], H // k.shape[2], K, v.shape[-1])
    exists = virtual_exists(packing)
    layers = build_packed_tree(tokens_to_virtual(k, packing), tokens_to_virtual(v, packing), exists, config,
                               packing.num_layers)
    radii = with_radii(layers, config, layer_exists(exists, packing.num_layers, config.compression_rate))
    layers = [layer + rho for layer, rho in zip(layers, radii)]
    walk = TreeWalk(config, min(query_chunk, T), keys_rotated=False, return_importance=return_importance)
    return attend_tree(q, layers, packing.offset(), walk, base=packing.doc_start)
