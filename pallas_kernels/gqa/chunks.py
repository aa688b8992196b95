"""Each chunk of queries through the top layer and the selections below it, what the
Pallas forward and backward share inside their loop over chunks: the chunk's queries
and top layer (`chunk_queries`), and a layer below the top that selects
(`select_below_top`), on the tree and tables `plan.prepare` made.

A chunk's query rows are padded once, for every width its kernels read, and their
feature-group norms (the bound) computed once, at the chunk's start (`ChunkRows`): the
layers below and the backward's kernels read them there instead of padding again.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from htree_jax.core.bounds import group_norms
from htree_jax.core.config import FORCED_IMPORTANCE
from htree_jax.core.indexing import candidate_count, num_parents, pack_importance, top_layer_parents
from pallas_kernels.gqa.plan import Prepared
from pallas_kernels.gqa.top_layer import top_importance_keys_pallas
from pallas_kernels.shared.common import (Bound, LayerInputs, TopInputs, next_power_of_two, pad_axis, real_heads,
                                         virtual_heads)
from pallas_kernels.shared.importance import importance_keys_pallas
from pallas_kernels.shared.rope import rotate_queries
from pallas_kernels.shared.top_k import kept_values, select_top_k_pallas


class ChunkRows(NamedTuple):
    """A chunk's query rows as its kernels read them, padded once (zero rows)."""

    q: jax.Array  # [B, Qc, H_kv, G, Kp] the chunk's queries (halves padded, unrotated)
    top: jax.Array  # [B, Qc, H_kv, Gt, Kp] rows padded to Gt (a power of two): the top layer's, the node kernels'
    per_query: jax.Array  # [B, Qc, H_kv, Gp, Kp] rows padded to Gp (`prep.query_rows`): the per-query kernels'
    # `selection="bound"`, with a layer below the top that selects: the group norms of
    # `per_query`, `[B, Qc, H_kv, Gp, bound_width]` float32 (SPEC 11); else None.
    norms: jax.Array | None = None


def chunk_rows(prep: Prepared, qc, n_top, bound: bool, below: bool):
    """`(rows, q_top, top_norms)`: the chunk's queries `qc [B, Qc, H_kv, G, Kp]` padded
    to both row widths (`ChunkRows`), the top layer's rows rotated by `n_top - 1`
    (`[B, Qc, H_kv, Gt, Kp]` float32), and with `bound` (the bound ranks) the
    feature-group norms of the top layer's rows as its kernel reads them (rotated) and,
    with `below` (a layer below the top selects), of the per-query rows every such layer
    reads (`ChunkRows.norms`), each padded to `bound_width` (SPEC 11); else None."""
    G = qc.shape[3]
    q_gt, q_gp = (pad_axis(qc, 3, width) for width in (next_power_of_two(G), prep.query_rows))
    q_top = rotate_queries(q_gt, n_top, prep.cos, prep.sin)
    if not bound:
        return ChunkRows(qc, q_gt, q_gp), q_top, None
    norms = [group_norms(x, prep.bound_rope) for x in ((q_top, q_gp) if below else (q_top,))]
    norms = [pad_axis(x, -1, prep.bound_width) for x in norms]
    return ChunkRows(qc, q_gt, q_gp, norms[1] if below else None), q_top, norms[0]


def valid_candidates(parents, t, layer: int, prep: Prepared):
    """`n` per query (SPEC 2.1), `[B, Q, H_kv, 1]` int32, from padded parent lists."""
    return candidate_count(num_parents(parents), t, prep.st.r, layer).astype(jnp.int32)


def chunk_queries(prep: Prepared, c, T: int, num_layers: int, interpret: bool, select: bool = True,
                  export: bool = False):
    """Chunk `c`'s queries and top layer, shared by the forward and the backward:
    `(rows, t, n_top, first, q_top, top)`, `rows` the chunk's `ChunkRows`. `t`: the queries' positions
    in the tree (`[1, Qc, 1, 1]`, or `[B, Qc, 1, 1]` virtual ones when packed). The top
    layer's candidates are rows `[first, first + n_top)` (`[B, Qc, H_kv, 1]` each;
    `n = i*_{L-1} + 1` counted in the query's document, SPEC 2.1); `first` is None
    without packing (one document per row, starting at row 0: what the top layer's
    kernels take then, with no per-document loop around their tiles);
    `q_top` each query rotated by its `n - 1`, `Gt` rows. `top`: `(keys, tau, parents of
    the layer below)` from the top layer's importance keys (document-local positions)
    and shared top-K (the parents as tree rows), or `(None, None, None)` when the top
    layer is the bottom one (`L = 1`) or without `select` (the backward, given the
    forward's selections). With `export`, `top` has a fourth entry: the kept nodes'
    importance `[B, Qc, H_kv, top_k]` (SPEC 8)."""
    st, Qc = prep.st, prep.chunk
    B, _, H_kv, G, _ = prep.q4.shape
    A = st.r ** (num_layers - 1)
    qc = lax.dynamic_slice_in_dim(prep.q4, c * Qc, Qc, axis=1)
    rows = lambda x: lax.dynamic_slice_in_dim(
        jnp.pad(x, ((0, 0), (0, prep.q4.shape[1] - T)), mode="edge"), c * Qc, Qc, axis=1)[..., None, None]
    if prep.packing is None:
        if prep.positions is None:
            t = jnp.minimum(c * Qc + jnp.arange(Qc, dtype=jnp.int32), T - 1)[None, :, None, None]
        else:
            t = rows(prep.positions[None])
        offset, first = t, None
    else:
        places = prep.packing if prep.query_packing is None else prep.query_packing
        t, start = rows(places.position), rows(places.doc_start)
        offset, first = t - start, jnp.broadcast_to(start // A, (B, Qc, H_kv, 1))
    n_top = jnp.broadcast_to(offset // A + 1, (B, Qc, H_kv, 1))
    select = select and num_layers > 1
    rows, q_top, top_norms = chunk_rows(prep, qc, n_top, select and prep.bound_width > 0, num_layers > 2)
    if not select:
        return rows, t, n_top, first, q_top, (None, None, None)
    split = prep.head_split
    bound = None if top_norms is None else Bound(top_norms, prep.top_radii)
    top_in = TopInputs(n_top, first, None, None, prep.top_k_imp, None)
    if split == 1:
        out = top_importance_keys_pallas(q_top, top_in, prep.cos.shape[0], prep.st_top_keys, interpret, export,
                                         bound=bound)
        keys, imp = out if export else (out, None)
    else:
        keys, imp = split_top_keys(prep, q_top, top_in, interpret, bound)
    parents = jnp.broadcast_to(top_layer_parents(offset[..., 0], st.r, num_layers, prep.parents_width),
                               (B, Qc, H_kv // split, prep.parents_width))
    next_parents, tau = select_top_k_pallas(keys, parents, real_heads(n_top, split), prep.st_select, interpret)
    next_parents = next_parents[..., : prep.parents_width]
    if first is not None:  # tree rows
        next_parents = jnp.where(next_parents >= 0, next_parents + real_heads(first, split), -1)
    top = [keys, tau, next_parents] + ([kept_values(keys, tau, imp, st.top_k)] if export else [])
    return rows, t, n_top, first, q_top, tuple(virtual_heads(x, split) for x in top)


def split_top_keys(prep: Prepared, q_top, top: TopInputs, interpret: bool, bound: Bound | None = None):
    """The top layer's packed importance keys `[B, Q, H_kv, Mp]` for the real kv heads
    of split heads (`head_split` > 1), and their importance: the kernel's per-split
    importance, summed over the group here (`shared_max`: each split's rescaled from its
    own group max to the largest), then packed as the kernel packs it. `bound`: the
    bound's group norms of `q_top` (`chunk_rows`) and the top radii, None without it."""
    split, st, width = prep.head_split, prep.st_top_keys, prep.cos.shape[0]
    n_top = top.n
    _, imp, shift = top_importance_keys_pallas(q_top, top, width, st, interpret, export=True, with_shift=True,
                                               bound=bound)
    B, Q = imp.shape[:2]
    imp = imp.reshape(B, Q, -1, split, width)
    if st.importance == "shared_max":
        group_max = shift[..., 0].reshape(B, Q, -1, split)  # every row of a split holds its group max
        imp = imp * jnp.exp(group_max - jnp.max(group_max, axis=-1, keepdims=True))[..., None]
    imp = jnp.sum(imp, axis=-2)
    n = real_heads(n_top, split)
    positions = jnp.arange(width, dtype=jnp.int32)
    keys = jnp.where(positions < n, pack_importance(jnp.where(positions == n - 1, FORCED_IMPORTANCE, imp), positions,
                                                    st.log_n), -1)
    return keys, imp


def select_below_top(prep: Prepared, rows: ChunkRows, parents, n, layer: int, interpret: bool,
                     export: bool = False):
    """Layer `layer` (below the top) selects for the chunk's `rows`: `(keys,
    next_parents, tau, scores, importance)`, the keys, parents and `tau` in the virtual
    heads' layout (`parents`, `n` given in it), the scores for `merge_scored_pallas`,
    the kept nodes' importance (`export`, else None). The keys and the top-K are made
    once per real kv head; with `selection="bound"` they rank by the bound scores (SPEC
    11, on the rows' norms)."""
    split, q_rows = prep.head_split, rows.per_query
    bound = None if rows.norms is None else Bound(rows.norms, prep.radii[layer])
    inputs = LayerInputs(parents, n, None, None, prep.layers[layer][0], None, prep.cos, prep.sin)
    keys, scores = importance_keys_pallas(q_rows, inputs, prep.st_scores, interpret, return_scores=True, export=export,
                                          split=split, bound=bound)
    imp = None
    if export:
        keys, imp = keys
    next_parents, tau = select_top_k_pallas(keys, real_heads(parents, split), real_heads(n, split), prep.st_select,
                                            interpret)
    if export:
        imp = virtual_heads(kept_values(keys, tau, imp, prep.st.top_k), split)
    return (virtual_heads(keys, split), virtual_heads(next_parents[..., : prep.parents_width], split),
            virtual_heads(tau, split), scores, imp)
