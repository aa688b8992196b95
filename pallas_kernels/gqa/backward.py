"""The Pallas backward of htree attention (SPEC 5) for the GQA family: `htree_backward_pallas`.
Groups of 32 or more heads per kv head (latent attention) are the wide family's
(`htree_jax.backends.choose_route` chooses); this is the backward of the others.

The selections are the forward's (`selections=`, what `htree_attention` passes: the
forward returns them anyway, `(L-1) * B*T*H_kv*top_k` int32 kept between the passes); the
candidates each layer kept are marked from them (`kept_keys`). Without them they are
recomputed, chunk by chunk, with the forward's own kernels (importance keys and shared
top-K: the same launches on the same inputs, so the same selections and the same
gradient bits). Saving them makes forward+backward faster for a little more planned
memory (journal, 2026-11-23 (session 2)). Nothing per candidate is saved between the
passes.

Every layer's scores are recomputed with the merge dots (bfloat16 operands for bfloat16
inputs). Between the top and the bottom the forward merged from the importance pass's
float32-grade scores (`BF16X3`), so there `p = exp(s - lse)` mixes the two: a
bfloat16-level difference, bounded by `tests/test_pallas_backward.py` (scoring those
layers with `BF16X3` here made the whole backward several times slower: journal,
2026-11-23, clean base). The forward saves `o` and the rows' log-sum-exp `lse`; `delta =
rowsum(do * o)`. Then per chunk, top layer first (flash attention's dq and dk/dv loops
on the forward's top-layer layouts, `top_backward.py`), each lower layer's `dq` kernel
(`layer_backward.py`: one program per query, its G heads on `group_rows` rows, summing
in registers) and its `dk`, `dv` kernel (`node_backward.py`: one program per block of
nodes, visiting in a fixed order the queries that merged them, found through an inverse
index of the chunk's parent lists) add into per-layer float32 accumulators; after the
last chunk those are rotated back and pushed down the tree: a node's gradient is shared
equally by its children (mean pooling), so layer `l` receives `grad_{l+1}[j // r] /
children(j // r)`.

Deterministic: no atomics, every sum in a fixed order, so the gradients are bitwise
the same run to run (checked on an H200, `tools/check_backward_gpu.py`).

Memory beyond the forward's, per `(b, h_kv)`, O(T): the float32 accumulators (a layer's
keys and values, rounded up to 16 rows; the top layer's tile-padded). Per chunk of `Qc`
queries: `dq`, the selections, and the inverse index, five int32 arrays of `Qc * P *
max(1, r/16)` entries (plus the sort's own buffers), and the top node kernel's partial
sums (at most `top_dkv_programs` tiles of `tile x (Kp + Vp)` float32: 256 MiB at the
defaults, K = V = 128). `do` is read in its own dtype and
masked chunk by chunk, and each chunk's `dq` is finished in q's dtype: no float32 copy
of either exists. What lives at the peak of one training step's attention, T=1M,
top_k=64, B=1, H=32, H_kv=4, K=V=128, bfloat16 (XLA's plan on an H100,
`benchmarks/memory_plan.py`; device peak 46.4 GiB measured, 45.2 GiB on 2026-11-26
with the top node kernel's partials and 8-row dq kernels): arguments 18 GiB (q, k, v,
the cotangent), outputs 10 GiB (dq, dk, dv), temporaries 18.4 GiB (XLA reuses a
buffer once its value is dead, the saved output's among them): dq's chunks 8 GiB, the
bottom's keys in `span/r` = 4 rotated copies 4 GiB, the bottom's float32 dk/dv
accumulators 4 GiB, the saved selections 1 GiB per layer, a chunk's stored scores 1 GiB
(twice), the guard's zeroed k or v (1 GiB each) and, in that plan, their finiteness
masks (0.5 GiB each), which the backward no longer keeps (the gradients of non-finite
tokens are masked by position, `htree_jax.backends`). With chunks that tile T
(`forward.dividing_chunk`) nothing is padded to `chunks * Qc` positions.
The accumulators and dq's chunks are allocated after the forward's `lse` exists
(`common.zeros_after`): where both passes are one program (a training step), XLA's
scheduler could otherwise make them during the forward and add them to its peak.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from htree_jax.core.config import HTreeConfig
from htree_jax.core.rope import apply_rope
from pallas_kernels.gqa.chunks import chunk_queries, select_below_top, valid_candidates
from pallas_kernels.gqa.layer_backward import layer_backward_pallas
from pallas_kernels.gqa.node_backward import layer_node_grads_pallas
from pallas_kernels.gqa.plan import Places, group_rows, prepare, split_heads
from pallas_kernels.gqa.top_backward import top_backward_queries, top_backward_statics, top_dq_pallas, top_node_grads_pallas
from pallas_kernels.shared import shared_memory
from pallas_kernels.shared.common import (
    KERNEL_GROUP,
    LayerInputs,
    RowStats,
    TopInputs,
    next_power_of_two,
    pad_axis,
    unpad_rope_halves,
    virtual_heads,
    zeros_after,
)
from pallas_kernels.shared.common import check_query_layout
from pallas_kernels.shared.configs import BlockSizes, KernelConfigs
from pallas_kernels.shared.guarded import KernelCall
from pallas_kernels.shared.node_index import UNIT, node_buffers, node_gradient, node_index
from pallas_kernels.shared.precision import Precisions
from pallas_kernels.shared.tree_backward import child_counts_by_layer, kept_keys, pad_nodes_list, push_down


def _per_chunk(x, Qc: int, num_chunks: int):
    """`[B, T, ...]` padded along T to `num_chunks * Qc`."""
    return pad_axis(x, 1, num_chunks * Qc)


@functools.partial(jax.jit, static_argnames=("config", "block_sizes", "interpret", "value_dim", "q_layout"))
def htree_backward_pallas(q, k, v, o, lse, do, *, config: HTreeConfig,
                          block_sizes: BlockSizes | KernelConfigs | None = None,
                          interpret: bool = False, dead_rows=None, selections=None, packing=None, positions=None,
                          value_dim: int | None = None, q_layout: str = "rope_layout"):
    """`(dq, dk, dv)` of htree attention (selection constant), in the dtypes of `q, k,
    v`. `o [B, T, H, V]` and `lse [B, T, H]` from `htree_forward_pallas(...,
    return_lse=True)`, `do` the cotangent of `o`. Inputs validated by the caller.
    `dead_rows [B, T, H]` bool (optional): rows whose output is a constant (SPEC 10's NaN
    rows), taken as having no cotangent; applied inside the copies of `do` and `o` the
    backward makes anyway, not as masked copies of its own.
    `selections`: the forward's (its second output, top layer first); the kept nodes
    are then read from them instead of running the importance and top-K kernels again.
    `packing`: packed rows (`htree_jax.core.packing`), with the forward's `selections` (tree
    rows, as `htree_forward_pallas(..., packing=)` returns them), required there.
    `positions [S]`: the queries' positions among `k`'s tokens, as the forward takes them.
    `block_sizes`, `q_layout`: as the forward takes them (`dq` in q's layout). Bitwise
    deterministic.
    Groups of up to 16 heads per kv head, and of more (a multiple of 16, up to 128) as
    virtual kv heads (`plan.split_heads`): their key and value gradients are summed over
    the split heads at the end. `v=None` (the values read from the keys) is the wide
    family's and refused here."""
    if packing is not None and selections is None and packing.num_layers > 1:
        raise ValueError("the packed backward takes the forward's selections")
    B, T, H, K = q.shape
    H_kv = k.shape[2]
    V = value_dim if v is None else v.shape[-1]
    tuning = KernelConfigs.resolve(block_sizes, K, V)
    check_query_layout(q_layout)
    if v is None:
        raise ValueError("values read from the keys (v=None) need the wide kernels: groups of 32 or more heads per "
                         "kv head, BlockSizes.wide_rows > 0, one document per row")
    # The backward's per-query kernels hold q, do and dq rows besides the key and value
    # tiles: two pipeline stages overflow shared memory at wide heads (H200: 264992 B
    # asked of 232448 at K = 576, V = 512) and in
    # float32 past 128 features (H100: 246848 B at K = V = 256); one stage there.
    footprint = shared_memory.per_query(group_rows(min(H // H_kv, KERNEL_GROUP), tuning), tuning.layer.tile,
                                        next_power_of_two(K, 32), next_power_of_two(V, 16),
                                        jnp.dtype(q.dtype).itemsize, backward=True)
    stages = shared_memory.per_query_stages(tuning.layer.num_stages, footprint)
    tuning = dataclasses.replace(tuning, layer=dataclasses.replace(tuning.layer, num_stages=stages))
    k, v, split = split_heads(k, v, H // H_kv)
    H_kv, G = H_kv * split, H // (H_kv * split)
    prep = prepare(q, k, v, KernelCall(config, tuning, interpret), Precisions.for_dtype(q.dtype),
                   places=Places(packing, positions), for_backward=True, split=split)
    st, st_top, Qc, P, L = prep.st, prep.st_top, prep.chunk, prep.parents_width, len(prep.layers) + 1
    num_chunks = prep.q4.shape[1] // Qc
    kp, vp = prep.q4.shape[-1], prep.top_v.shape[-1]
    gt, gp = next_power_of_two(G), group_rows(G, tuning)
    sizes, Mp = prep.sizes, prep.cos.shape[0]
    st_dq, st_dkv, segments = top_backward_statics(st_top, tuning.top_backward, jnp.dtype(q.dtype).itemsize, kp, vp,
                                                   prep.top_v.shape[2], Mp, B * H_kv, Qc)

    rows = lambda x: x.reshape((B, T, H_kv, G) + x.shape[3:])
    # `do` stays in its dtype and is masked chunk by chunk: no full-size copy of it is
    # made unless V or T need padding (a float32 copy was 16 GiB at T=1M, H=32, V=128;
    # the kernels read it in float32 or round it to the dots' operand dtype, so the
    # gradients are bitwise those of a float32 copy).
    dead = None if dead_rows is None else rows(dead_rows)
    do_live = do if dead is None else jnp.where(dead_rows[..., None], jnp.zeros((), do.dtype), do)
    o_live = o if dead is None else jnp.where(dead_rows[..., None], jnp.zeros((), o.dtype), o)
    delta = jnp.sum(rows(do_live.astype(jnp.float32)) * rows(o_live.astype(jnp.float32)), axis=-1)  # [B, T, H_kv, G]
    do4 = _per_chunk(pad_axis(rows(do), -1, vp), Qc, num_chunks)
    dead4 = None if dead is None else _per_chunk(dead, Qc, num_chunks)
    lse4, delta4 = (_per_chunk(x, Qc, num_chunks) for x in (rows(lse.astype(jnp.float32)), delta))
    saved = None if selections is None else [_per_chunk(virtual_heads(x, split), Qc, num_chunks) for x in selections]

    # The accumulators and dq's chunks are allocated after the forward's `lse` exists:
    # left to XLA's scheduler they could be made during the forward (both passes in one
    # program), adding to its peak (`zeros_after`).
    top_acc = tuple(zeros_after(x.shape, jnp.float32, lse) for x in (prep.top_k_merge[0], prep.top_v))
    layer_acc = [node_buffers(B, H_kv, sizes[l], kp, vp, anchor=lse) for l in range(L - 1)]
    dq_chunks = zeros_after((num_chunks, B, Qc, H_kv, G, K), q.dtype, lse)

    def chunk(carry, c):
        top_acc, layer_acc, dq_chunks = carry
        layer_acc = list(layer_acc)
        sl = lambda x: lax.dynamic_slice_in_dim(x, c * Qc, Qc, axis=1)
        lse_c, delta_c, do_c = sl(lse4), sl(delta4), sl(do4)
        if dead4 is not None:
            do_c = jnp.where(sl(dead4)[..., None], jnp.zeros((), do_c.dtype), do_c)
        rows, t, n_top, first, q_top, (keys, tau, parents) = chunk_queries(prep, c, T, L, interpret,
                                                                            select=saved is None)
        kept = None if saved is None else [sl(x) for x in saved]  # kept[d]: the nodes layer L-1-d kept
        rows_keys = keys  # the top layer's keys by tree row (the node kernel's), = by position unpacked
        if kept is not None and L > 1:
            tau = jnp.ones(n_top.shape, jnp.int32)
            local = jnp.where(kept[0] >= 0, kept[0] if first is None else kept[0] - first, -1)
            keys = kept_keys(None, local, Mp, st.r)
            rows_keys = keys if packing is None else kept_keys(None, kept[0], prep.top_v.shape[2], st.r)
            parents = pad_nodes_list(kept[0], P)
        # The rows' statistics padded to both widths the kernels read, as `rows` holds
        # the queries: `gt` (the top layer's and the node kernels', a power of two) and
        # `gp` (the per-query kernels').
        q_gt, q_rows = rows.top, rows.per_query
        stats_gt = RowStats(*(pad_axis(x, 3, gt) for x in (lse_c, do_c, delta_c)))
        stats_gp = RowStats(*(pad_axis(x, 3, gp) for x in (lse_c, do_c, delta_c)))
        q_ops = top_backward_queries(q_top, st_top)
        top = TopInputs(n_top, first, keys, tau, prep.top_k_merge, prep.top_v)
        dq_rot = top_dq_pallas(q_ops, top, stats_gt, st_dq, interpret)
        top_acc = top_node_grads_pallas(q_ops, top._replace(keys=rows_keys), stats_gt, top_acc, st_dkv, interpret,
                                        segments)
        position = n_top - 1
        dq = apply_rope(dq_rot, prep.cos[position], -prep.sin[position])[:, :, :, :G]
        if L > 1:
            for l in reversed(range(L - 1)):
                _, k_merge, vl = prep.layers[l]
                n = valid_candidates(parents, t, l, prep)
                keys = tau = None
                if l > 0 and kept is not None:
                    keys, tau = kept_keys(parents, kept[L - 1 - l], Mp, st.r), jnp.ones(n.shape, jnp.int32)
                    next_parents = pad_nodes_list(kept[L - 1 - l], P)[..., :P]
                elif l > 0:
                    keys, next_parents, tau, _, _ = select_below_top(prep, rows, parents, n, l, interpret)
                inputs = LayerInputs(parents, n, keys, tau, k_merge, vl, prep.cos, prep.sin)
                dq_l = layer_backward_pallas(q_rows, inputs, stats_gp, st, interpret)
                index = node_index(parents, n, st.r, -(-sizes[l] // UNIT), tuning.layer.node_entries)
                layer_acc[l] = layer_node_grads_pallas(q_gt, inputs, stats_gt, index, layer_acc[l], st, interpret,
                                                       num_warps=tuning.layer.node_num_warps)
                dq = dq + dq_l[:, :, :, :G]
                if l > 0:
                    parents = next_parents
        # Each query's dq is whole within its chunk: finished (unpadded, in q's dtype)
        # here, the stacked chunks are half the float32 ones (8 vs 16 GiB at T=1M).
        dq_chunks = lax.dynamic_update_index_in_dim(dq_chunks, unpad_rope_halves(dq, K).astype(q.dtype), c, 0)
        return (top_acc, tuple(layer_acc), dq_chunks), None

    # dq's chunks are a carry (their zeros anchored above), not the scan's stacked output,
    # which XLA zeroes itself, free to do so during the forward. The chunk index comes from
    # `xs`, not a `fori_loop` counter: with the counter, XLA (jax 0.11.2) ran the loop's
    # per-chunk slices of lse, delta, do and the dead rows as async fusions on other
    # streams, a wait per chunk: 1-1.5% slower at T=1M over 2 GPUs (journal, 2026-11-27 (9)).
    (top_acc, layer_acc, dq), _ = lax.scan(chunk, (top_acc, tuple(layer_acc), dq_chunks),
                                           jnp.arange(num_chunks, dtype=jnp.int32))

    # Rotate the key gradients back, then push them down the tree to the tokens.
    N_top = sizes[-1]
    if packing is None:
        dk_tree = apply_rope(top_acc[0][:, :, :N_top], prep.cos[:N_top], -prep.sin[:N_top])
        counts = [None] * (L - 1)
    else:
        local = prep.top_local
        dk_tree = apply_rope(top_acc[0][:, :, :N_top], prep.cos[local][:, None], -prep.sin[local][:, None])
        counts = child_counts_by_layer(packing, st.r, L)
    dv_tree = top_acc[1][:, :, :N_top]
    for l in reversed(range(L - 1)):
        dk_l = node_gradient(layer_acc[l][0], sizes[l], prep.cos, prep.sin, st.r)
        dk_tree = dk_l + push_down(dk_tree, sizes[l], st.r, counts[l])
        dv_tree = layer_acc[l][1][:, :, : sizes[l]] + push_down(dv_tree, sizes[l], st.r, counts[l])

    dq = jnp.moveaxis(dq, 0, 1).reshape(B, num_chunks * Qc, H, K)[:, :T]
    dk = unpad_rope_halves(jnp.swapaxes(dk_tree, 1, 2), K)
    dv = jnp.swapaxes(dv_tree, 1, 2)[..., :V]
    if split > 1:  # each kv head's gradient: the sum of its split heads'
        dk, dv = (x.reshape(x.shape[:2] + (H_kv // split, split) + x.shape[3:]).sum(axis=3) for x in (dk, dv))
    if packing is not None:  # from the virtual layout back to the tokens
        back = jax.vmap(lambda x, p: x[p])
        dk, dv = back(dk, packing.position), back(dv, packing.position)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype)


__all__ = ["htree_backward_pallas"]
