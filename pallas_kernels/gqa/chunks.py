"""Each chunk of queries through the top layer and the selections below it, what the
Pallas forward and backward share inside their loop over chunks: the chunk's queries
and top layer (`chunk_queries`), and a layer below the top that selects
(`select_below_top`), on the tree and tables `plan.prepare` made.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from htree_jax.core.bounds import group_norms
from htree_jax.core.config import FORCED_IMPORTANCE
from htree_jax.core.indexing import candidate_count, num_parents, pack_importance, top_layer_parents
from pallas_kernels.gqa.plan import Prepared
from pallas_kernels.gqa.top_layer import top_importance_keys_pallas
from pallas_kernels.shared.common import Bound, next_power_of_two, pad_axis, real_heads, virtual_heads
from pallas_kernels.shared.importance import importance_keys_pallas
from pallas_kernels.shared.rope import rotate_queries
from pallas_kernels.shared.top_k import kept_values, select_top_k_pallas


def query_group_norms(prep: Prepared, q_rows):
    """`selection="bound"`: the feature-group norms of query rows `[..., Kp]` (padded
    halves, any rotation), `[..., bound_width]` float32 (SPEC 11); None without it."""
    if not prep.bound_width:
        return None
    return pad_axis(group_norms(q_rows, prep.bound_rope), -1, prep.bound_width)


def valid_candidates(parents, t, layer: int, prep: Prepared):
    """`n` per query (SPEC 2.1), `[B, Q, H_kv, 1]` int32, from padded parent lists."""
    return candidate_count(num_parents(parents), t, prep.st.r, layer).astype(jnp.int32)


def chunk_queries(prep: Prepared, c, T: int, num_layers: int, interpret: bool, select: bool = True,
                  export: bool = False):
    """Chunk `c`'s queries and top layer, shared by the forward and the backward:
    `(qc [B, Qc, H_kv, G, Kp], t, n_top, first, q_top, top)`. `t`: the queries' positions
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
        t, start = rows(prep.packing.position), rows(prep.packing.doc_start)
        offset, first = t - start, jnp.broadcast_to(start // A, (B, Qc, H_kv, 1))
    n_top = jnp.broadcast_to(offset // A + 1, (B, Qc, H_kv, 1))
    q_top = rotate_queries(pad_axis(qc, 3, next_power_of_two(G)), n_top, prep.cos, prep.sin)
    if num_layers == 1 or not select:
        return qc, t, n_top, first, q_top, (None, None, None)
    split = prep.head_split
    keys, imp = top_keys(prep, q_top, n_top, first, interpret, export)
    parents = jnp.broadcast_to(top_layer_parents(offset[..., 0], st.r, num_layers, prep.parents_width),
                               (B, Qc, H_kv // split, prep.parents_width))
    next_parents, tau = select_top_k_pallas(keys, parents, real_heads(n_top, split), prep.st_select, interpret)
    next_parents = next_parents[..., : prep.parents_width]
    if first is not None:  # tree rows
        next_parents = jnp.where(next_parents >= 0, next_parents + real_heads(first, split), -1)
    top = [keys, tau, next_parents] + ([kept_values(keys, tau, imp, st.top_k)] if export else [])
    return qc, t, n_top, first, q_top, tuple(virtual_heads(x, split) for x in top)


def top_keys(prep: Prepared, q_top, n_top, first, interpret: bool, export: bool):
    """The top layer's packed importance keys `[B, Q, H_kv, Mp]` for the real kv heads,
    and with `export` their importance (else None). Split heads (`head_split`): the
    kernel's per-split importance, summed over the group here (`shared_max`: each
    split's rescaled from its own group max to the largest), then packed as the kernel
    packs it."""
    split, st, width = prep.head_split, prep.st_top_keys, prep.cos.shape[0]
    qn = query_group_norms(prep, q_top)
    bound = None if qn is None else Bound(qn, prep.top_radii)
    if split == 1:
        out = top_importance_keys_pallas(q_top, n_top, first, prep.top_k_imp, width, st, interpret, export,
                                         bound=bound)
        return out if export else (out, None)
    _, imp, shift = top_importance_keys_pallas(q_top, n_top, first, prep.top_k_imp, width, st, interpret,
                                               export=True, with_shift=True, bound=bound)
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


def select_below_top(prep: Prepared, q_rows, parents, n, layer: int, interpret: bool, export: bool = False):
    """Layer `layer` (below the top) selects: `(keys, next_parents, tau, scores,
    importance)`, the keys, parents and `tau` in the virtual heads' layout (`parents`,
    `n` given in it), the scores for `merge_scored_pallas`, the kept nodes' importance
    (`export`, else None). The keys and the top-K are made once per real kv head; with
    `selection="bound"` they rank by the bound scores (SPEC 11)."""
    split = prep.head_split
    qn = query_group_norms(prep, q_rows)
    bound = None if qn is None else Bound(qn, prep.radii[layer])
    keys, scores = importance_keys_pallas(q_rows, parents, n, prep.layers[layer][0], prep.cos, prep.sin, prep.st_scores,
                                          interpret, return_scores=True, export=export, split=split, bound=bound)
    imp = None
    if export:
        keys, imp = keys
    next_parents, tau = select_top_k_pallas(keys, real_heads(parents, split), real_heads(n, split), prep.st_select,
                                            interpret)
    if export:
        imp = virtual_heads(kept_values(keys, tau, imp, prep.st.top_k), split)
    return (virtual_heads(keys, split), virtual_heads(next_parents[..., : prep.parents_width], split),
            virtual_heads(tau, split), scores, imp)
