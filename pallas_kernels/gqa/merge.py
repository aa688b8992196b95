"""SPEC 2.4 in a kernel: the online-softmax merge of a layer's candidates below the top,
one program per `(b, t, h_kv)` (the fold itself: `shared/softmax.py`), and the state's
tiles, load and store that this family's merge kernels (here and `top_layer.py`) share.

- `merge_scored_pallas`: a layer that selects merges the candidates it did not keep, from
  the scores its importance pass stored (no key is gathered or scored again).
- `merge_pallas`: the bottom layer merges every valid candidate, scoring its keys (read
  in `span / r` rotated copies, `rope.rotate_phases`), and normalises: `o = U / S`.
The twins are `merge_twin` and `merge_scored_twin` (the reference's `merge`).

State layout: m, S `[B, Q, H_kv, Gp]`, U `[B, Q, H_kv, Gp, Vp]` float32; other layouts as
in `importance.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from htree_jax.core.indexing import candidate_nodes as nodes_of_positions
from htree_jax.core.softmax import merge, normalize
from pallas_kernels.shared.common import (
    NEG_INF,
    LayerInputs,
    LayerStatic,
    block_specs,
    layer_params,
    merge_score_precision,
    per_query,
    span_candidates,
)
from pallas_kernels.shared.importance import gather_nodes, query_rows, score_tile, scores_twin
from pallas_kernels.shared.precision import check_key_parts, key_parts, weighted_values
from pallas_kernels.shared.rope import full_width_inputs
from pallas_kernels.shared.softmax import fold, log_sum_exp, normalized


def merged_tile(scores, values, score_precision, operands):
    """A tile as `softmax.fold` takes it: its scores (`NEG_INF` where not merged) and the
    product of its `values [n, Vp]` with the weights."""
    return scores, lambda w: weighted_values(w, values, score_precision, operands)


def read_state(m_ref, s_ref, u_ref):
    """The incoming `(m, S, U)` of a block, rows flattened."""
    vp = u_ref.shape[-1]
    rows = m_ref.shape[0] * m_ref.shape[1]
    return m_ref[...].reshape(rows), s_ref[...].reshape(rows), u_ref[...].reshape(rows, vp)


def write_merged(state, out_refs, bottom: bool):
    """The bottom layer writes the normalised output (`out_refs = (o_ref,)`, or `(o_ref,
    lse_ref)`), the others the state `(m_out, s_out, u_out)` (`[BQ, G]`, `[BQ, G]`,
    `[BQ, G, Vp]`)."""
    if bottom:
        o_ref, *lse_ref = out_refs
        o_ref[...] = normalized(state).reshape(o_ref.shape).astype(o_ref.dtype)
        if lse_ref:  # the log-sum-exp of each row's merged scores, for the backward
            lse_ref[0][...] = log_sum_exp(state).reshape(lse_ref[0].shape)
    else:
        m, total, acc = state
        m_out, s_out, u_out = out_refs
        m_out[...] = m.reshape(m_out.shape)
        s_out[...] = total.reshape(s_out.shape)
        u_out[...] = acc.reshape(u_out.shape)


def merge_outputs(specs, shape, bottom: bool, out_dtype, return_lse: bool = False):
    """`(out_specs, out_shape)` of a merge launch: the normalised output `[B, Q, H_kv,
    rows, Vp]` at the bottom (and its rows' log-sum-exp, float32, with `return_lse`),
    else the float32 state `(m, S, U)`."""
    vec = jax.ShapeDtypeStruct(shape[:-1], jnp.float32)
    if bottom:
        o = jax.ShapeDtypeStruct(shape, out_dtype)
        return ([specs["mat"], specs["vec"]], [o, vec]) if return_lse else (specs["mat"], o)
    return [specs["vec"], specs["vec"], specs["mat"]], [vec, vec, jax.ShapeDtypeStruct(shape, jnp.float32)]



def _merge_kernel(q_ref, qh_ref, par_ref, n_ref, *refs, st: LayerStatic):
    """The bottom layer of one query (per program): every valid candidate, scored here,
    folded into the state, then normalised."""
    score_precision, operands = merge_score_precision(st), st.merge_operands
    parts = key_parts(score_precision, operands)
    k_refs, (v_ref, cf_ref, sf_ref, m_ref, s_ref, u_ref, *out_refs) = refs[:parts], refs[parts:]
    rows = q_ref.shape[0] * q_ref.shape[1]
    n = n_ref[0]
    q_parts = query_rows(q_ref, qh_ref)

    def merge_tile(i, carry):
        units = score_tile(i, q_parts, par_ref, k_refs, cf_ref, sf_ref, n, st, score_precision, operands)
        tiles = [merged_tile(jnp.where(jnp.broadcast_to(valid[None, :], (rows, st.span)), scores, NEG_INF),
                             v_ref[nodes, :], score_precision, operands) for scores, valid, _, nodes in units]
        return fold(carry, tiles)

    state = lax.fori_loop(0, (n + st.tile - 1) // st.tile, merge_tile, read_state(m_ref, s_ref, u_ref))
    write_merged(state, out_refs, bottom=True)



def _merge_scored_kernel(scores_ref, par_ref, n_ref, keys_ref, tau_ref, v_ref, m_ref, s_ref, u_ref, *out_refs,
                         st: LayerStatic):
    """Online-softmax merge of the candidates not kept, from the scores the importance
    pass stored (real heads' rows; padding rows read as 0, the score of a zero query):
    no key is gathered or scored again, so a candidate costs its value row and `G`
    floats instead of its key row too."""
    bq, gp, _ = scores_ref.shape
    rows = bq * gp
    n = n_ref[0]
    tau = tau_ref[...]  # [BQ, 1]
    real_rows = jnp.broadcast_to((jnp.arange(gp, dtype=jnp.int32) < st.group)[None, :, None], (bq, gp, st.tile))

    def merge_tile(i, carry):
        p0 = i * st.tile
        _, valid, nodes = span_candidates(par_ref, p0, st.tile, n, st.r)
        scores = plgpu.load(scores_ref.at[:, :, pl.ds(p0, st.tile)], mask=real_rows, other=0.0)
        kept = keys_ref[:, pl.ds(p0, st.tile)] >= tau  # [BQ, tile]
        merged = jnp.broadcast_to((valid[None, :] & ~kept)[:, None, :], (bq, gp, st.tile)).reshape(rows, st.tile)
        return fold(carry, [merged_tile(jnp.where(merged, scores.reshape(rows, st.tile), NEG_INF), v_ref[nodes, :],
                                        merge_score_precision(st), st.merge_operands)])

    num_tiles = (n + st.tile - 1) // st.tile
    state = lax.fori_loop(0, num_tiles, merge_tile, read_state(m_ref, s_ref, u_ref))
    write_merged(state, out_refs, bottom=False)



@functools.partial(jax.jit, static_argnames=("st", "interpret", "out_dtype", "return_lse"))
def merge_pallas(q, layer: LayerInputs, state, st: LayerStatic, interpret=False, out_dtype=jnp.float32,
                 return_lse=False):
    """The bottom layer (SPEC 2.4, every valid candidate merges; `layer.keys` not
    read): the normalised output `[B, Q, H_kv, Gp, Vp]` in `out_dtype` (with
    `return_lse`, `(o, lse [B, Q, H_kv, Gp])`, the rows' log-sum-exp for the backward).
    `q` as for `importance.importance_keys_pallas`; `layer.k` as
    `key_operands(rotate_phases(...), merge precision, st.merge_operands)`; `state` the
    layers above's `(m, S, U)`."""
    parents, n, k_phases, layer_v, cos, sin = layer.parents, layer.n, layer.k, layer.v, layer.cos, layer.sin
    check_key_parts(k_phases, (key_parts(merge_score_precision(st), st.merge_operands),))
    B, Q, H_kv, gp, _ = q.shape
    vp = layer_v.shape[-1]
    sp = block_specs(st, gp, q.shape[-1], cos.shape[0], parents, k_phases, layer_v)
    queries, tables = full_width_inputs(q, cos, sin)
    in_specs = [sp["q"], sp["q"], sp["parents"], sp["n"], *sp["k"], sp["v"], sp["table"], sp["table"], sp["vec"],
                sp["vec"], sp["mat"]]
    out_specs, out_shape = merge_outputs(sp, (B, Q, H_kv, gp, vp), True, out_dtype, return_lse)
    args = (*queries, parents, n, *k_phases, layer_v, *tables, *state)
    return pl.pallas_call(
        functools.partial(_merge_kernel, st=st),
        grid=(B, Q // st.block_queries, H_kv),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=layer_params(st, st.merge_num_warps),
        interpret=interpret,
    )(*args)


@functools.partial(jax.jit, static_argnames=("st", "interpret"))
def merge_scored_pallas(scores, parents, n, keys, tau, layer_v, state, st: LayerStatic, interpret=False):
    """Upper layer: the state after merging the candidates not kept, with the `scores`
    stored by `importance_keys_pallas(..., return_scores=True)` (which then need no
    keys here). `parents, n` one row per block of `st.block_queries` queries."""
    B, Q, H_kv, gp, Mp = scores.shape
    vp = layer_v.shape[-1]
    if Mp % st.tile or st.tile % st.r:
        raise ValueError(f"candidate width {Mp} must be a multiple of the tile {st.tile}, itself of r={st.r}")
    sp = block_specs(st, gp, 1, Mp, parents, (), layer_v)
    out_specs, out_shape = merge_outputs(sp, (B, Q, H_kv, gp, vp), False, jnp.float32)
    return tuple(pl.pallas_call(
        functools.partial(_merge_scored_kernel, st=st),
        grid=(B, Q // st.block_queries, H_kv),
        in_specs=[sp["scores"], sp["parents"], sp["n"], sp["keys"], sp["tau"], sp["v"], sp["vec"], sp["vec"],
                  sp["mat"]],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=layer_params(st, st.merge_num_warps),
        interpret=interpret,
    )(scores, parents, n, keys, tau, layer_v, *state))


# ---------------------------------------------------------------------------------------
# Pure-JAX twins, written with the reference's `merge`.


def merge_twin(q, layer: LayerInputs, state, st: LayerStatic, out_dtype=jnp.float32):
    """Twin of `merge_pallas` (`layer.keys=None`: every valid candidate, then
    normalised) and of the top layer's `top_merge_pallas` (with `keys, tau`: the
    candidates not kept, the state), written with the reference's `merge` and
    `normalize`; `layer.k` the un-rotated keys."""
    parents, n, keys, tau, layer_k, layer_v, cos, sin = layer
    B, Q, H_kv, gp, _ = q.shape
    scores, valid, nodes, _, _ = scores_twin(q, parents, n, layer_k, cos, sin, st)
    flat = lambda x: x.reshape((B * Q * H_kv,) + x.shape[3:])
    merged = valid if keys is None else valid & (keys < tau)
    values = gather_nodes(layer_v, jnp.where(valid, nodes, 0)).astype(jnp.float32)
    m, S, U = merge(tuple(flat(x) for x in state), flat(scores), flat(values), flat(merged))
    if keys is None:
        return normalize((m, S, U)).reshape(B, Q, H_kv, gp, -1).astype(out_dtype)
    shape = (B, Q, H_kv)
    return m.reshape(shape + (gp,)), S.reshape(shape + (gp,)), U.reshape(shape + U.shape[-2:])


def merge_scored_twin(scores, parents, n, keys, tau, layer_v, state, st: LayerStatic):
    """Twin of `merge_scored_pallas`: the reference's `merge` on the given scores (rows
    past the real heads as 0, as the kernel reads them)."""
    B, Q, H_kv, gp, Mp = scores.shape
    parents, n = per_query(parents, st), per_query(n, st)
    positions = jnp.arange(Mp, dtype=jnp.int32)
    nodes = nodes_of_positions(parents, positions, st.r)
    valid = positions < n
    scores = jnp.where(jnp.arange(gp)[:, None] < st.group, scores, 0.0)
    flat = lambda x: x.reshape((B * Q * H_kv,) + x.shape[3:])
    values = gather_nodes(layer_v, jnp.where(valid, nodes, 0)).astype(jnp.float32)
    m, S, U = merge(tuple(flat(x) for x in state), flat(scores), flat(values), flat(valid & (keys < tau)))
    shape = (B, Q, H_kv)
    return m.reshape(shape + (gp,)), S.reshape(shape + (gp,)), U.reshape(shape + U.shape[-2:])
