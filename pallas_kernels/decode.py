"""Pallas decode kernels: a few new queries walk a decode cache's tree (SPEC 2).

The full-sequence kernels (`importance.py`, `merge.py`) read each layer's keys in `span / r`
rotated copies made for the whole layer (`rotate_phases`), which for a decode step would
be `O(T)` work per token. Here the keys are read as the cache stores them (`[B, N, H_kv,
K]`, un-rotated, the layout `htree_jax.decode.HTreeCache` keeps) and rotated in the
kernel after the gather: candidate position `p` of a product over `[p0, p0 + span)`
is rotated by `p - p0`, the query once by `n - 1 - p0` (SPEC 2.2 is relative), the
same arithmetic `rotate_phases` does ahead of time, so the scores are those of the
full-sequence kernels.

A decode step has few queries (`B * H_kv` of them, 4 at `B = 1`), so each query's
candidate buffer is split over `splits` programs (grid `(B, Q, H_kv, splits)`), as
flash-decoding splits the keys, and the per-split partial results are combined in XLA:

  per layer that selects (top down):
    `_scores_kernel`   scores of the split's candidates, stored, and the split's
                       running (max, sum) over the normaliser set R
    XLA                the rows' importance shift, packed keys (`keys_from_scores`)
    `top_k.select_top_k_pallas` (shared with the forward): the kept nodes, `tau`
    `_merge_kernel`    the split's merged candidates (stored scores, gathered values)
                       folded into a partial softmax state (m, S, U)
  bottom layer: `_merge_kernel` scoring its keys, every valid candidate merged;
  the partial states fold into the running one in XLA, and the output is U / S.

Layouts (the wrapper pads heads and candidates):
  q        `[B, Q, H_kv, Gp, K]`  float32, un-rotated, `Gp = max(16, next_pow2(G))` rows
  parents  `[B, Q, H_kv, Mp / r]` int32 ascending, `-1` padded
  n        `[B, Q, H_kv, 1]` int32 valid candidates (SPEC 2.1)
  layer    keys `[B, N, H_kv, K]`, values `[B, N, H_kv, V]` (the cache's, any N)
  cos, sin `[Mp, K/2]` float32  RoPE at `0 .. Mp - 1` (exactly rounded)
  scores   `[B, Q, H_kv, Gp, Mp]` float32 (real heads' rows of valid spans written)
  partial  m, S `[B, Q, H_kv, splits, Gp]`, U `[B, Q, H_kv, splits, Gp, V]` float32
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from htree_jax.config import HTreeConfig
from htree_jax.reference import candidate_count, num_parents, top_layer_parents
from htree_jax.rope import rope_table
from pallas_kernels.common import NEG_INF, LayerStatic, candidate_nodes, compiler_params, merge_score_precision
from pallas_kernels.common import next_power_of_two, pad_axis, real_heads, virtual_heads
from pallas_kernels.forward import check_group, head_split
from pallas_kernels.importance import group_keys_from_scores, importance_shift, online_max_sum
from pallas_kernels.precision import Precisions, score_dot, weighted_values
from pallas_kernels.top_k import select_top_k_pallas

# Every load is a power of two wide: keys are read in power-of-two pieces of each RoPE
# half (`feature_pieces`: 288 = 256 + 32 for K = 576), values in pieces of V, so K/2 and
# V are multiples of 16 (a dot's least).
MIN_DIM, MAX_HEAD_DIM, MAX_VALUE_DIM, PIECE = 32, 576, 512, 16


@dataclasses.dataclass(frozen=True)
class DecodeBlockSizes:
    # Candidates per score product (one query rotation); raised to >= 16 and >= r.
    span: int = 64
    # Programs to aim for per launch: a query's candidates are split until
    # B * Q * H_kv * splits reaches this (at most Mp / span splits).
    target_programs: int = 512
    num_warps: int = 4
    # Scores and packed keys of a chunk of queries (prefill) stay under this.
    chunk_budget_bytes: int = 256 << 20


def check_pallas_decode_dims(head_dim: int, value_dim: int, group: int) -> None:
    """The Pallas decode kernels' limits (checked before any launch)."""
    if not MIN_DIM <= head_dim <= MAX_HEAD_DIM or head_dim % (2 * PIECE):
        raise ValueError(f"Pallas decoding supports head dim K in [{MIN_DIM}, {MAX_HEAD_DIM}], a multiple of "
                         f"{2 * PIECE}, got K = {head_dim}")
    if not MIN_DIM <= value_dim <= MAX_VALUE_DIM or value_dim % PIECE:
        raise ValueError(f"Pallas decoding supports value dim V in [{MIN_DIM}, {MAX_VALUE_DIM}], a multiple of "
                         f"{PIECE}, got V = {value_dim}")
    check_group(group, "Pallas decoding")


def feature_pieces(width: int) -> tuple:
    """`(start, size)` power-of-two pieces covering `[0, width)`, largest first."""
    pieces, start = [], 0
    for bit in reversed(range(width.bit_length())):
        if width & (1 << bit):
            pieces.append((start, 1 << bit))
            start += 1 << bit
    return tuple(pieces)


def _span_scores(p0, q_lo, q_hi, par_ref, k_ref, cos_ref, sin_ref, n, st: LayerStatic, precision, operands):
    """Scores `[Gp, span]` of candidate positions `[p0, p0 + span)` (`p0` a multiple of
    the span), their validity, positions and nodes. Keys are gathered un-rotated and
    rotated here by `p - p0`; the query by `n - 1 - p0`."""
    r, span = st.r, st.span
    half = cos_ref.shape[-1]
    positions, valid, nodes = candidate_nodes(par_ref, p0, span, n, r)
    angle = jnp.maximum(n - 1 - p0, 0)  # an invalid span: any row, masked by the caller
    scores = None
    for (start, size), q_lo, q_hi in zip(feature_pieces(half), q_lo, q_hi):  # the score sums over features
        k_lo = k_ref[nodes, pl.ds(start, size)].astype(jnp.float32)
        k_hi = k_ref[nodes, pl.ds(half + start, size)].astype(jnp.float32)
        kc, ks = cos_ref[pl.ds(0, span), pl.ds(start, size)], sin_ref[pl.ds(0, span), pl.ds(start, size)]
        k_lo, k_hi = k_lo * kc - k_hi * ks, k_lo * ks + k_hi * kc
        c, s = cos_ref[pl.ds(angle, 1), pl.ds(start, size)], sin_ref[pl.ds(angle, 1), pl.ds(start, size)]
        r_lo, r_hi = q_lo * c - q_hi * s, q_lo * s + q_hi * c
        piece = score_dot(r_lo, (k_lo,), precision, operands) + score_dot(r_hi, (k_hi,), precision, operands)
        scores = piece if scores is None else scores + piece
    return st.alpha * scores, valid, positions, nodes


def _split_spans(n, st: LayerStatic):
    """`(start, count)`: the first position of this program's split and how many of its
    spans hold valid candidates."""
    start = pl.program_id(3) * st.tile
    count = jnp.clip((n - start + st.span - 1) // st.span, 0, st.tile // st.span)
    return start, count


def _query_halves(q_ref):
    """The query's RoPE halves, each as its `feature_pieces`."""
    half = q_ref.shape[-1] // 2
    pieces = feature_pieces(half)
    return ([q_ref[:, pl.ds(a, size)].astype(jnp.float32) for a, size in pieces],
            [q_ref[:, pl.ds(half + a, size)].astype(jnp.float32) for a, size in pieces])


def _values(v_ref, nodes):
    """The gathered values `[span, V]` as their `feature_pieces`."""
    return [v_ref[nodes, pl.ds(a, size)] for a, size in feature_pieces(v_ref.shape[-1])]


def _fold(carry, scores, values, precision, operands):
    """`merge.fold_merged` of one block, the values and `U` in pieces."""
    m, total, acc = carry
    m_new = jnp.maximum(m, jnp.max(scores, axis=1))
    m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
    decay = jnp.exp(m - m_safe)
    w = jnp.exp(scores - m_safe[:, None])
    total = total * decay + jnp.sum(w, axis=1)
    acc = tuple(u * decay[:, None] + weighted_values(w, x, precision, operands) for u, x in zip(acc, values))
    return m_new, total, acc


def _scores_kernel(q_ref, par_ref, n_ref, k_ref, cos_ref, sin_ref, s_ref, m_ref, t_ref, *, st: LayerStatic):
    """One split of a selecting layer: its candidates' scores (stored, real heads' rows)
    and its rows' running max and sum of `exp` over R (SPEC 2.3)."""
    gp = q_ref.shape[0]
    n = n_ref[0]
    q_lo, q_hi = _query_halves(q_ref)
    start, count = _split_spans(n, st)
    last_in_norm = n - 1 if st.strict_causal else n
    real_rows = jnp.broadcast_to((jnp.arange(gp, dtype=jnp.int32) < st.group)[:, None], (gp, st.span))

    def score_span(j, carry):
        scores, _, positions, _ = _span_scores(start + j * st.span, q_lo, q_hi, par_ref, k_ref, cos_ref, sin_ref, n,
                                               st, st.precision, st.importance_operands)
        plgpu.store(s_ref.at[:, pl.ds(j * st.span, st.span)], scores, mask=real_rows)
        return online_max_sum(*carry, jnp.where((positions < last_in_norm)[None, :], scores, NEG_INF))

    init = (jnp.full((gp,), NEG_INF, jnp.float32), jnp.zeros((gp,), jnp.float32))
    m, total = lax.fori_loop(0, count, score_span, init)
    m_ref[...] = m
    t_ref[...] = total


def _merge_kernel(*refs, st: LayerStatic, bottom: bool, zero_unmerged: bool):
    """One split's merged candidates folded into a partial state `(m, S, U)`: at the
    bottom every valid candidate, scored here; above it those not kept (`key < tau`),
    from the scores `_scores_kernel` stored (padding rows read as 0)."""
    if bottom:
        q_ref, par_ref, n_ref, k_ref, v_ref, cos_ref, sin_ref, m_ref, s_ref, u_ref = refs
        gp = q_ref.shape[0]
        q_lo, q_hi = _query_halves(q_ref)
    else:
        sc_ref, par_ref, n_ref, keys_ref, tau_ref, v_ref, m_ref, s_ref, u_ref = refs
        gp = sc_ref.shape[0]
        tau = tau_ref[0]
        real_rows = jnp.broadcast_to((jnp.arange(gp, dtype=jnp.int32) < st.group)[:, None], (gp, st.span))
    precision, operands = merge_score_precision(st), st.merge_operands
    n = n_ref[0]
    start, count = _split_spans(n, st)
    span = st.span

    def merge_span(j, carry):
        p0 = start + j * span
        if bottom:
            scores, merged, _, nodes = _span_scores(p0, q_lo, q_hi, par_ref, k_ref, cos_ref, sin_ref, n, st,
                                                    precision, operands)
        else:
            _, valid, nodes = candidate_nodes(par_ref, p0, span, n, st.r)
            scores = plgpu.load(sc_ref.at[:, pl.ds(j * span, span)], mask=real_rows, other=0.0)
            merged = valid & (keys_ref[pl.ds(j * span, span)] < tau)
        values = _values(v_ref, nodes)
        if zero_unmerged:
            # A weight of 0 times a NaN value is still NaN (SPEC 10): where a query may
            # precede appended tokens, the values it does not merge are zeroed. Only then:
            # the select puts the tile through registers before the product (H200: +12 us
            # a decode step).
            values = [jnp.where(merged[:, None], x, 0) for x in values]
        return _fold(carry, jnp.where(merged[None, :], scores, NEG_INF), values, precision, operands)

    pieces = feature_pieces(v_ref.shape[-1])
    init = (jnp.full((gp,), NEG_INF, jnp.float32), jnp.zeros((gp,), jnp.float32),
            tuple(jnp.zeros((gp, size), jnp.float32) for _, size in pieces))
    m, total, acc = lax.fori_loop(0, count, merge_span, init)
    m_ref[...] = m
    s_ref[...] = total
    for (a, size), u in zip(pieces, acc):
        u_ref[:, pl.ds(a, size)] = u


def _specs(gp: int, Mp: int, st: LayerStatic, layer_n: int, K: int | None = None, V: int | None = None,
           heads_per_layer_head: int = 1):
    """BlockSpecs of a grid `(B, Q, H_kv, splits)`; those of the keys, queries and RoPE
    tables need `K`, those of the values and states `V`. `heads_per_layer_head > 1`:
    the grid's kv heads are virtual, that many per kv head of the layers
    (`forward.split_heads`), which are read in place, not repeated."""
    per = heads_per_layer_head
    W = st.tile
    query = lambda *tail: pl.BlockSpec((None, None, None) + tail, lambda b, i, h, s: (b, i, h) + (0,) * len(tail))
    split = lambda *tail: pl.BlockSpec((None, None, None) + tail[:-1] + (W,),
                                       lambda b, i, h, s: (b, i, h) + (0,) * (len(tail) - 1) + (s,))
    partial = lambda *tail: pl.BlockSpec((None, None, None, None) + tail,
                                         lambda b, i, h, s: (b, i, h, s) + (0,) * len(tail))
    layer = lambda D: pl.BlockSpec((None, layer_n, None, D), lambda b, i, h, s: (b, 0, h // per, 0))
    specs = dict(parents=query(Mp // st.r), n=query(1), tau=query(1), keys=split(Mp), scores=split(gp, Mp),
                 vec=partial(gp))
    if K is not None:
        specs.update(q=query(gp, K), k=layer(K), table=pl.BlockSpec((Mp, K // 2), lambda b, i, h, s: (0, 0)))
    if V is not None:
        specs.update(v=layer(V), mat=partial(gp, V))
    return specs


def _partial_shapes(B, Q, H_kv, splits, gp, V=None):
    vec = jax.ShapeDtypeStruct((B, Q, H_kv, splits, gp), jnp.float32)
    return [vec, vec] if V is None else [vec, vec, jax.ShapeDtypeStruct((B, Q, H_kv, splits, gp, V), jnp.float32)]


@functools.partial(jax.jit, static_argnames=("st", "interpret"))
def decode_scores_pallas(q, parents, n, layer_k, cos, sin, st: LayerStatic, interpret: bool = False):
    """`(scores [B, Q, H_kv, Gp, Mp], m, total [B, Q, H_kv, splits, Gp])` of a selecting
    layer: the stored scores and each split's running max / sum over R."""
    B, Q, H_kv, gp, K = q.shape
    Mp = cos.shape[0]
    splits = Mp // st.tile
    sp = _specs(gp, Mp, st, layer_k.shape[1], K=K, heads_per_layer_head=H_kv // layer_k.shape[2])
    return pl.pallas_call(
        functools.partial(_scores_kernel, st=st),
        grid=(B, Q, H_kv, splits),
        in_specs=[sp["q"], sp["parents"], sp["n"], sp["k"], sp["table"], sp["table"]],
        out_specs=[sp["scores"], sp["vec"], sp["vec"]],
        out_shape=[jax.ShapeDtypeStruct((B, Q, H_kv, gp, Mp), jnp.float32)] + _partial_shapes(B, Q, H_kv, splits, gp),
        compiler_params=compiler_params(st.num_warps, 1),
        interpret=interpret,
    )(q, parents, n, layer_k, cos, sin)


@functools.partial(jax.jit, static_argnames=("st", "interpret", "zero_unmerged"))
def decode_merge_pallas(q_or_scores, parents, n, keys, tau, layer_k, layer_v, cos, sin, st: LayerStatic,
                        interpret: bool = False, zero_unmerged: bool = True):
    """Partial states `(m, S [B, Q, H_kv, splits, Gp], U [..., Gp, V])` of a layer's
    merged candidates. Bottom layer (`keys=None`): `q_or_scores` is the queries
    `[B, Q, H_kv, Gp, K]` and every valid candidate merges; above it, the scores from
    `decode_scores_pallas` and the candidates with `keys < tau` merge."""
    bottom = keys is None
    B, Q, H_kv, gp = q_or_scores.shape[:4]
    V, Mp = layer_v.shape[-1], parents.shape[-1] * st.r
    splits = Mp // st.tile
    sp = _specs(gp, Mp, st, layer_v.shape[1], K=layer_k.shape[-1] if bottom else None, V=V,
                heads_per_layer_head=H_kv // layer_v.shape[2])
    if bottom:
        in_specs = [sp["q"], sp["parents"], sp["n"], sp["k"], sp["v"], sp["table"], sp["table"]]
        args = (q_or_scores, parents, n, layer_k, layer_v, cos, sin)
    else:
        in_specs = [sp["scores"], sp["parents"], sp["n"], sp["keys"], sp["tau"], sp["v"]]
        args = (q_or_scores, parents, n, keys, tau, layer_v)
    return tuple(pl.pallas_call(
        functools.partial(_merge_kernel, st=st, bottom=bottom, zero_unmerged=zero_unmerged),
        grid=(B, Q, H_kv, splits),
        in_specs=in_specs,
        out_specs=[sp["vec"], sp["vec"], sp["mat"]],
        out_shape=_partial_shapes(B, Q, H_kv, splits, gp, V),
        compiler_params=compiler_params(st.num_warps, 1),
        interpret=interpret,
    )(*args))


def combine_max_sum(m, total):
    """Per-split running `(max, sum of exp)` `[..., splits, rows]` -> the rows' `(max, sum)`."""
    m_all = jnp.max(m, axis=-2)
    m_safe = jnp.where(m_all == NEG_INF, 0.0, m_all)
    return m_all, jnp.sum(total * jnp.exp(m - m_safe[..., None, :]), axis=-2)


def fold_partials(state, partials):
    """The running state `(m, S [..., rows], U [..., rows, V])` with a layer's per-split
    partial states (`[..., splits, rows(, V)]`) folded in (SPEC 2.4: one softmax)."""
    m, S, U = state
    pm, pS, pU = partials
    m_new = jnp.maximum(m, jnp.max(pm, axis=-2))
    m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
    decay = jnp.exp(m - m_safe)
    w = jnp.exp(pm - m_safe[..., None, :])  # [..., splits, rows]; 0 for empty splits
    S = S * decay + jnp.sum(pS * w, axis=-2)
    U = U * decay[..., None] + jnp.sum(pU * w[..., None], axis=-3)
    return m_new, S, U


def candidate_layout(config: HTreeConfig, block_sizes: DecodeBlockSizes):
    """`(span, Mp)`: candidates per score product (>= 16, a dot's least, and >= r) and
    the candidate buffer's padded width (`M`, or the span where `M` is smaller)."""
    M = config.max_candidates
    span = max(16, config.compression_rate, min(next_power_of_two(block_sizes.span), M))
    return span, max(M, span)


def decode_statics(config: HTreeConfig, dtype, K: int, G: int, Q: int, B: int, H_kv: int,
                   block_sizes: DecodeBlockSizes):
    """`(LayerStatic, Mp)`: the span, the split width (`tile`) and the score precision
    (those of the full-sequence forward for the cache dtype)."""
    r = config.compression_rate
    span, Mp = candidate_layout(config, block_sizes)
    want = max(1, block_sizes.target_programs // max(1, B * Q * H_kv))
    splits = min(next_power_of_two(want), Mp // span)
    precisions = Precisions.for_dtype(dtype)
    return LayerStatic(
        r=r, tile=Mp // splits, span=span, group=G, alpha=config.score_scale(K), importance=config.importance,
        strict_causal=config.strict_causal, log_n=config.log_n, top_k=config.top_k,
        precision=precisions.scores, merge_precision=precisions.merge,
        importance_operands=precisions.importance_operands, merge_operands=precisions.merge_operands,
        num_warps=block_sizes.num_warps,
    ), Mp


def _walk(q, t, keys, values, config: HTreeConfig, st: LayerStatic, Mp: int, cos, sin, interpret: bool,
          zero_unmerged: bool = True):
    """All layers, top down, for queries `q [B, Q, H_kv, Gp, K]` at positions `t [B, Q]`
    (each batch row its own). Returns `(o [B, Q, H_kv, Gp, V] float32, selections)`."""
    r, L = config.compression_rate, len(keys)
    B, Q, H_kv, gp, _ = q.shape
    V = values[0].shape[-1]
    P = Mp // r
    split = H_kv // keys[0].shape[2]  # virtual kv heads per kv head of the cache
    parents = jnp.broadcast_to(top_layer_parents(t[:, :, None], r, L, P), (B, Q, H_kv, P))
    t = t[:, :, None, None]
    state = (jnp.full((B, Q, H_kv, gp), NEG_INF, jnp.float32), jnp.zeros((B, Q, H_kv, gp), jnp.float32),
             jnp.zeros((B, Q, H_kv, gp, V), jnp.float32))
    real_head = jnp.arange(B * Q * H_kv * gp, dtype=jnp.int32) % gp < st.group  # rows flattened
    selections = []
    for l in reversed(range(L)):
        n = candidate_count(num_parents(parents), t, r, l).astype(jnp.int32)
        if l == 0:
            partials = decode_merge_pallas(q, parents, n, None, None, keys[0], values[0], cos, sin, st, interpret,
                                           zero_unmerged)
        else:
            scores, m, total = decode_scores_pallas(q, parents, n, keys[l], cos, sin, st, interpret)
            m, total = combine_max_sum(m, total)
            shift = importance_shift(m.reshape(-1), total.reshape(-1), real_head, gp, st.importance)
            packed = group_keys_from_scores(scores, shift.reshape(m.shape), n, st, split)
            next_parents, tau = select_top_k_pallas(packed, real_heads(parents, split), real_heads(n, split), st,
                                                    interpret)
            packed, next_parents, tau = (virtual_heads(x, split) for x in (packed, next_parents, tau))
            partials = decode_merge_pallas(scores, parents, n, packed, tau, None, values[l], cos, sin, st, interpret,
                                           zero_unmerged)
            parents = next_parents[..., :P]
            selections.append(real_heads(parents[..., : config.top_k], split))
        state = fold_partials(state, partials)
    _, S, U = state
    return U / S[..., None], selections


def query_chunk(config: HTreeConfig, B: int, S: int, H_kv: int, gp: int, Mp: int, block_sizes: DecodeBlockSizes):
    """Query positions per launch: the stored scores and packed keys of a chunk
    (`B * Qc * H_kv * Mp * (4 * Gp + 12)` bytes) within the budget."""
    per_query = B * H_kv * Mp * (4 * gp + 12)
    return int(max(1, min(S, block_sizes.chunk_budget_bytes // per_query)))


@functools.partial(jax.jit, static_argnames=("config", "block_sizes", "interpret", "zero_unmerged"))
def attend_cache_pallas(q, keys, values, positions, config: HTreeConfig,
                        block_sizes: DecodeBlockSizes = DecodeBlockSizes(), interpret: bool = False,
                        zero_unmerged: bool = True):
    """htree attention of queries `q [B, S, H, K]` (un-rotated) at token positions
    `positions [S]`, or `[B, S]` per batch row (int32, may be traced; each row's
    candidates and work from its own positions), over a decode cache's tree: `keys`, `values`
    the per-layer `[B, N_l, H_kv, K]`, `[B, N_l, H_kv, V]` (bottom first, un-rotated).
    The twin of `htree_jax.reference.attend_tree(..., keys_rotated=False)`: returns
    `(o [B, S, H, V] in q.dtype, selections)`, selections top first, `[B, S, H_kv,
    top_k]`. Dims as `check_pallas_decode_dims` allows (checked by the caller).
    `zero_unmerged=False` skips zeroing the values a query does not merge, which only
    matters (SPEC 10: a NaN value times a weight of 0) where the cache holds tokens
    after a query: safe only when every query is the newest token, as in a one-token
    decode step."""
    B, S, H, K = q.shape
    H_kv, V = keys[0].shape[2], values[0].shape[-1]
    split = head_split(H // H_kv)  # larger groups: virtual kv heads of 16, the cache read in place
    H_kv, G = H_kv * split, H // (H_kv * split)
    gp = next_power_of_two(G, 16)
    C = query_chunk(config, B, S, H_kv, gp, candidate_layout(config, block_sizes)[1], block_sizes)
    st, Mp = decode_statics(config, keys[0].dtype, K, G, C, B, H_kv, block_sizes)
    cos, sin = (jnp.asarray(a) for a in rope_table(Mp, K, float(config.rope_base), config.partial_rope(K)))
    num_chunks = -(-S // C)
    q5 = pad_axis(q.reshape(B, S, H_kv, G, K).astype(jnp.float32), 3, gp)
    q5 = pad_axis(q5, 1, num_chunks * C)
    positions = jnp.broadcast_to(positions, (B, S))
    padded = jnp.concatenate([positions, jnp.broadcast_to(positions[:, -1:], (B, num_chunks * C - S))], axis=1)

    def chunk(i):
        qc = lax.dynamic_slice_in_dim(q5, i * C, C, axis=1)
        t = lax.dynamic_slice_in_dim(padded, i * C, C, axis=1)
        return _walk(qc, t, keys, values, config, st, Mp, cos, sin, interpret, zero_unmerged)

    o, sels = lax.map(chunk, jnp.arange(num_chunks, dtype=jnp.int32))
    # o: [chunks, B, C, H_kv, Gp, V] -> [B, S, H, V]
    o = jnp.moveaxis(o, 0, 1).reshape(B, num_chunks * C, H_kv, gp, V)[:, :S, :, :G]
    sels = [jnp.moveaxis(s, 0, 1).reshape(B, num_chunks * C, H_kv // split, -1)[:, :S] for s in sels]
    return o.reshape(B, S, H, V).astype(q.dtype), sels


__all__ = ["DecodeBlockSizes", "attend_cache_pallas", "check_pallas_decode_dims", "decode_merge_pallas",
           "decode_scores_pallas", "fold_partials"]
