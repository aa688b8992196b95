"""Backward kernels of one htree layer (SPEC 5: selection constant): `dq`, beside the twin.

With the forward's per-row log-sum-exp `lse` (over every merged node of every layer)
and `delta = rowsum(do * o)`, a merged candidate `j` of row `i` has weight
`p = exp(s - lse)` and `ds = p * (do . v_j - delta)`; then `dq += alpha * ds * rope(k_j)`
(rotated back to the query's frame), and the node's `dk_j += alpha * ds * rope(q)`,
`dv_j += p * do`.

Here each query's program sums its `dq` in registers (`layer_backward_pallas`, the
layers below the top: one program per `(b, t, h_kv)` walks the candidates like
`merge_pallas`; the top layer's backward is `top_backward.py`). `dk`, `dv` are summed per
node by the transposed kernels of `node_backward.py` (each program owns a block of
nodes), so the backward is deterministic and issues no atomics.
An earlier version added `dk`, `dv` from these programs with float32 atomics, several
times slower than summing by node (journal, 2026-11-22 (session 5)).

`layer_backward_twin` (autodiff of the layer's share of the output) gives all three.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.shared.common import (
    LayerInputs,
    LayerStatic,
    RowStats,
    block_specs,
    compiler_params,
    layer_refs,
    merge_score_precision,
    span_candidates,
)
from pallas_kernels.shared.importance import gather_nodes, scores_twin
from pallas_kernels.shared.precision import check_key_parts, dot_rows, key_parts, product, split_rows, whole_keys


def grads_of_block(scores, values, do, lse, delta, merged, st: LayerStatic, exp=jnp.exp, alpha: bool = True):
    """One block of candidates, `scores [rows, n]` (scaled): `(p, alpha * ds)`;
    `merged [rows, n]` already excludes padding rows. `exp=jnp.exp2`: `scores` and
    `lse` in base 2; `alpha=False`: `ds` itself (the caller scales its sums once)."""
    p = jnp.where(merged, exp(scores - lse[:, None]), 0.0)
    dp = product(do, values, (1, 1), merge_score_precision(st), st.merge_operands)  # [rows, n]
    return p, (st.alpha * p * (dp - delta[:, None]) if alpha else p * (dp - delta[:, None]))


def _layer_backward_kernel(*refs, st: LayerStatic, bottom: bool):
    """One query per program. RoPE works on half-width columns (`x = [lo, hi]`, the
    rotation pairs `lo[i]` with `hi[i]`), so the query is rotated, and `dq` rotated
    back, elementwise on halves: keys are read as two halves."""
    precision, operands = merge_score_precision(st), st.merge_operands
    (q_ref, par_ref, n_ref), keys_ref, tau_ref, k_refs, rest = layer_refs(refs, 3, st, bottom)
    v_ref, cos_ref, sin_ref, lse_ref, delta_ref, do_ref, dq_ref = rest
    bq, gp, kp = q_ref.shape
    rows, half, vp = bq * gp, kp // 2, do_ref.shape[-1]
    r, span = st.r, st.span
    versions = span // r
    N = k_refs[0].shape[0] // versions
    n = n_ref[0]
    q_lo = q_ref[:, :, pl.ds(0, half)].astype(jnp.float32).reshape(rows, half)
    q_hi = q_ref[:, :, pl.ds(half, half)].astype(jnp.float32).reshape(rows, half)
    real = jnp.arange(rows, dtype=jnp.int32) % gp < st.group
    lse = jnp.where(real, lse_ref[...].reshape(rows), 0.0)
    delta = delta_ref[...].reshape(rows)
    do = do_ref[...].astype(jnp.float32).reshape(rows, vp)
    if not bottom:
        tau = tau_ref[...]  # [BQ, 1]
    copy = (jnp.arange(span, dtype=jnp.int32) // r) * N

    def unit(p0, carry):
        dq_lo, dq_hi = carry
        positions, valid, nodes = span_candidates(par_ref, p0, span, n, r)
        k_lo = tuple(k_ref[nodes + copy, pl.ds(0, half)] for k_ref in k_refs)
        k_hi = tuple(k_ref[nodes + copy, pl.ds(half, half)] for k_ref in k_refs)
        angle = jnp.maximum(n - 1 - p0, 0)
        c, s = cos_ref[pl.ds(angle, 1), :], sin_ref[pl.ds(angle, 1), :]
        qr_lo, qr_hi = q_lo * c - q_hi * s, q_hi * c + q_lo * s  # the query rotated by `angle`
        scores = st.alpha * (dot_rows(split_rows(qr_lo, precision, operands), k_lo, precision, operands)
                             + dot_rows(split_rows(qr_hi, precision, operands), k_hi, precision, operands))
        if bottom:
            merged_q = jnp.broadcast_to(valid[None, :], (bq, span))
        else:
            merged_q = valid[None, :] & (keys_ref[:, pl.ds(p0, span)] < tau)
        merged = jnp.broadcast_to(merged_q[:, None, :], (bq, gp, span)).reshape(rows, span) & real[:, None]
        _, ds = grads_of_block(scores, v_ref[nodes, :], do, lse, delta, merged, st)
        # dq, rotated back by `angle` into the query's frame.
        g_lo, g_hi = (product(ds, whole_keys(x), (1, 0), precision, operands) for x in (k_lo, k_hi))
        dq_lo = dq_lo + g_lo * c + g_hi * s
        dq_hi = dq_hi + g_hi * c - g_lo * s
        return dq_lo, dq_hi

    def tile(i, carry):
        for u in range(st.tile // span):
            carry = unit(i * st.tile + u * span, carry)
        return carry

    zeros = jnp.zeros((rows, half), jnp.float32)
    dq_lo, dq_hi = lax.fori_loop(0, (n + st.tile - 1) // st.tile, tile, (zeros, zeros))
    dq_ref[:, :, pl.ds(0, half)] = dq_lo.reshape(bq, gp, half)
    dq_ref[:, :, pl.ds(half, half)] = dq_hi.reshape(bq, gp, half)


@functools.partial(jax.jit, static_argnames=("st", "interpret"))
def layer_backward_pallas(q, layer: LayerInputs, stats: RowStats, st: LayerStatic, interpret=False):
    """`dq [B, Q, H_kv, Gp, Kp]` float32 (un-rotated) from one per-query layer's merged
    candidates (the bottom with `layer.keys=None`). `q` and `layer` as for `merge_pallas`
    (`layer.k` its merge operands); `stats` the rows' `lse, do, delta` (`Gp` rows).
    Above the bottom the merged candidates are those with `keys < tau`."""
    parents, n, keys, tau, k_phases, layer_v, cos, sin = layer
    lse, do, delta = stats
    check_key_parts(k_phases, (key_parts(merge_score_precision(st), st.merge_operands),))
    B, Q, H_kv, gp, kp = q.shape
    bottom = keys is None
    sp = block_specs(st, gp, kp, cos.shape[0], parents, k_phases, layer_v)
    table = pl.BlockSpec(cos.shape, lambda b, i, h: (0, 0))  # half width: the kernel works on halves
    in_specs = [sp["q"], sp["parents"], sp["n"]] + ([] if bottom else [sp["keys"], sp["tau"]])
    in_specs += [*sp["k"], sp["v"], table, table, sp["vec"], sp["vec"], sp["mat"]]
    args = (q, parents, n) + (() if bottom else (keys, tau)) + tuple(k_phases) + (layer_v, cos, sin, lse, delta, do)
    return pl.pallas_call(
        functools.partial(_layer_backward_kernel, st=st, bottom=bottom),
        grid=(B, Q // st.block_queries, H_kv),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, st.block_queries, None, gp, kp), lambda b, i, h: (b, i, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, Q, H_kv, gp, kp), jnp.float32),
        compiler_params=compiler_params(st.merge_num_warps or st.num_warps, st.num_stages),
        interpret=interpret,
    )(*args)


# ---------------------------------------------------------------------------------------
# The twin: autodiff of the layer's share of the output with `lse` held constant.


def layer_backward_twin(q, layer: LayerInputs, stats: RowStats, st: LayerStatic):
    """Twin of `layer_backward_pallas` (`layer.k` un-rotated): `(dq, dk [B, H_kv, N,
    Kp], dv [B, H_kv, N, Vp])` as the gradient of `sum p * (do . v - delta)` over the
    merged candidates, `p = exp(s - lse)` with `lse`, `delta` constant (float32, exact)."""
    parents, n, keys, tau, layer_k, layer_v, cos, sin = layer
    lse, do, delta = stats

    def share(q, layer_k, layer_v):
        scores, valid, nodes, _, _ = scores_twin(q, parents, n, layer_k, cos, sin, st)
        merged = valid if keys is None else valid & (keys < tau)
        gp = q.shape[3]
        merged = merged[..., None, :] & (jnp.arange(gp) < st.group)[:, None]
        p = jnp.where(merged, jnp.exp(scores - jnp.where(merged, lse[..., None], 0.0)), 0.0)
        values = gather_nodes(layer_v, jnp.where(valid, nodes, 0)).astype(jnp.float32)
        dp = jnp.einsum("bqhgv,bqhmv->bqhgm", do, values, precision=lax.Precision.HIGHEST)
        return jnp.sum(p * (dp - delta[..., None]))

    return jax.grad(share, argnums=(0, 1, 2))(q.astype(jnp.float32), layer_k.astype(jnp.float32),
                                                layer_v.astype(jnp.float32))


__all__ = ["grads_of_block", "layer_backward_pallas", "layer_backward_twin"]
