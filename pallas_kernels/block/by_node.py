"""The block backward's key and value gradients summed by node (SPEC 5 with SPEC 12's
selections constant), without atomics: one program per `(b, h_kv, node tile)` of a
layer walks the blocks that merged the tile (`inverted.py`'s index, in block order),
recomputes each block's weights `p = exp(s - lse)` from its rows, and sums the tile's
`dv = p^T do` and `dk = alpha * ds^T q` (rotated back from each block's buffer positions)
in registers. Every tile's sum runs in the same order every call, so `dk`, `dv` are
bitwise reproducible. `dq` stays block-major (`backward.py`, with its key adds off).

A tile is `r` rows (the children of one parent), padded to 16 where `r` is less (a
tensor-core dot's least side); the padding takes no part.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from htree_jax.core.indexing import candidate_count
from pallas_kernels.block.inverted import WORD, InvertedLayer, inverted_index
from pallas_kernels.block.merge import (
    BlockStatic,
    layer_parent_counts,
    operand,
    rotate_back,
    rope_tables,
    rotate_halves,
    scores_dot,
    transposed_dot,
)
from pallas_kernels.shared.common import compiler_params, next_power_of_two


def tile_rows(r: int) -> int:
    """Rows a program's node tile takes: `r`, at least 16, a power of two."""
    return max(16, next_power_of_two(r))


def _node_grads_kernel(q_ref, do_ref, lse_ref, delta_ref, count_ref, cos_ref, sin_ref, k_ref, v_ref, off_ref,
                       blk_ref, slot_ref, bits_ref, dk_ref, dv_ref, *, st: BlockStatic, layer: int, words: int):
    l, r, h, qb, gp = layer, st.r, st.half, st.queries, st.group
    R, rows, dtype = dk_ref.shape[0], st.rows, q_ref.dtype
    u = pl.program_id(2)
    c = jnp.arange(R, dtype=jnp.int32)
    real = c < r
    nodes = u * r + jnp.where(real, c, 0)
    k_lo = k_ref[nodes, pl.ds(0, h)].astype(jnp.float32)
    k_hi = k_ref[nodes, pl.ds(h, h)].astype(jnp.float32)
    v = v_ref[nodes, :]
    last_position = cos_ref.shape[0] - 1
    row_t = jnp.arange(rows, dtype=jnp.int32) // gp  # each row's query inside its chunk

    def entry(e, carry):
        dk_lo, dk_hi, dv = carry
        j, s = blk_ref[e], slot_ref[e]
        p = s * r + c  # the tile's buffer positions in block `j`
        at = jnp.minimum(jnp.where(real, p, 0), last_position)
        cos_k, sin_k = cos_ref[at, :], sin_ref[at, :]
        kr = [operand(x, st, dtype) for x in rotate_halves(k_lo, k_hi, cos_k, sin_k)]
        n_parents = count_ref[j, l]
        t0 = j * r
        if l > 0:
            word = bits_ref[e * words + c // WORD]
            kept = (lax.shift_right_logical(word, c % WORD) & 1) == 1  # refined here: merged below
            merged_here = real & (p < candidate_count(n_parents, t0, r, l)) & ~kept
        g_lo = jnp.zeros((R, h), jnp.float32)
        g_hi = jnp.zeros((R, h), jnp.float32)
        for chunk in range(r // qb):  # the block's rows, `st.rows` at a time
            t_first = t0 + chunk * qb
            n_row = candidate_count(n_parents, t_first + row_t if l == 0 else t0, r, l)
            angle = jnp.broadcast_to(n_row - 1, (rows,))
            q_lo = q_ref[pl.ds(t_first, qb), :, pl.ds(0, h)].reshape(rows, h).astype(jnp.float32)
            q_hi = q_ref[pl.ds(t_first, qb), :, pl.ds(h, h)].reshape(rows, h).astype(jnp.float32)
            q_rot = [operand(x, st, dtype) for x in rotate_halves(q_lo, q_hi, cos_ref[angle, :], sin_ref[angle, :])]
            s_ = st.alpha * (scores_dot(q_rot[0], kr[0], st, dtype) + scores_dot(q_rot[1], kr[1], st, dtype))
            if l == 0:
                merged = real[None, :] & (p[None, :] < n_row[:, None])
            else:
                merged = jnp.broadcast_to(merged_here[None, :], (rows, R))
            lse = lse_ref[pl.ds(t_first, qb), :].reshape(rows)
            delta = delta_ref[pl.ds(t_first, qb), :].reshape(rows)
            do = do_ref[pl.ds(t_first, qb), :, :].reshape(rows, st.vp)
            w = jnp.where(merged, jnp.exp(s_ - lse[:, None]), 0.0)  # [rows, R]
            dv = dv + transposed_dot(w, do, st, dtype)
            ds = w * (scores_dot(do, v, st, dtype) - delta[:, None]) * st.alpha
            g_lo = g_lo + transposed_dot(ds, q_rot[0], st, dtype)
            g_hi = g_hi + transposed_dot(ds, q_rot[1], st, dtype)
        g_lo, g_hi = rotate_back(g_lo, g_hi, cos_k, sin_k)
        return dk_lo + g_lo, dk_hi + g_hi, dv

    zero = jnp.zeros((R, h), jnp.float32)
    dk_lo, dk_hi, dv = lax.fori_loop(off_ref[u], off_ref[u + 1], entry, (zero, zero, jnp.zeros((R, st.vp),
                                                                                                jnp.float32)))
    dk_ref[:, pl.ds(0, h)] = dk_lo
    dk_ref[:, pl.ds(h, h)] = dk_hi
    dv_ref[...] = dv


@functools.partial(jax.jit, static_argnames=("st", "layer", "interpret"))
def node_grads_launch(q5, do5, lse, delta, counts, cos, sin, k_l, v_l, index: InvertedLayer, *, st: BlockStatic,
                      layer: int, interpret: bool = False):
    """Layer `layer`'s `(dk [B, H_kv, U * r, 2 * half], dv [B, H_kv, U * r, vp])` float32
    for its `U` node tiles (`index`), from the rows as `backward.block_backward_launch`
    takes them (`q5`, `do5`, `lse`, `delta`), each block's parent counts `counts [B, NB,
    H_kv, Lp]`, the RoPE tables and the layer's arrays (`merge.layer_arrays`)."""
    B, Tp, H_kv, gp, kp = q5.shape
    U = index.offsets.shape[-1] - 1
    R = tile_rows(st.r)
    words = index.refined.shape[-1]
    bits = index.refined.reshape(B, H_kv, -1)
    per_row = lambda x: pl.BlockSpec((None, Tp, None) + x.shape[3:], lambda i, h, u: (i, 0, h) + (0,) * (x.ndim - 3))
    whole = lambda x: pl.BlockSpec((None, None) + x.shape[2:], lambda i, h, u: (i, h) + (0,) * (x.ndim - 2))
    table = pl.BlockSpec(cos.shape, lambda i, h, u: (0, 0))
    counts_spec = pl.BlockSpec((None, counts.shape[1], None, counts.shape[3]), lambda i, h, u: (i, 0, h, 0))
    tile_out = lambda d: pl.BlockSpec((None, None, None, R, d), lambda i, h, u: (i, h, u, 0, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_node_grads_kernel, st=st, layer=layer, words=words),
        grid=(B, H_kv, U),
        in_specs=[per_row(q5), per_row(do5), per_row(lse), per_row(delta), counts_spec, table, table, whole(k_l),
                  whole(v_l), whole(index.offsets), whole(index.blocks), whole(index.slots), whole(bits)],
        out_specs=[tile_out(kp), tile_out(st.vp)],
        out_shape=[jax.ShapeDtypeStruct((B, H_kv, U, R, kp), jnp.float32),
                   jax.ShapeDtypeStruct((B, H_kv, U, R, st.vp), jnp.float32)],
        compiler_params=compiler_params(st.num_warps, st.num_stages),
        interpret=interpret,
    )(q5, do5, lse, delta, counts, cos, sin, k_l, v_l, index.offsets, index.blocks, index.slots, bits)
    r = st.r
    return dk[:, :, :, :r].reshape(B, H_kv, U * r, kp), dv[:, :, :, :r].reshape(B, H_kv, U * r, st.vp)


def key_grads_by_node(q5, do5, lse, delta, layers, selections, lists, *, config, st: BlockStatic, head_dim: int,
                      T: int, table_rows: int, interpret: bool = False):
    """Every layer's `[dk_l, dv_l]` float32 (bottom first, `[B, H_kv, >= N_l, ...]` as
    `backward.block_backward_launch` returns them) summed by node: the index of the
    blocks' `selections` (`[B, NB, H_kv, top_k]`, `-1` padded, top layer first; `lists`
    the same as `merge.selection_lists` lays them out), then one launch a layer."""
    B, Tp, H_kv = q5.shape[:3]
    NB = Tp // st.r
    index = inverted_index(selections, r=st.r, b=st.r, T=T, num_layers=st.num_layers,
                           layer_sizes=tuple(config.layer_sizes(T)))
    counts = layer_parent_counts(lists, st, jnp.arange(NB, dtype=jnp.int32) * st.r, (B, NB, H_kv))
    cos, sin = rope_tables(config, head_dim, table_rows, st)
    grads = []
    for l in range(st.num_layers):
        grads += node_grads_launch(q5, do5, lse, delta, counts, cos, sin, layers[2 * l], layers[2 * l + 1], index[l],
                                   st=st, layer=l, interpret=interpret)
    return grads
