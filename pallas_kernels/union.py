"""Query blocks that share their gathers: the bottom merge (SPEC 2.4) of `BQ` consecutive
queries (one kv head) over the *union* of their parent lists.

Neighbouring queries select alike (on correlated inputs a block of 16 queries needs about
a ninth of the per-query path's gathers at T=131072, top_k=512: `htree_jax.bench`'s
overlap table). Here each node of the union is gathered once and scored for every member
row (`BQ * Gt` rows instead of `Gp` per query), each member masking what it did not
select. The per-query kernel (`merge.merge_pallas`) serves the blocks whose union is too
large for the static buffer (`width` parents), chosen per block at run time.

RoPE (SPEC 2.2): candidate position `p = s*r + c`, `s` the node's slot in *that query's
own* parent list, so a shared node sits at different slots for different members. With
`<rope(q, n-1), rope(K, s*r + c)> = <rope(q, n-1-s*r), rope(K, c)>` the keys are read
rotated by their child index only (copy 0 of `rope.rotate_phases`), and each member's
query is rotated by `n - 1 - s*r` once per (member, union node): `2 * BQ * Gt * Kp`
float32 multiply-adds and one `[BQ, Kp]` row pair of the tables per node, against the
`BQ * Gt * r * (Kp + Vp)` multiply-adds of the two products it feeds (1/16 of them at
r=16, K=V=128; the count and the schemes weighed are in benchmarks/RESULTS.md).

Measured (H200, T=131072, 2026-11-23): 1.6-2.2x *slower* than the per-query path even
at a union of 0.10 of the slots, and no faster without the rotation; so it is off by
default (`BlockSizes.union_limit = 0`) and kept, tested, for the backward's blocks and
for a better kernel.

Layouts (besides those of `importance.py` / `merge.py`):
  union  `[B, Q/BQ, H_kv, width]` int32  the block's distinct parents ascending, `-1` after
  size   `[B, Q/BQ, H_kv, 1]` int32  how many there are (may exceed `width`: then the
         block takes the per-query path)
  slots  `[B, Q/BQ, H_kv, BQ, width]` int32  member `i`'s slot of `union[u]`, `-1` where
         `i` did not select it
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import NEG_INF, LayerStatic, compiler_params, merge_score_precision, per_head_spec
from pallas_kernels.merge import fold_merged, merge_outputs, read_state, write_merged
from pallas_kernels.precision import check_key_parts, key_parts, score_dot
from pallas_kernels.rope import full_width_inputs

INT32_MAX = (1 << 31) - 1


def _sort_by_parent(parents_flat, members: int, num_nodes: int | None):
    """`(parent, payload)` sorted by parent (invalid parents, `-1`, last as INT32_MAX):
    `payload = member * P + slot`. One int32 key `parent * members * P + payload` when it
    fits (a one-operand sort), else a stable two-operand sort."""
    width = parents_flat.shape[-1]
    payload = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), parents_flat.shape)
    valid = parents_flat >= 0
    if num_nodes is not None and num_nodes * width < INT32_MAX:
        packed = jnp.sort(jnp.where(valid, parents_flat * width + payload, INT32_MAX), axis=-1)
        return jnp.where(packed == INT32_MAX, INT32_MAX, packed // width), packed % width
    keys = jnp.where(valid, parents_flat, INT32_MAX)
    return lax.sort((keys, payload), dimension=keys.ndim - 1, num_keys=1, is_stable=True)


def block_union(parents, block_queries: int, width: int, num_nodes: int | None = None):
    """The union of the parent lists of each block of `block_queries` consecutive queries:
    `(union, size, slots)` (layouts in the module docstring). `parents [B, Q, H_kv, P]`
    ascending, `-1` padded, `Q` a multiple of `block_queries`; `num_nodes`, the parents'
    layer size, lets one packed int32 key be sorted. One sort of `BQ * P` entries per
    block; parents past `width` are dropped (their block's `size > width`)."""
    B, Q, H_kv, P = parents.shape
    bq = block_queries
    nb = Q // bq
    flat = parents.reshape(B, nb, bq, H_kv, P).transpose(0, 1, 3, 2, 4).reshape(B, nb, H_kv, bq * P)
    parent, payload = _sort_by_parent(flat, bq * P, num_nodes)
    valid = parent != INT32_MAX
    first = valid & jnp.concatenate([jnp.ones_like(valid[..., :1]), parent[..., 1:] != parent[..., :-1]], axis=-1)
    index = jnp.cumsum(first.astype(jnp.int32), axis=-1) - 1
    size = jnp.max(index, axis=-1, keepdims=True) + 1
    target = jnp.where(valid & (index < width), index, width)  # width: out of range, dropped

    def scatter(target, parent, member, slot):
        union = jnp.full((width,), -1, jnp.int32).at[target].set(parent, mode="drop")
        slots = jnp.full((bq, width), -1, jnp.int32).at[member, target].set(slot, mode="drop")
        return union, slots

    rows = lambda x: x.reshape(-1, bq * P)
    union, slots = jax.vmap(scatter)(rows(target), rows(parent), rows(payload // P), rows(payload % P))
    return union.reshape(B, nb, H_kv, width), size, slots.reshape(B, nb, H_kv, bq, width)


def _union_merge_kernel(q_ref, qh_ref, union_ref, size_ref, slots_ref, n_ref, *refs, st: LayerStatic,
                        parents_per_step: int):
    """The bottom layer of one block of queries over its union (skipped when the union
    exceeds the buffer): every node of the union gathered once, scored for every member
    row with that member's rotation, masked where the member did not select it or the
    position is not valid (`s*r + c >= n`), folded, normalised."""
    score_precision, operands = merge_score_precision(st), st.merge_operands
    parts = key_parts(score_precision, operands)
    k_refs, (v_ref, cf_ref, sf_ref, m_ref, s_ref, u_ref, *out_refs) = refs[:parts], refs[parts:]
    bq, gt, kp = q_ref.shape
    rows, r = bq * gt, st.r
    size = size_ref[0]

    @pl.when(size <= union_ref.shape[0])
    def _():
        q, qh = q_ref[...].reshape(rows, kp), qh_ref[...].reshape(rows, kp)  # the stored dtype
        n = n_ref[...].reshape(bq)
        child = jnp.arange(r, dtype=jnp.int32)
        per_row = lambda x: jnp.broadcast_to(x[:, None, :], (bq, gt, x.shape[-1])).reshape(rows, x.shape[-1])

        def node_block(u):
            """Scores `[rows, r]` (`-inf` where not merged) and values `[r, Vp]` of union node `u`."""
            in_union = u < size
            nodes = jnp.where(in_union, union_ref[pl.ds(u, 1)] * r + child, 0)
            slot = slots_ref[:, pl.ds(u, 1)].reshape(bq)
            member = (slot >= 0) & in_union
            angle = jnp.where(member, n - 1 - slot * r, 0)  # >= 0: a selected slot has a valid child
            rotated = (q.astype(jnp.float32) * per_row(cf_ref[angle, :])
                       + qh.astype(jnp.float32) * per_row(sf_ref[angle, :]))
            scores = st.alpha * score_dot(rotated, tuple(k_ref[nodes, :] for k_ref in k_refs), score_precision,
                                          operands)
            merged = member[:, None] & (slot[:, None] * r + child[None, :] < n[:, None])  # [BQ, r]
            return jnp.where(per_row(merged), scores, NEG_INF), v_ref[nodes, :]

        def step(i, carry):
            blocks = [node_block(i * parents_per_step + j) for j in range(parents_per_step)]
            return fold_merged(carry, blocks, score_precision, operands)

        num_steps = (size + parents_per_step - 1) // parents_per_step
        state = lax.fori_loop(0, num_steps, step, read_state(m_ref, s_ref, u_ref))
        write_merged(state, out_refs, bottom=True)


@functools.partial(jax.jit, static_argnames=("st", "parents_per_step", "interpret", "out_dtype", "return_lse"))
def union_merge_pallas(q, union, size, slots, n, k_child, layer_v, cos, sin, state, st: LayerStatic,
                       parents_per_step: int = 4, interpret=False, out_dtype=jnp.float32, return_lse=False):
    """The bottom layer of the blocks whose union fits (`size <= width`): the normalised
    output `[B, Q, H_kv, Gp, Vp]` (and `lse [B, Q, H_kv, Gp]` with `return_lse`) in the
    rows `< Gt = next_power_of_two(G)` of those blocks' queries; every other row is left
    unwritten, for `merge.merge_pallas(..., skip=, prior=)` to fill.

    `q [B, Q, H_kv, Gp, Kp]` un-rotated (as for `merge_pallas`), `Q` a multiple of the
    block (`slots.shape[-2]`); `union, size, slots` from `block_union`; `n [B, Q, H_kv, 1]`
    per query; `k_child`: the layer's keys each rotated by its child index (`key_operands`
    of `rotate_phases(...)`, whose first copy is that), for the merge dots; `cos, sin`
    `[Mp, Kp/2]`; `state` the layers above's `(m, S, U)` (`Gp` rows)."""
    check_key_parts(k_child, (key_parts(merge_score_precision(st), st.merge_operands),))
    B, Q, H_kv, gp, kp = q.shape
    bq, width = slots.shape[-2:]
    gt = min(gp, max(1 << (st.group - 1).bit_length(), -(-16 // bq)))  # BQ * Gt >= 16 rows
    vp = layer_v.shape[-1]
    queries = lambda *tail: pl.BlockSpec((None, bq, None) + tail, lambda b, i, h: (b, i, h) + (0,) * len(tail))
    block = lambda *tail: pl.BlockSpec((None, None, None) + tail, lambda b, i, h: (b, i, h) + (0,) * len(tail))
    table = pl.BlockSpec((cos.shape[0], kp), lambda b, i, h: (0, 0))
    specs = dict(q=queries(gt, kp), vec=queries(gt), mat=queries(gt, vp))
    (qq, qh), tables = full_width_inputs(q, cos, sin)
    in_specs = [specs["q"], specs["q"], block(width), block(1), block(bq, width), queries(1),
                *[per_head_spec(x) for x in k_child], per_head_spec(layer_v), table, table, specs["vec"],
                specs["vec"], specs["mat"]]
    out_specs, out_shape = merge_outputs(specs, (B, Q, H_kv, gp, vp), True, out_dtype, return_lse)
    return pl.pallas_call(
        functools.partial(_union_merge_kernel, st=st, parents_per_step=parents_per_step),
        grid=(B, Q // bq, H_kv),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(st.num_warps, st.num_stages),
        interpret=interpret,
    )(qq, qh, union, size, slots, n, *k_child, layer_v, *tables, *state)


def union_members(size, width: int, block_queries: int):
    """`[B, Q, H_kv, 1]` int32, 1 for the queries of blocks the union path serves."""
    return jnp.repeat((size <= width).astype(jnp.int32), block_queries, axis=1)


__all__ = ["block_union", "union_members", "union_merge_pallas"]
