"""The decode walk's merges (`decode/walk.py` composes them): per-split partial states over a
cache's values (`decode_merge_pallas`), folded into the running state in XLA
(`softmax.combine`). Their full-sequence twins: `pallas_kernels/gqa/merge.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.decode.scores import (
    cache_query_halves,
    cache_span_scores,
    cache_specs,
    cache_split_spans,
    partial_shapes,
    stored_tile_starts,
)
from pallas_kernels.shared.common import (NEG_INF, LayerInputs, LayerStatic, compiler_params, merge_score_precision,
                                         span_candidates)
from pallas_kernels.shared.importance import feature_pieces
from pallas_kernels.shared.precision import weighted_values
from pallas_kernels.shared.softmax import fold


def cache_value_pieces(V: int, K: int | None = None, latent_half: int = 0) -> tuple:
    """`(start in the layer read, size, start in V)` power-of-two pieces of the values:
    a value layer's `feature_pieces` (`K=None`), or, read from a key layer `[.., K]` in
    `rope_layout` order, the first `V` latent features, which lie in two runs,
    `[0, latent_half)` and `[K/2, K/2 + latent_half)`."""
    if K is None:
        return tuple((a, size, a) for a, size in feature_pieces(V))
    first = min(V, latent_half)
    return (tuple((a, size, a) for a, size in feature_pieces(first))
            + tuple((K // 2 + a, size, first + a) for a, size in feature_pieces(V - first)))


def _cache_values(v_ref, nodes, pieces, widen_to=None):
    """The gathered values `[span, V]` as `pieces` (`cache_value_pieces`); `widen_to`: FP8
    values widened to that dtype (exact)."""
    tiles = [v_ref[nodes, pl.ds(a, size)] for a, size, _ in pieces]
    return tiles if widen_to is None else [x.astype(widen_to) for x in tiles]


def _weighted_pieces(values, precision, operands, value_scale=None):
    """`softmax.fold`'s product for values read in pieces: each piece `[span, size]`
    weighted by `w`. `value_scale [span]` (FP8 values): each candidate's weight in `U`
    times its row's scale (the normaliser's weights unscaled)."""
    def weighted(w):
        wv = w if value_scale is None else w * value_scale[None, :]
        return tuple(weighted_values(wv, x, precision, operands) for x in values)
    return weighted


def _cache_merge_kernel(*refs, st: LayerStatic, bottom: bool, zero_unmerged: bool, value_pieces: tuple,
                        values_in_key_tiles: bool = False, carried: bool = False, scale_refs: int = 0):
    """One split's merged candidates folded into a partial state `(m, S, U)`: at the
    bottom every valid candidate, scored here; above it those not kept (`key < tau`),
    from the scores `_cache_scores_kernel` stored (padding rows read as 0). Values as
    `value_pieces` of `v_ref`; `values_in_key_tiles` (bottom, values read from the keys,
    every piece a key tile the scores gathered): the key tiles are the value tiles, no
    value ref and no second gather, which leaves room for two pipeline stages at the
    MLA shape (faster than gathering the values again at one: journal, 2026-11-25 (8)).
    `carried` (one split): the running state `(m, S, U)` follows the inputs and the
    fold goes on from it; the outputs are the new state, or at the bottom the output
    `U / S` in its dtype. `scale_refs` (bottom, FP8 tokens): the inputs end with the
    keys' row scales `[N]` and, where `2`, the values'; else the values' are the keys'
    (values read from the keys)."""
    outputs = 1 if carried and bottom else 3
    inputs = len(refs) - outputs - (3 if carried else 0)
    refs, state_refs, out_refs = refs[:inputs], refs[inputs:len(refs) - outputs], refs[len(refs) - outputs:]
    refs, scale = refs[:len(refs) - scale_refs], refs[len(refs) - scale_refs:]
    k_scale_ref = scale[0] if scale else None
    v_scale_ref = scale[-1] if scale else None
    init = None
    if carried:
        m_in, s_in, u_in = state_refs
        init = (m_in[...], s_in[...], tuple(u_in[:, pl.ds(a, size)] for _, size, a in value_pieces))
    if bottom:
        if values_in_key_tiles:
            q_ref, par_ref, n_ref, k_ref, cos_ref, sin_ref = refs
        else:
            q_ref, par_ref, n_ref, k_ref, v_ref, cos_ref, sin_ref = refs
        gp = q_ref.shape[0]
        q_lo, q_hi = cache_query_halves(q_ref, st)
    else:
        sc_ref, par_ref, n_ref, keys_ref, tau_ref, v_ref = refs
        gp = sc_ref.shape[0]
        tau = tau_ref[0]
        real_rows = jnp.broadcast_to((jnp.arange(gp, dtype=jnp.int32) < st.group)[:, None], (gp, st.span))
    precision, operands = merge_score_precision(st), st.merge_operands
    n = n_ref[0]
    start, count = cache_split_spans(n, st)
    span = st.span

    def merge_span(j, carry):
        p0 = start + j * span
        if bottom:
            # (No `decode_scores.held_query_rows` here: with it the bottom merge of a value
            # layer ran slower at two stages than without; journal, 2026-11-25 (8).)
            scores, merged, _, nodes, tiles = cache_span_scores(p0, q_lo, q_hi, par_ref, k_ref, cos_ref, sin_ref, n, st,
                                                                precision, operands, k_scale_ref)
        else:
            _, valid, nodes = span_candidates(par_ref, p0, span, n, st.r)
            scores = plgpu.load(sc_ref.at[:, pl.ds(j * span, span)], mask=real_rows, other=0.0)
            merged = valid & (keys_ref[pl.ds(j * span, span)] < tau)
        if values_in_key_tiles:
            values = [tiles[a] for a, _, _ in value_pieces]
        else:
            values = _cache_values(v_ref, nodes, value_pieces, None if v_scale_ref is None else q_ref.dtype)
        if zero_unmerged:
            # A weight of 0 times a NaN value is still NaN (SPEC 10): where a query may
            # precede appended tokens, the values it does not merge are zeroed. Only then:
            # the select puts the tile through registers before the product, which costs
            # a decode step time.
            values = [jnp.where(merged[:, None], x, 0) for x in values]
        value_scale = None if v_scale_ref is None else v_scale_ref[nodes]
        return fold(carry, [(jnp.where(merged[None, :], scores, NEG_INF),
                             _weighted_pieces(values, precision, operands, value_scale))])

    if init is None:
        init = (jnp.full((gp,), NEG_INF, jnp.float32), jnp.zeros((gp,), jnp.float32),
                tuple(jnp.zeros((gp, size), jnp.float32) for _, size, _ in value_pieces))
    m, total, acc = lax.fori_loop(0, count, merge_span, init)
    if carried and bottom:
        (o_ref,) = out_refs
        for (_, size, a), u in zip(value_pieces, acc):
            o_ref[:, pl.ds(a, size)] = (u / total[:, None]).astype(o_ref.dtype)
        return
    m_ref, s_ref, u_ref = out_refs
    m_ref[...] = m
    s_ref[...] = total
    for (_, size, a), u in zip(value_pieces, acc):
        u_ref[:, pl.ds(a, size)] = u


def values_in_key_tiles(value_pieces: tuple, K: int, latent_half: int) -> bool:
    """Whether every value piece (`cache_value_pieces` of a key layer) is a key tile the
    bottom's scores gather as stored (`decode_scores.stored_tile_starts`)."""
    tiles = stored_tile_starts(K // 2, latent_half)
    return bool(latent_half) and all((a, size) in tiles for a, size, _ in value_pieces)


@functools.partial(jax.jit, static_argnames=("st", "interpret", "zero_unmerged", "value_pieces", "values_from_keys"))
def decode_merge_pallas(q_or_scores, layer: LayerInputs, st: LayerStatic, interpret: bool = False, *,
                        zero_unmerged: bool = True, value_pieces: tuple | None = None, values_from_keys: bool = False,
                        state=None, scales=None):
    """Partial states `(m, S [B, Q, H_kv, splits, Gp], U [..., Gp, V])` of a layer's
    merged candidates (`layer`: the cache layer's `parents, n`, `keys, tau`, its keys
    `k` as stored (the bottom's; None above it), values `v`, and the RoPE tables). Bottom
    layer (`keys=None`): `q_or_scores` is the queries `[B, Q, H_kv, Gp, K]` and every
    valid candidate merges; above it, the scores from `decode_scores_pallas` and the
    candidates with `keys < tau` merge. `value_pieces`
    (`cache_value_pieces`; None: all of `layer_v`): where the values lie in `layer_v`,
    which may be the key layer: `values_from_keys` says so (`layer_v` is then `layer_k`
    at the bottom, whose gathered tiles serve as the values where they can,
    `values_in_key_tiles`). `state`: with one split (`st.tile` the whole buffer), the
    running `(m, S [B, Q, H_kv, Gp], U [..., Gp, V])` the layer folds into in the kernel;
    then the new state is returned, or at the bottom the output `U / S` `[B, Q, H_kv,
    Gp, V]` in the queries' dtype (no partial states, no fold in XLA: fewer launches;
    journal, 2026-11-25 (8)). `scales` (bottom,
    FP8 tokens): the keys' (and, unless `values_from_keys`, the values') float32 row
    scales `[B, H_kv, N]`."""
    parents, n, keys, tau, layer_k, layer_v, cos, sin = layer
    bottom = keys is None
    if scales is not None and not bottom:
        raise ValueError("decode_merge_pallas: FP8 row scales are the bottom layer's (the tokens')")
    B, Q, H_kv, gp = q_or_scores.shape[:4]
    value_pieces = value_pieces or cache_value_pieces(layer_v.shape[-1])
    V, Mp = sum(size for _, size, _ in value_pieces), parents.shape[-1] * st.r
    splits = Mp // st.tile
    reuse = bottom and values_from_keys and values_in_key_tiles(value_pieces, layer_k.shape[-1], st.latent_half)
    sp = cache_specs(gp, Mp, st, layer_v.shape[1], K=layer_k.shape[-1] if bottom else None, V=V,
                     heads_per_layer_head=H_kv // layer_v.shape[2], value_width=layer_v.shape[-1])
    if bottom:
        in_specs = [sp["q"], sp["parents"], sp["n"], sp["k"], sp["v"], sp["table"], sp["table"]]
        args = (q_or_scores, parents, n, layer_k, layer_v, cos, sin)
        if reuse:
            in_specs, args = in_specs[:4] + in_specs[5:], args[:4] + args[5:]
        if scales is not None:
            scales = tuple(scales[:1] if values_from_keys else scales[:2])
            per = H_kv // layer_k.shape[2]
            scale_spec = pl.BlockSpec((None, None, layer_k.shape[1]), lambda b, i, h, s: (b, h // per, 0))
            in_specs, args = in_specs + [scale_spec] * len(scales), args + scales
    else:
        in_specs = [sp["scores"], sp["parents"], sp["n"], sp["keys"], sp["tau"], sp["v"]]
        args = (q_or_scores, parents, n, keys, tau, layer_v)
    out_specs, out_shape = [sp["vec"], sp["vec"], sp["mat"]], partial_shapes(B, Q, H_kv, splits, gp, V)
    if state is not None:
        if splits != 1:
            raise ValueError(f"decode_merge_pallas: a carried state needs one split, got {splits}")
        vec = pl.BlockSpec((None, None, None, gp), lambda b, i, h, s: (b, i, h, 0))
        mat = pl.BlockSpec((None, None, None, gp, V), lambda b, i, h, s: (b, i, h, 0, 0))
        in_specs, args = in_specs + [vec, vec, mat], args + tuple(state)
        out_specs, out_shape = [vec, vec, mat], [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state]
        if bottom:
            out_specs, out_shape = mat, jax.ShapeDtypeStruct((B, Q, H_kv, gp, V), q_or_scores.dtype)
    out = pl.pallas_call(
        functools.partial(_cache_merge_kernel, st=st, bottom=bottom, zero_unmerged=zero_unmerged,
                          value_pieces=value_pieces, values_in_key_tiles=reuse, carried=state is not None,
                          scale_refs=0 if scales is None else len(scales)),
        grid=(B, Q, H_kv, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(st.num_warps, st.num_stages),
        interpret=interpret,
    )(*args)
    return out if state is not None and bottom else tuple(out)
