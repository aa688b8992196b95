"""Per-layer htree kernels (SPEC 2): candidate scores, importance keys, shared top-K and
the online-softmax merge, one program per `(b, t, h_kv)`, looping over tiles of the
candidate buffer. Each has a pure-JAX twin below with the same contract. A layer that
selects stores its candidates' scores in the importance pass and merges from them
(`merge_scored_pallas`); the bottom layer scores its keys in the merge (`merge_pallas`).

Layouts (all padded by the wrapper in `pallas_kernels/forward.py`):
  q        `[B, Q, H_kv, Gp, Kp]`   un-rotated, halves padded apart (`pad_rope_halves`)
  parents  `[B, Q/BQ, H_kv, P]` int32  ascending, `-1` padded; `P * r = Mp`; one row per
           block of BQ queries that share them (the forward uses BQ = 1 below the
           top layer; the top layer has its own kernels, `top_layer.py`)
  n        `[B, Q/BQ, H_kv, 1]` int32  valid candidates (SPEC 2.1)
  tau      `[B, Q, H_kv, 1]` int32  smallest kept key per query
  k_phases `[B, H_kv, (span/r)*N, Kp]` the layer's keys in `span/r` rotated copies
           (`rotate_phases`), in the dtype of the products that read them
  layer_v  `[B, H_kv, N, Vp]` stored dtype
  cos, sin `[Mp, Kp/2]` float32     RoPE at candidate positions (exactly rounded)
  keys     `[B, Q, H_kv, Mp]` int32 packed importance, `-1` where invalid
  state    m, S `[B, Q, H_kv, Gp]`, U `[B, Q, H_kv, Gp, Vp]` float32
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from htree_jax.rope import apply_rope
from pallas_kernels.common import compiler_params
from pallas_kernels.top_k import compaction_targets, kth_largest_key

FORCED_IMPORTANCE = 1e6
NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class LayerStatic:
    """Everything static about one layer launch."""

    r: int
    tile: int  # candidates per inner step: a multiple of `span`
    group: int  # real heads per group G (rows >= G are padding)
    alpha: float
    importance: str
    strict_causal: bool
    log_n: int
    top_k: int
    precision: lax.Precision | None
    num_warps: int = 4
    num_stages: int = 2
    # Candidates per score product below the top layer, all scored with one rotation of
    # the query (`rotate_phases`): a power of two, a multiple of r, >= 16 (a dot's least).
    span: int = 16
    # Operand dtype of the importance dots: None (float32 at `precision`), `BF16X3`
    # (float32-grade from bfloat16 pairs) or a dtype name.
    importance_operands: str | None = None
    # Queries per program. Per-query kernels: they must share parents and n; the top
    # layer's kernels (`top_layer.py`): each query has its own n.
    block_queries: int = 1
    # Score dots of the merge passes. Their scores only weigh values in the output
    # softmax (selection is decided by the keys kernel), so bf16/f16 inputs need
    # only output precision here. None: same as `precision`.
    merge_precision: lax.Precision | None = None
    # Warps of the merge kernels (None: num_warps). With 16 rows and 64 keys per
    # product, 2 warps ran a bottom merge fastest (H200 probe: 338 ms vs 407 at 4).
    merge_num_warps: int | None = None
    # Operand dtype of the merge dots ("bfloat16"/"float16", float32 accumulation), as
    # flash attention does for such inputs; None: float32 operands at merge_precision.
    merge_operands: str | None = None


def _tf32_split(x):
    """`x = hi + lo` with `hi` exact in TF32 (low 13 mantissa bits cleared)."""
    hi = lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.int32) & jnp.int32(-8192), jnp.float32)
    return hi, x - hi


# `operands` value for float32-grade products on bfloat16 tensor cores: each float32
# operand is split into `hi + lo`, both bfloat16 (16 significant bits together), and
# hi*hi + hi*lo + lo*hi accumulate in float32: ~1e-5 relative, at bf16 tensor-core rate
# and half the bytes of a (hi, lo) float32 pair.
BF16X3 = "bf16x3"


def _bf16_split(x):
    """`x = hi + lo` (float32 `x`), both bfloat16: ~2^-17 relative. `hi` is `x` rounded to
    8 significant bits on its bit pattern (exact in bfloat16), not by a round trip
    through bfloat16, which the GPU compiler folded away (then `lo = 0`: H200, 0.69 of
    parent lists agreed, as with plain bfloat16)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    hi = lax.bitcast_convert_type((bits + jnp.int32(0x8000)) & jnp.int32(-65536), jnp.float32)
    return hi.astype(jnp.bfloat16), (x - hi).astype(jnp.bfloat16)


def split_rows(a, precision, operands=None):
    """The left operand of `dot_rows`, prepared once (hoisted out of loops where it is
    loop-invariant): split `hi + lo` for 3xTF32 or `BF16X3`, or cast to the `operands`
    dtype."""
    if operands == BF16X3:
        return _bf16_split(a.astype(jnp.float32))
    if operands is not None:
        return (a.astype(operands), None)
    return _tf32_split(a) if precision == lax.Precision.HIGH else (a, None)


def key_parts(precision, operands=None) -> int:
    """How many arrays `key_operands` gives: 2 for 3xTF32 or `BF16X3` (`hi`, `lo`), else 1."""
    return 2 if operands == BF16X3 or (operands is None and precision == lax.Precision.HIGH) else 1


def key_operands(keys, precision, operands=None, split: bool = True) -> tuple:
    """The right operand of `dot_rows` as the kernels read it, prepared once in memory:
    `(hi, lo)` float32 for 3xTF32, `(keys in the operands dtype,)`, or `(float32,)`.
    A loaded tile then goes into the product as it is: any arithmetic on it in the
    kernel (a split, a cast, a rotation) puts it through registers and a layout change
    before every product, which cost more than the load in the per-query kernels (H200:
    below the top, pre-split keys). `split=False` leaves the 3xTF32 split to the kernel:
    the top layer's importance pass, bound by its products, not its loads, ran faster
    that way (199 vs 215-260 ms at T=131072)."""
    keys = keys.astype(jnp.float32)
    if operands == BF16X3:
        return _bf16_split(keys)
    if operands is not None:
        return (keys.astype(operands),)
    return _tf32_split(keys) if precision == lax.Precision.HIGH and split else (keys,)


def dot_rows(a_parts, b_parts, precision, operands=None):
    """`a [m, k] @ b[n, k].T` in float32, `a` prepared by `split_rows`, `b` a tuple of
    tiles loaded from `key_operands` arrays (`operands`: both in that dtype, float32
    accumulation).

    `Precision.HIGH` is done here as 3xTF32 (hi*hi + hi*lo + lo*hi): ~1e-6 relative
    error on TF32 tensor cores. Pallas-Triton runs HIGH as plain TF32 (~5e-4), which is
    as coarse as the 10-bit buckets of the packed importance and flipped 7-16% of the
    selections at T=32768 on an H200; HIGHEST (exact float32) ran 7x slower.
    """
    dims = (((1,), (1,)), ((), ()))
    if operands == BF16X3:
        (a_hi, a_lo) = a_parts
        b_hi, b_lo = b_parts if len(b_parts) == 2 else _bf16_split(b_parts[0].astype(jnp.float32))
        bf16 = lambda x, y: lax.dot_general(x, y, dims, preferred_element_type=jnp.float32)
        return bf16(a_hi, b_hi) + (bf16(a_hi, b_lo) + bf16(a_lo, b_hi))
    if operands is not None:
        return lax.dot_general(a_parts[0], b_parts[0].astype(operands), dims, preferred_element_type=jnp.float32)
    if precision == lax.Precision.HIGH:
        (a_hi, a_lo) = a_parts
        b_hi, b_lo = b_parts if len(b_parts) == 2 else _tf32_split(b_parts[0].astype(jnp.float32))
        tf32 = lambda x, y: lax.dot_general(x, y, dims, preferred_element_type=jnp.float32,
                                            precision=lax.Precision.DEFAULT)
        return tf32(a_hi, b_hi) + (tf32(a_hi, b_lo) + tf32(a_lo, b_hi))
    return lax.dot_general(a_parts[0], b_parts[0].astype(jnp.float32), dims, preferred_element_type=jnp.float32,
                           precision=precision)


def _dot_t(a, b_parts, precision, operands=None):
    """`dot_rows` with `a` prepared on the spot."""
    return dot_rows(split_rows(a, precision, operands), b_parts, precision, operands)


def phase_versions(st: LayerStatic) -> int:
    """How many rotated copies of a layer's keys the kernels read: `span / r`."""
    return st.span // st.r


def rotate_phases(layer_k, cos, sin, st: LayerStatic):
    """The layer's keys in `span / r` rotated copies, `[B, H_kv, (span/r) * N, Kp]`
    float32 (the kernels read them through `key_operands`): row `m*N + j` is
    `rope(K[j], m*r + j mod r)`.

    Candidate position `p = s*r + c` (slot `s`, child `c`) of a product over the span
    `[p0, p0 + span)` (`p0` a multiple of the span) reads copy `m = (p - p0) / r`, so
    each key arrives rotated by `p - p0`, and one rotation of the query, by
    `n - 1 - p0`, serves the whole span (SPEC 2.2 is relative:
    `<rope(q, n-1), rope(K, p)> = <rope(q, n-1-p0), rope(K, p - p0)>`). The copies cost
    `span / r` times the layer's keys in memory and save a query rotation per slot,
    which in Pallas-Triton costs more than the gathers (H200 probe: bottom merge at
    T=131072 498 ms with a rotation per slot, 338 ms with one per 64 keys)."""
    versions = phase_versions(st)
    N = layer_k.shape[2]
    child = jnp.arange(N) % st.r
    angle = (jnp.arange(versions)[:, None] * st.r + child[None, :]).reshape(-1)
    tiled = jnp.tile(layer_k.astype(jnp.float32), (1, 1, versions, 1))
    return apply_rope(tiled, cos[angle], sin[angle])


def rotate_half(q):
    """`[x_lo, x_hi] -> [-x_hi, x_lo]`: with it, RoPE at angle table row `a` is
    `q * [cos_a, cos_a] + rotate_half(q) * [sin_a, sin_a]`, full-width, no halves."""
    half = q.shape[-1] // 2
    return jnp.concatenate([-q[..., half:], q[..., :half]], axis=-1)


def full_width(table):
    """`[Mp, Kp/2]` angle table -> `[Mp, Kp]`, both halves the same."""
    return jnp.concatenate([table, table], axis=-1)


def candidate_nodes(par_ref, p0, width: int, n, r: int):
    """Candidate positions `[p0, p0 + width)` (`p0` a multiple of `r`): `(positions,
    valid, nodes)`, position `p = s*r + c` holding node `parents[s]*r + c`, node 0 where
    invalid (a safe row to gather)."""
    parents = par_ref[pl.ds(p0 // r, width // r)]
    positions = p0 + jnp.arange(width, dtype=jnp.int32)
    valid = positions < n
    child = jnp.arange(r, dtype=jnp.int32)
    nodes = jnp.where(valid, (parents[:, None] * r + child[None, :]).reshape(width), 0)
    return positions, valid, nodes


def _unit_scores(p0, q_parts, par_ref, k_refs, cf_ref, sf_ref, n, st: LayerStatic, precision, operands=None):
    """Scores of the candidate positions `[p0, p0 + span)`: `(scores [rows, span],
    valid, positions, nodes)`, `p0` a multiple of the span.

    Position `p = s*r + c` holds node `parents[s]*r + c`; `k_refs` (`key_operands`)
    hold the layer's keys in `span / r` rotated copies (`rotate_phases`), so every key
    row goes from memory straight into the product, already rotated by `p - p0`, and
    the query is rotated once, by `n - 1 - p0`.
    """
    r, span = st.r, st.span
    versions = span // r
    N = k_refs[0].shape[0] // versions
    q, q_half = q_parts  # [rows, Kp] float32: the query and rotate_half(query)
    positions, valid, nodes = candidate_nodes(par_ref, p0, span, n, r)
    copy = (jnp.arange(span, dtype=jnp.int32) // r) * N
    keys = tuple(k_ref[nodes + copy, :] for k_ref in k_refs)
    angle = jnp.maximum(n - 1 - p0, 0)  # an invalid span: any row, masked later
    c, s = cf_ref[pl.ds(angle, 1), :], sf_ref[pl.ds(angle, 1), :]
    scores = _dot_t(q * c + q_half * s, keys, precision, operands)
    return st.alpha * scores, valid, positions, nodes


def _tile_units(i, q_parts, par_ref, k_refs, cf_ref, sf_ref, n, st: LayerStatic, precision, operands=None):
    """`_unit_scores` of every span of candidate tile `i` (unrolled: their loads are
    issued together)."""
    return [_unit_scores(i * st.tile + u * st.span, q_parts, par_ref, k_refs, cf_ref, sf_ref, n, st, precision,
                         operands)
            for u in range(st.tile // st.span)]


def _query_rows(q_ref, qh_ref):
    bq, gp, kp = q_ref.shape
    return (q_ref[...].astype(jnp.float32).reshape(bq * gp, kp), qh_ref[...].astype(jnp.float32).reshape(bq * gp, kp))


def _online_max_sum(m, total, scores):
    """Fold `scores [R, tile]` (-inf where excluded) into a running max and sum."""
    m_new = jnp.maximum(m, jnp.max(scores, axis=1))
    m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
    total = total * jnp.exp(m - m_safe) + jnp.sum(jnp.exp(scores - m_safe[:, None]), axis=1)
    return m_new, total


def importance_shift(m, total, real_head, group_rows: int, importance: str):
    """Per row, what the importance subtracts from scores (SPEC 2.3): the row's LSE over
    R (`softmax`), or the max over the real heads of its query's group (`shared_max`);
    0 where R is empty. `m, total [rows]` from `_online_max_sum`, rows grouped by query
    in blocks of `group_rows`."""
    if importance == "softmax":
        return jnp.where(total > 0, m + jnp.log(jnp.where(total > 0, total, 1.0)), 0.0)
    queries = m.shape[0] // group_rows
    group_max = jnp.max(jnp.where(real_head, m, NEG_INF).reshape(queries, group_rows), axis=1)
    shift = jnp.broadcast_to(group_max[:, None], (queries, group_rows)).reshape(m.shape[0])
    return jnp.where(shift == NEG_INF, 0.0, shift)


def fold_merged(carry, blocks, score_precision, operands):
    """Online-softmax merge (SPEC 2.4) of score blocks into `(m, S, U)` `[rows]`,
    `[rows]`, `[rows, Vp]`: `blocks` is a list of `(scores [rows, n], values [n, Vp])`,
    scores `-inf` where not merged; they fold as one step (one rescale)."""
    m, total, acc = carry
    m_new = m
    for s_m, _ in blocks:
        m_new = jnp.maximum(m_new, jnp.max(s_m, axis=1))
    m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
    decay = jnp.exp(m - m_safe)
    total, acc = total * decay, acc * decay[:, None]
    for s_m, values in blocks:
        w = jnp.exp(s_m - m_safe[:, None])
        total = total + jnp.sum(w, axis=1)
        acc = acc + _weighted_values(w, values, score_precision, operands)
    return m_new, total, acc


def read_state(m_ref, s_ref, u_ref):
    """The incoming `(m, S, U)` of a block, rows flattened."""
    vp = u_ref.shape[-1]
    rows = m_ref.shape[0] * m_ref.shape[1]
    return m_ref[...].reshape(rows), s_ref[...].reshape(rows), u_ref[...].reshape(rows, vp)


def write_merged(state, out_refs, bottom: bool):
    """The bottom layer writes the normalised output (`out_refs = (o_ref,)`, or `(o_ref,
    lse_ref)`), the others the state `(m_out, s_out, u_out)` (`[BQ, G]`, `[BQ, G]`,
    `[BQ, G, Vp]`)."""
    m, total, acc = state
    if bottom:
        o_ref, *lse_ref = out_refs
        o_ref[...] = (acc / total[:, None]).reshape(o_ref.shape).astype(o_ref.dtype)
        if lse_ref:  # the log-sum-exp of each row's merged scores, for the backward
            lse_ref[0][...] = (m + jnp.log(total)).reshape(lse_ref[0].shape)
    else:
        m_out, s_out, u_out = out_refs
        m_out[...] = m.reshape(m_out.shape)
        s_out[...] = total.reshape(s_out.shape)
        u_out[...] = acc.reshape(u_out.shape)


def _pack(imp, positions, st: LayerStatic):
    """Packed keys (SPEC 2.3): importance bits, low `log_n` bits replaced by `~p`."""
    mask = (1 << st.log_n) - 1
    return (lax.bitcast_convert_type(imp, jnp.int32) & ~mask) | (mask - positions[None, :])


def _write_tiles(keys_ref, num_tiles, write_keys, st: LayerStatic):
    """Runs `write_keys` over the first `num_tiles` tiles and marks the rest invalid."""

    def write_invalid(i, carry):
        keys_ref[:, pl.ds(i * st.tile, st.tile)] = jnp.full((keys_ref.shape[0], st.tile), -1, jnp.int32)
        return carry

    # Loops that only store carry nothing (a constant carry does not lower to Triton).
    lax.fori_loop(0, num_tiles, write_keys, ())
    lax.fori_loop(num_tiles, keys_ref.shape[1] // st.tile, write_invalid, ())


def _scores_kernel(q_ref, qh_ref, par_ref, n_ref, *refs, st: LayerStatic):
    """One pass over the candidates: their scores, stored (`[BQ, Gp, Mp]`, only the
    real heads' rows of the first `ceil(n / tile)` tiles written), and each row's
    importance shift. Storing
    them (G floats per candidate) costs far less than gathering and scoring the keys
    again (a key row is K values, in two parts), which a second pass would."""
    *k_refs, cf_ref, sf_ref, s_ref, shift_ref = refs
    bq, gp, _ = q_ref.shape
    rows = bq * gp
    n = n_ref[0]
    q_parts = _query_rows(q_ref, qh_ref)
    num_tiles = (n + st.tile - 1) // st.tile
    real_head = jnp.arange(rows, dtype=jnp.int32) % gp < st.group
    # R, the normaliser set: valid positions, less the rightmost one when strict.
    last_in_norm = n - 1 if st.strict_causal else n

    # Only the real heads' rows are stored: the padding rows are never read.
    store_rows = jnp.broadcast_to((jnp.arange(gp, dtype=jnp.int32) < st.group)[None, :, None], (bq, gp, st.span))

    def score_tile(i, carry):
        units = _tile_units(i, q_parts, par_ref, k_refs, cf_ref, sf_ref, n, st, st.precision, st.importance_operands)
        for u, (scores, _, positions, _) in enumerate(units):
            plgpu.store(s_ref.at[:, :, pl.ds(i * st.tile + u * st.span, st.span)], scores.reshape(bq, gp, st.span),
                        mask=store_rows)
            in_norm = positions < last_in_norm
            carry = _online_max_sum(*carry, jnp.where(in_norm[None, :], scores, NEG_INF))
        return carry

    init = (jnp.full((rows,), NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32))
    m, total = lax.fori_loop(0, num_tiles, score_tile, init)
    shift_ref[...] = importance_shift(m, total, real_head, gp, st.importance).reshape(shift_ref.shape)


def keys_from_scores(scores, shift, n, st: LayerStatic):
    """Packed importance keys `[B, Q, H_kv, Mp]` (SPEC 2.3) from stored scores `[B, Q,
    H_kv, Gp, Mp]` (read only where valid) and the rows' shifts `[B, Q, H_kv, Gp]`, per
    query `n [B, Q, H_kv, 1]`: one fused XLA pass over the scores."""
    # Only the real heads' rows were stored.
    scores, shift = scores[..., : st.group, :], shift[..., : st.group]
    Mp = scores.shape[-1]
    positions = jnp.arange(Mp, dtype=jnp.int32)
    valid = positions < n  # [B, Q, H_kv, Mp]
    weights = jnp.where(valid[..., None, :], jnp.exp(scores - shift[..., None]), 0.0)
    imp = jnp.sum(weights, axis=-2)
    has_norm = (n - 1 if st.strict_causal else n) > 0
    imp = jnp.where(has_norm, imp, 0.0)
    imp = jnp.where(positions == n - 1, FORCED_IMPORTANCE, imp)
    return jnp.where(valid, _pack(imp, positions, st), -1)


def _select_kernel(keys_ref, par_ref, n_ref, next_ref, tau_ref, *, st: LayerStatic):
    """Shared top-K of one query: the kept nodes (ascending, the next layer's parents)
    and `tau`, the smallest kept key (kept <=> valid and key >= tau)."""
    keys = keys_ref[...]
    kept = jnp.minimum(st.top_k, n_ref[0])
    tau = kth_largest_key(keys, kept)
    selected = keys >= tau
    positions = jnp.arange(keys.shape[0], dtype=jnp.int32)
    nodes = par_ref[positions // st.r] * st.r + positions % st.r
    # Ascending positions give ascending nodes.
    next_ref[compaction_targets(selected, kept)] = jnp.where(selected, nodes, -1)
    tau_ref[...] = jnp.full((1,), tau, jnp.int32)


def _weighted_values(w, values, score_precision, operands):
    """`w [R, tile] @ values [tile, Vp]` in float32. Values only need the output's
    precision: TF32 unless exact float32 is asked for, or `operands` (bf16/f16) dots."""
    dims = (((1,), (0,)), ((), ()))
    if operands is not None:
        return lax.dot_general(w.astype(operands), values.astype(operands), dims, preferred_element_type=jnp.float32)
    precision = lax.Precision.HIGHEST if score_precision == lax.Precision.HIGHEST else lax.Precision.DEFAULT
    return lax.dot_general(w, values.astype(jnp.float32), dims, preferred_element_type=jnp.float32,
                           precision=precision)


def merge_score_precision(st: LayerStatic):
    return st.precision if st.merge_precision is None else st.merge_precision


def layer_refs(refs, leading: int, st: LayerStatic, bottom: bool):
    """Splits a merge-shaped kernel's refs: `(leading refs, keys_ref, tau_ref, k_refs,
    rest)`; `keys_ref, tau_ref` are None at the bottom (every valid candidate merges),
    `k_refs` the merge keys' `key_operands` parts."""
    head, refs = refs[:leading], refs[leading:]
    keys_ref = tau_ref = None
    if not bottom:
        (keys_ref, tau_ref), refs = refs[:2], refs[2:]
    parts = key_parts(merge_score_precision(st), st.merge_operands)
    return head, keys_ref, tau_ref, refs[:parts], refs[parts:]


def _merge_kernel(*refs, st: LayerStatic, bottom: bool):
    """Online-softmax merge of the candidates not kept (all of them at the bottom)."""
    score_precision, operands = merge_score_precision(st), st.merge_operands
    (q_ref, qh_ref, par_ref, n_ref), keys_ref, tau_ref, k_refs, rest = layer_refs(refs, 4, st, bottom)
    v_ref, cf_ref, sf_ref, m_ref, s_ref, u_ref, *out_refs = rest
    bq, gp, _ = q_ref.shape
    rows = bq * gp
    n = n_ref[0]
    q_parts = _query_rows(q_ref, qh_ref)
    unit = st.span
    num_tiles = (n + st.tile - 1) // st.tile
    if not bottom:
        tau = tau_ref[...]  # [BQ, 1]

    def merge_tile(i, carry):
        blocks = []
        units = _tile_units(i, q_parts, par_ref, k_refs, cf_ref, sf_ref, n, st, score_precision, operands)
        for u, (scores, valid, _, nodes) in enumerate(units):
            if bottom:
                merged = jnp.broadcast_to(valid[None, :], (rows, unit))
            else:
                kept = keys_ref[:, pl.ds(i * st.tile + u * unit, unit)] >= tau  # [BQ, unit]
                merged_q = valid[None, :] & ~kept
                merged = jnp.broadcast_to(merged_q[:, None, :], (bq, gp, unit)).reshape(rows, unit)
            blocks.append((jnp.where(merged, scores, NEG_INF), v_ref[nodes, :]))
        return fold_merged(carry, blocks, score_precision, operands)

    state = lax.fori_loop(0, num_tiles, merge_tile, read_state(m_ref, s_ref, u_ref))
    write_merged(state, out_refs, bottom)


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
        _, valid, nodes = candidate_nodes(par_ref, p0, st.tile, n, st.r)
        scores = plgpu.load(scores_ref.at[:, :, pl.ds(p0, st.tile)], mask=real_rows, other=0.0)
        kept = keys_ref[:, pl.ds(p0, st.tile)] >= tau  # [BQ, tile]
        merged = jnp.broadcast_to((valid[None, :] & ~kept)[:, None, :], (bq, gp, st.tile)).reshape(rows, st.tile)
        block = (jnp.where(merged, scores.reshape(rows, st.tile), NEG_INF), v_ref[nodes, :])
        return fold_merged(carry, [block], merge_score_precision(st), st.merge_operands)

    num_tiles = (n + st.tile - 1) // st.tile
    state = lax.fori_loop(0, num_tiles, merge_tile, read_state(m_ref, s_ref, u_ref))
    write_merged(state, out_refs, bottom=False)


def per_head_spec(x):
    """A whole `[B, H_kv, rows, D]` array, one `(b, h)` slice per program of a grid
    `(B, Q / BQ, H_kv)` (a layer's keys or values, a gradient accumulator)."""
    return pl.BlockSpec((None, None) + x.shape[2:], lambda b, i, h: (b, h, 0, 0))


def _block_specs(st: LayerStatic, gp: int, kp: int, Mp: int, parents, k_phases: tuple, layer_v):
    """BlockSpecs for a grid `(B, Q / BQ, H_kv)`: per-query arrays in blocks of BQ
    queries (`gp` rows, `kp` wide queries, `Mp` candidates), per-block arrays (parents,
    n: one row per block), whole layers and tables."""
    bq = st.block_queries
    queries = lambda *tail: pl.BlockSpec((None, bq, None) + tail, lambda b, i, h: (b, i, h) + (0,) * len(tail))
    block = lambda *tail: pl.BlockSpec((None, None, None) + tail, lambda b, i, h: (b, i, h) + (0,) * len(tail))
    table = pl.BlockSpec((Mp, kp), lambda b, i, h: (0, 0))  # full_width
    specs = dict(q=queries(gp, kp), parents=block(parents.shape[-1]), n=block(1), keys=queries(Mp),
                 tau=queries(1), k=[per_head_spec(x) for x in k_phases], table=table, vec=queries(gp),
                 scores=queries(gp, Mp))
    if layer_v is not None:
        specs.update(v=per_head_spec(layer_v), mat=queries(gp, layer_v.shape[-1]))
    return specs


def _full_width_inputs(q, cos, sin):
    """What the kernels read instead of `q, cos, sin`: `q, rotate_half(q)` and the
    full-width tables (`[Mp, Kp]`)."""
    return (q, rotate_half(q)), (full_width(cos), full_width(sin))


def check_key_parts(k_parts, expected: tuple):
    """`k_parts` must be what `key_operands` gives: a tuple of one of the `expected` lengths."""
    if not isinstance(k_parts, tuple) or len(k_parts) not in expected:
        raise TypeError(f"keys must be a tuple of {' or '.join(map(str, expected))} array(s) from key_operands, "
                        f"got {type(k_parts).__name__}")


def _params(st: LayerStatic, warps=None):
    warps = st.num_warps if warps is None else warps
    warps = warps if st.block_queries == 1 else max(warps, 8)
    return compiler_params(warps, st.num_stages)


@functools.partial(jax.jit, static_argnames=("st", "interpret", "return_scores"))
def importance_keys_pallas(q, parents, n, k_phases, cos, sin, st: LayerStatic, interpret=False,
                           return_scores=False):
    """Packed importance keys `[B, Q, H_kv, Mp]` int32 of every candidate position: the
    scores kernel, then `keys_from_scores`. With `return_scores`, `(keys, scores)`:
    the scores `[B, Q, H_kv, Gp, Mp]` float32 (scaled by alpha; only the real heads'
    rows of the valid tiles are written) for `merge_scored_pallas`.

    `q [B, Q, H_kv, Gp, Kp]`; `parents [B, Q/BQ, H_kv, P]` and `n [B, Q/BQ, H_kv, 1]`
    one row per block of `BQ = st.block_queries` queries that share them; `k_phases` the
    layer's keys from `rotate_phases`, as `key_operands(..., st.precision,
    st.importance_operands)`. Holds `B * Q * H_kv * Gp * Mp` float32 scores meanwhile.
    """
    check_key_parts(k_phases, (key_parts(st.precision, st.importance_operands),))
    B, Q, H_kv, gp = q.shape[:4]
    Mp = cos.shape[0]
    sp = _block_specs(st, gp, q.shape[-1], Mp, parents, k_phases, None)
    queries, tables = _full_width_inputs(q, cos, sin)
    scores, shift = pl.pallas_call(
        functools.partial(_scores_kernel, st=st),
        grid=(B, Q // st.block_queries, H_kv),
        in_specs=[sp["q"], sp["q"], sp["parents"], sp["n"], *sp["k"], sp["table"], sp["table"]],
        out_specs=[sp["scores"], sp["vec"]],
        out_shape=[jax.ShapeDtypeStruct((B, Q, H_kv, gp, Mp), jnp.float32),
                   jax.ShapeDtypeStruct((B, Q, H_kv, gp), jnp.float32)],
        compiler_params=_params(st),
        interpret=interpret,
    )(*queries, parents, n, *k_phases, *tables)
    keys = keys_from_scores(scores, shift, _per_query(n, st), st)
    return (keys, scores) if return_scores else keys


@functools.partial(jax.jit, static_argnames=("st", "interpret"))
def select_top_k_layer_pallas(keys, parents, n, st: LayerStatic, interpret=False):
    """Per query: `(next_parents [B, Q, H_kv, Mp], tau [B, Q, H_kv, 1])`, the kept nodes
    ascending in the first `min(top_k, n)` slots and `-1` after. `parents, n` per query."""
    B, Q, H_kv, Mp = keys.shape
    spec = lambda w: pl.BlockSpec((None, None, None, w), lambda b, i, h: (b, i, h, 0))
    return pl.pallas_call(
        functools.partial(_select_kernel, st=st),
        grid=(B, Q, H_kv),
        in_specs=[spec(Mp), spec(parents.shape[-1]), spec(1)],
        out_specs=[spec(Mp), spec(1)],
        out_shape=[jax.ShapeDtypeStruct((B, Q, H_kv, Mp), jnp.int32),
                   jax.ShapeDtypeStruct((B, Q, H_kv, 1), jnp.int32)],
        compiler_params=compiler_params(st.num_warps, 1),
        interpret=interpret,
    )(keys, parents, n)


def merge_outputs(specs, shape, bottom: bool, out_dtype, return_lse: bool = False):
    """`(out_specs, out_shape)` of a merge launch: the normalised output `[B, Q, H_kv,
    rows, Vp]` at the bottom (and its rows' log-sum-exp, float32, with `return_lse`),
    else the float32 state `(m, S, U)`."""
    vec = jax.ShapeDtypeStruct(shape[:-1], jnp.float32)
    if bottom:
        o = jax.ShapeDtypeStruct(shape, out_dtype)
        return ([specs["mat"], specs["vec"]], [o, vec]) if return_lse else (specs["mat"], o)
    return [specs["vec"], specs["vec"], specs["mat"]], [vec, vec, jax.ShapeDtypeStruct(shape, jnp.float32)]


@functools.partial(jax.jit, static_argnames=("st", "interpret", "out_dtype", "return_lse"))
def merge_pallas(q, parents, n, keys, tau, k_phases, layer_v, cos, sin, state, st: LayerStatic,
                 interpret=False, out_dtype=jnp.float32, return_lse=False):
    """Upper layer (`keys`, `tau` given): the state after merging the candidates not
    kept. Bottom layer (`keys=None`): the normalised output `[B, Q, H_kv, Gp, Vp]`
    (with `return_lse`, `(o, lse [B, Q, H_kv, Gp])`).
    `parents, n` one row per block of `st.block_queries` queries, as for the keys;
    `k_phases` as `key_operands(rotate_phases(...), merge precision, st.merge_operands)`."""
    check_key_parts(k_phases, (key_parts(merge_score_precision(st), st.merge_operands),))
    B, Q, H_kv, gp, _ = q.shape
    vp = layer_v.shape[-1]
    sp = _block_specs(st, gp, q.shape[-1], cos.shape[0], parents, k_phases, layer_v)
    bottom = keys is None
    queries, tables = _full_width_inputs(q, cos, sin)
    in_specs = [sp["q"], sp["q"], sp["parents"], sp["n"]] + ([] if bottom else [sp["keys"], sp["tau"]])
    in_specs += [*sp["k"], sp["v"], sp["table"], sp["table"], sp["vec"], sp["vec"], sp["mat"]]
    args = queries + (parents, n) + (() if bottom else (keys, tau)) + tuple(k_phases) + (layer_v,) + tables + tuple(state)
    out_specs, out_shape = merge_outputs(sp, (B, Q, H_kv, gp, vp), bottom, out_dtype, return_lse)
    out = pl.pallas_call(
        functools.partial(_merge_kernel, st=st, bottom=bottom),
        grid=(B, Q // st.block_queries, H_kv),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_params(st, st.merge_num_warps),
        interpret=interpret,
    )(*args)
    return out if bottom else tuple(out)


@functools.partial(jax.jit, static_argnames=("st", "interpret"))
def merge_scored_pallas(scores, parents, n, keys, tau, layer_v, state, st: LayerStatic, interpret=False):
    """Upper layer: the state after merging the candidates not kept, with the `scores`
    stored by `importance_keys_pallas(..., return_scores=True)` (which then need no
    keys here). `parents, n` one row per block of `st.block_queries` queries."""
    B, Q, H_kv, gp, Mp = scores.shape
    vp = layer_v.shape[-1]
    if Mp % st.tile or st.tile % st.r:
        raise ValueError(f"candidate width {Mp} must be a multiple of the tile {st.tile}, itself of r={st.r}")
    sp = _block_specs(st, gp, 1, Mp, parents, (), layer_v)
    out_specs, out_shape = merge_outputs(sp, (B, Q, H_kv, gp, vp), False, jnp.float32)
    return tuple(pl.pallas_call(
        functools.partial(_merge_scored_kernel, st=st),
        grid=(B, Q // st.block_queries, H_kv),
        in_specs=[sp["scores"], sp["parents"], sp["n"], sp["keys"], sp["tau"], sp["v"], sp["vec"], sp["vec"],
                  sp["mat"]],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_params(st, st.merge_num_warps),
        interpret=interpret,
    )(scores, parents, n, keys, tau, layer_v, *state))


# ---------------------------------------------------------------------------------------
# Pure-JAX twins: the same contracts, written with the reference's building blocks.


def _gather(layer, idx):
    """`layer [B, H_kv, N, D]`, `idx [B, Q, H_kv, M]` -> `[B, Q, H_kv, M, D]`."""
    per_head = jax.vmap(lambda lh, ih: lh[ih], in_axes=(0, 1), out_axes=1)
    return jax.vmap(per_head)(layer, idx)


def _per_query(x, st: LayerStatic):
    """Block-level rows (parents, n) repeated for each query of the block."""
    return jnp.repeat(x, st.block_queries, axis=1)


def _twin_scores(q, parents, n, layer_k, cos, sin, st: LayerStatic):
    """`[B, Q, H_kv, Gp, Mp]` scores, valid `[B, Q, H_kv, Mp]`, nodes, positions."""
    from htree_jax.rope import apply_rope

    parents, n = _per_query(parents, st), _per_query(n, st)
    Mp = cos.shape[0]
    positions = jnp.arange(Mp, dtype=jnp.int32)
    nodes = parents[..., positions // st.r] * st.r + positions % st.r
    valid = positions < n
    gathered = _gather(layer_k, jnp.where(valid, nodes, 0)).astype(jnp.float32)
    k_rot = apply_rope(gathered, cos, sin)
    qpos = n - 1  # [B, Q, H_kv, 1]
    q_rot = apply_rope(q.astype(jnp.float32), cos[qpos], sin[qpos])
    scores = st.alpha * jnp.einsum("bqhgk,bqhmk->bqhgm", q_rot, k_rot, precision=lax.Precision.HIGHEST)
    return scores, valid, nodes, positions, n


def importance_keys_twin(q, parents, n, layer_k, cos, sin, st: LayerStatic):
    from htree_jax.reference import importance, pack_importance

    B, Q, H_kv, gp, _ = q.shape
    scores, valid, _, positions, n = _twin_scores(q, parents, n, layer_k, cos, sin, st)
    flat = lambda x: x.reshape((B * Q * H_kv,) + x.shape[3:])
    rightmost = positions == n - 1
    in_norm = valid & ~rightmost if st.strict_causal else valid
    imp = importance(flat(scores)[:, : st.group], flat(in_norm), st.importance)
    imp = jnp.where(flat(rightmost), FORCED_IMPORTANCE, imp)
    keys = jnp.where(flat(valid), pack_importance(imp, positions[None], st.log_n), -1)
    return keys.reshape(B, Q, H_kv, -1)


def select_top_k_layer_twin(keys, parents, n, st: LayerStatic):
    """Twin of `select_top_k_layer_pallas` (`parents, n` per query) with `lax.top_k`."""
    Mp = keys.shape[-1]
    positions = jnp.arange(Mp, dtype=jnp.int32)
    nodes = parents[..., positions // st.r] * st.r + positions % st.r
    kept = jnp.minimum(st.top_k, n)
    top, _ = lax.top_k(keys, Mp)
    tau = jnp.take_along_axis(top, kept - 1, axis=-1)
    order = jnp.sort(jnp.where(keys >= tau, positions, Mp), axis=-1)
    next_parents = jnp.where(order < Mp, jnp.take_along_axis(nodes, jnp.minimum(order, Mp - 1), -1), -1)
    return next_parents, tau


def merge_twin(q, parents, n, keys, tau, layer_k, layer_v, cos, sin, state, st: LayerStatic,
               out_dtype=jnp.float32):
    """Twin of `merge_pallas`, written with the reference's `merge`."""
    from htree_jax.reference import merge

    B, Q, H_kv, gp, _ = q.shape
    scores, valid, nodes, _, _ = _twin_scores(q, parents, n, layer_k, cos, sin, st)
    flat = lambda x: x.reshape((B * Q * H_kv,) + x.shape[3:])
    merged = valid if keys is None else valid & (keys < tau)
    values = _gather(layer_v, jnp.where(valid, nodes, 0)).astype(jnp.float32)
    m, S, U = merge(tuple(flat(x) for x in state), flat(scores), flat(values), flat(merged))
    if keys is None:
        return (U / S[..., None]).reshape(B, Q, H_kv, gp, -1).astype(out_dtype)
    shape = (B, Q, H_kv)
    return m.reshape(shape + (gp,)), S.reshape(shape + (gp,)), U.reshape(shape + U.shape[-2:])


def merge_scored_twin(scores, parents, n, keys, tau, layer_v, state, st: LayerStatic):
    """Twin of `merge_scored_pallas`: the reference's `merge` on the given scores (rows
    past the real heads as 0, as the kernel reads them)."""
    from htree_jax.reference import merge

    B, Q, H_kv, gp, Mp = scores.shape
    parents, n = _per_query(parents, st), _per_query(n, st)
    positions = jnp.arange(Mp, dtype=jnp.int32)
    nodes = parents[..., positions // st.r] * st.r + positions % st.r
    valid = positions < n
    scores = jnp.where(jnp.arange(gp)[:, None] < st.group, scores, 0.0)
    flat = lambda x: x.reshape((B * Q * H_kv,) + x.shape[3:])
    values = _gather(layer_v, jnp.where(valid, nodes, 0)).astype(jnp.float32)
    m, S, U = merge(tuple(flat(x) for x in state), flat(scores), flat(values), flat(valid & (keys < tau)))
    shape = (B, Q, H_kv)
    return m.reshape(shape + (gp,)), S.reshape(shape + (gp,)), U.reshape(shape + U.shape[-2:])
