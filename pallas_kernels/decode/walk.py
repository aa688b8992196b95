"""The Pallas decode walk: a few new queries walk a decode cache's tree (SPEC 2). A
composition of the decode family's kernels (`decode/scores.py`'s `decode_scores_pallas`,
`decode/merge.py`'s `decode_merge_pallas`) and the shared top-K.

The full-sequence kernels (`shared/importance.py`, `gqa/merge.py`) read each layer's keys in `span / r`
rotated copies made for the whole layer (`rotate_phases`), which for a decode step would
be `O(T)` work per token. Here the keys are read as the cache stores them (`[B, N, H_kv,
K]`, un-rotated, the layout `htree_jax.cache.HTreeCache` keeps) and rotated in the
kernel after the gather: candidate position `p` of a product over `[p0, p0 + span)`
is rotated by `p - p0`, the query once by `n - 1 - p0` (SPEC 2.2 is relative), the
same arithmetic `rotate_phases` does ahead of time, so the scores are those of the
full-sequence kernels. Features that do not rotate (SPEC 7's partial RoPE: 512 of
latent attention's 576) are read and scored as stored, with no rotation
(`decode/scores.py`'s `half_pieces`): for 16-bit caches one exact product where a rotated piece
takes three (`BF16X3`).

Groups of more than 16 heads (latent attention's 64-128 over one latent key) run as
virtual kv heads of `DecodeBlockSizes.wide_rows` heads (64) that read the cache in
place: every gathered key row feeds 64 heads (the row count that makes a gathered tile
worth its bytes, `tools/probes/mla_sparse_feasibility.py`), and the whole group's
importance decides one selection per kv head.

A decode step has few queries (`B * H_kv` of them, 4 at `B = 1`), so each query's
candidate buffer is split over `splits` programs (grid `(B, Q, H_kv, splits)`), as
flash-decoding splits the keys, and the per-split partial results are combined in XLA
(with one split, the wide merges fold into the running state themselves, the bottom one
writing the output). The kernels of 16-bit caches run two pipeline stages where they
fit (`pipelined`: all three of the wide ones, the two merges of GQA's):

  per layer that selects (top down):
    `decode_scores_pallas` scores of the split's candidates, stored, and the split's
                       running (max, sum) over the normaliser set R; with
                       `selection="bound"` (SPEC 11) the bound scores too (the
                       cache's radii against the query rows' group norms, one more
                       product), which the (max, sum) and the keys rank by
    XLA                the rows' importance shift (from the splits' max and sum)
    `decode_keys_pallas` packed keys from the stored scores (groups over 16 heads;
                       GQA's in XLA, `group_keys_from_scores`)
    `select_top_k_pallas` (`shared/top_k.py`, the forward's): the kept nodes, `tau`
    `decode_merge_pallas` the split's merged candidates (stored scores, gathered values)
                       folded into a partial softmax state (m, S, U)
  bottom layer: `decode_merge_pallas` scoring its keys, every valid candidate merged
                       (values read from the keys: its key tiles are the values where
                       they can be, `decode/merge.py`'s `values_in_key_tiles`; FP8 tokens: each
                       gathered row widened, its score and weight times its scale);
  the partial states fold into the running one in XLA, and the output is U / S.

Layouts (the wrapper pads heads and candidates):
  q        `[B, Q, H_kv, Gp, K]`  as stored, un-rotated, `Gp = max(16, next_pow2(G))` rows
  parents  `[B, Q, H_kv, Mp / r]` int32 ascending, `-1` padded
  n        `[B, Q, H_kv, 1]` int32 valid candidates (SPEC 2.1)
  layer    keys `[B, N, H_kv, K]`, values `[B, N, H_kv, V]` (the cache's, any N)
  scales   `[B, H_kv, N_0]` float32, FP8 tokens' row scales (layer 0 in e4m3)
  cos, sin `[Mp, K/2]` float32  RoPE at `0 .. Mp - 1` (exactly rounded)
  scores   `[B, Q, H_kv, Gp, Mp]` float32 (real heads' rows of valid spans written)
  partial  m, S `[B, Q, H_kv, splits, Gp]`, U `[B, Q, H_kv, splits, Gp, V]` float32
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from htree_jax.core.bounds import group_count, group_norms
from htree_jax.core.config import HTreeConfig
from htree_jax.core.indexing import candidate_count, num_parents, top_layer_parents
from htree_jax.core.rope import rope_table
from htree_jax.core.tree import CacheTree
from pallas_kernels.decode.merge import cache_value_pieces, decode_merge_pallas, values_in_key_tiles
from pallas_kernels.decode.scores import decode_keys_pallas, decode_scores_pallas
from pallas_kernels.shared import shared_memory
from pallas_kernels.shared.common import (
    Bound,
    KERNEL_GROUP,
    MAX_HEAD_DIM,
    MAX_VALUE_DIM,
    MIN_DIM,
    NEG_INF,
    LayerInputs,
    LayerStatic,
    check_group,
    next_power_of_two,
    pad_axis,
    real_heads,
    virtual_heads,
)
from pallas_kernels.shared.common import head_block
from pallas_kernels.shared.configs import DecodeBlockSizes
from pallas_kernels.shared.importance import group_keys_from_scores, importance_shift
from pallas_kernels.shared.precision import Precisions
from pallas_kernels.shared.shared_memory import program_shape
from pallas_kernels.shared.softmax import combine, combine_max_sum
from pallas_kernels.shared.top_k import select_top_k_pallas

# Keys are read in power-of-two pieces of each RoPE half (`importance.feature_pieces`:
# 288 = 256 + 32 for K = 576), values in pieces of V: K/2 and V multiples of 16 (a dot's least).
PIECE = 16


def check_pallas_decode_dims(head_dim: int, value_dim: int, group: int, latent_half: int | None = None) -> None:
    """The Pallas decode kernels' limits (checked before any launch). `latent_half`: the
    values are read from the keys, whose latent features lie in two runs of that many
    (one per RoPE half): values reaching into the second need the first a multiple of
    16 (a dot's least)."""
    if not MIN_DIM <= head_dim <= MAX_HEAD_DIM or head_dim % (2 * PIECE):
        raise ValueError(f"Pallas decoding supports head dim K in [{MIN_DIM}, {MAX_HEAD_DIM}], a multiple of "
                         f"{2 * PIECE}, got K = {head_dim}")
    if not MIN_DIM <= value_dim <= MAX_VALUE_DIM or value_dim % PIECE:
        raise ValueError(f"Pallas decoding supports value dim V in [{MIN_DIM}, {MAX_VALUE_DIM}], a multiple of "
                         f"{PIECE}, got V = {value_dim}")
    check_group(group, "Pallas decoding")
    if latent_half is not None and value_dim > latent_half and latent_half % PIECE:
        raise ValueError(f"Pallas decoding reads values from the keys in pieces of {PIECE}: with value_dim = "
                         f"{value_dim} > (K - rope_dim) / 2 = {latent_half}, (K - rope_dim) / 2 must be a multiple "
                         f"of {PIECE}")


def candidate_layout(config: HTreeConfig, block_sizes: DecodeBlockSizes):
    """`(span, Mp)`: candidates per score product (>= 16, a dot's least, and >= r) and
    the candidate buffer's padded width (`M`, or the span where `M` is smaller)."""
    M = config.max_candidates
    span = max(16, config.compression_rate, min(next_power_of_two(block_sizes.span), M))
    return span, max(M, span)


def decode_program(config: HTreeConfig, G: int, K: int, V: int, itemsize: int, block_sizes: DecodeBlockSizes):
    """`(rows, span)`: heads per program and candidates per score product. Groups of at
    most 16 heads: all of them (padded to 16 rows), `candidate_layout`'s span. Larger
    groups run as virtual kv heads of `head_block(G, wide_rows)` heads (the cache read in
    place), rows and span halved (`shared_memory.program_shape`) until the query rows and one
    span's keys and values fit a program (float32 at the MLA shape: 32 x 32), with the
    bound (SPEC 11) the query rows' group norms and one span's radii too (float32: 544
    groups at the MLA shape; bfloat16 takes 16 x 32)."""
    span, _ = candidate_layout(config, block_sizes)
    if G <= KERNEL_GROUP:
        return G, span
    R = config.partial_rope(K) or K
    rows = head_block(G, max(KERNEL_GROUP, block_sizes.wide_rows))
    return program_shape(rows, span, config.compression_rate, K - R, next_power_of_two(R // 2, 16), V, itemsize,
                         decode_bound_width(config, K))


def decode_bound_width(config: HTreeConfig, K: int) -> int:
    """The float32 feature groups the decode step's scores kernel holds per query row and
    gathers per candidate with `selection="bound"` (`group_count`); 0 with the mean."""
    return group_count(K, config.rope_dim) if config.ranks_by_bound else 0


class WalkStatics(NamedTuple):
    """The `LayerStatic`s of a walk's three kernels: they share everything but their
    pipeline stages and the bottom merge's span (`pipelined`)."""

    scores: LayerStatic  # `decode_scores_pallas` (and the top-K, which reads its warps)
    merge: LayerStatic  # `decode_merge_pallas` of the selecting layers (stored scores)
    bottom: LayerStatic  # `decode_merge_pallas` of the bottom layer (scoring its keys)


def pipelined(st: LayerStatic, K: int, V: int, itemsize: int, values_in_keys: bool,
              bound_width: int = 0) -> WalkStatics:
    """Two pipeline stages for the kernels of 16-bit caches where two steps' gathered
    tiles fit (`shared_memory.staged_tiles` within `WIDE_STAGED_BYTES`; the scores
    kernel's with the bound's `bound_width` radii), else one (float32 keeps one).

    Wide (`G > 16`): all three kernels; the bottom merge gathers keys and, unless the
    values are its key tiles (`decode_merge.values_in_key_tiles`), values: its span halves
    (not below 16 or r) until two steps fit. Two stages ran each of the MLA step's
    kernels faster than one (journal, 2026-11-25 (8)).

    GQA (`G <= 16`): the two merges, at their span (the scores kernel keeps one stage:
    at two the step ran slower); two stages ran the merges faster or the same (journal,
    2026-11-26 (3))."""
    if itemsize > 2:
        return WalkStatics(st, st, st)
    fits = lambda span, features, width=0: shared_memory.fits(
        shared_memory.staged_tiles(span, features, itemsize, width), 2, shared_memory.WIDE_STAGED_BYTES)
    two = lambda x, span: dataclasses.replace(x, num_stages=2, span=span)
    if st.group <= KERNEL_GROUP:
        merge = two(st, st.span) if fits(st.span, V) else st
        return WalkStatics(st, merge, two(st, st.span) if fits(st.span, K + V) else st)
    scores = two(st, st.span) if fits(st.span, K, bound_width) else st
    merge = two(st, st.span) if fits(st.span, V) else st
    per_candidate = K if values_in_keys else K + V
    span = st.span
    while not fits(span, per_candidate) and span // 2 >= max(16, st.r):
        span //= 2
    bottom = two(st, span) if fits(span, per_candidate) else st
    return WalkStatics(scores, merge, bottom)


def decode_statics(config: HTreeConfig, dtype, K: int, G: int, Q: int, B: int, H_kv: int, span: int,
                   block_sizes: DecodeBlockSizes):
    """`(LayerStatic, Mp)`: the span (`decode_program`'s), the split width (`tile`) and
    the score precision (those of the full-sequence forward for the cache dtype)."""
    r = config.compression_rate
    Mp = candidate_layout(config, block_sizes)[1]
    target = block_sizes.target_programs if G <= KERNEL_GROUP else block_sizes.wide_target_programs
    want = max(1, target // max(1, B * Q * H_kv))
    splits = min(next_power_of_two(want), Mp // span)
    precisions = Precisions.for_dtype(dtype)
    R = config.partial_rope(K)
    return LayerStatic(
        r=r, tile=Mp // splits, span=span, group=G, alpha=config.score_scale(K), importance=config.importance,
        strict_causal=config.strict_causal, log_n=config.log_n, top_k=config.top_k,
        precision=precisions.scores, merge_precision=precisions.merge,
        importance_operands=precisions.importance_operands, merge_operands=precisions.merge_operands,
        num_warps=block_sizes.num_warps if G <= KERNEL_GROUP else block_sizes.wide_num_warps,
        num_stages=1, latent_half=0 if R is None else (K - R) // 2,
    ), Mp


def kept_keys(parents, kept, r: int, Mp: int):
    """Packed keys `[..., Mp]` int32 that keep exactly the nodes `kept [..., W]` (an
    ascending `-1`-padded list, a subset of the candidates of `parents [..., P]`): 1 at
    each kept node's buffer position (SPEC 2.1: `slot(parent) * r + child`), 0
    elsewhere, so the merges' `key < tau` with `tau = 1` merges every other candidate
    (a selection made elsewhere: block selection's, SPEC 12)."""
    lead = parents.shape[:-1]
    # A kept node's parent slot: where its parent stands in the ascending list (the `-1`
    # padding read as past every node, so the list stays sorted).
    sorted_parents = jnp.where(parents < 0, jnp.iinfo(jnp.int32).max, parents).reshape(-1, parents.shape[-1])
    slot = jax.vmap(jnp.searchsorted)(sorted_parents, (kept // r).reshape(-1, kept.shape[-1])).reshape(kept.shape)
    position = slot.astype(jnp.int32) * r + kept % r
    rows = jnp.arange(int(np.prod(lead)), dtype=jnp.int32).reshape(lead + (1,))
    flat = jnp.where(kept >= 0, rows * Mp + position, rows.size * Mp).reshape(-1)
    keys = jnp.zeros((rows.size * Mp,), jnp.int32).at[flat].set(1, mode="drop")
    return keys.reshape(lead + (Mp,))


@dataclasses.dataclass(frozen=True)
class WalkSettings:
    """What a chunk's walk is compiled for: the function, the kernels' statics `sts`,
    the candidate buffer `Mp`, interpret mode and whether unmerged values are zeroed
    (`attend_cache_pallas`'s `zero_unmerged`)."""

    config: HTreeConfig
    sts: WalkStatics
    Mp: int
    interpret: bool = False
    zero_unmerged: bool = True


def _walk_layers(q, t, tree: CacheTree, walk: WalkSettings, tables, qn=None, chosen=()):
    """All layers, top down, for queries `q [B, Q, H_kv, Gp, K]` at positions `t [B, Q]`
    (each batch row its own) over the cache's `tree`, as `walk` says; `tables = (cos,
    sin) [Mp, K / 2]`. `selection="bound"`: `qn [B, Q, H_kv, Gp, n_groups]` the query
    rows' group norms, `tree.radii` the layers' from layer 1 up (SPEC 11).
    `walk.value_dim > 0`: `tree.values` is `()`, the values the keys' first `value_dim`
    latent features, read from the key layers. `tree.scales`: FP8 tokens' row scales
    (the bottom merge's). `chosen` (block selection, SPEC 12): the kept nodes of every
    layer above 0, top first, `[B, Q, H_kv / split, top_k]` (ascending, `-1` padded):
    the queries score and merge with their own rows but keep these nodes (no
    importance, no top-K; `qn` is not needed). Returns `(o [B, Q, H_kv, Gp, V] in q's
    dtype, selections)`."""
    keys, values, radii, scales, value_dim = tree.keys, tree.values, tree.radii, tree.scales, tree.value_dim
    config, sts, Mp, interpret, zero_unmerged = walk.config, walk.sts, walk.Mp, walk.interpret, walk.zero_unmerged
    cos, sin = tables
    r, L = config.compression_rate, len(keys)
    st = sts.scores
    B, Q, H_kv, gp, _ = q.shape
    K = keys[0].shape[-1]
    if value_dim:
        V, pieces = value_dim, cache_value_pieces(value_dim, K, st.latent_half)
        values = keys
    else:
        V = values[0].shape[-1]
        pieces = cache_value_pieces(V)
    P = Mp // r
    split = H_kv // keys[0].shape[2]  # virtual kv heads per kv head of the cache
    parents = jnp.broadcast_to(top_layer_parents(t[:, :, None], r, L, P), (B, Q, H_kv, P))
    t = t[:, :, None, None]
    real_head = jnp.arange(B * Q * H_kv * gp, dtype=jnp.int32) % gp < st.group  # rows flattened
    # The wide kernels (measured there) with one split fold into the running state
    # themselves, the bottom one writing the output; else per-split partial states
    # folded in XLA.
    wide = split > 1 or st.group > KERNEL_GROUP
    carried = wide and st.tile == Mp
    # The top layer's one split is the first state (no empty state made and read).
    state = None if carried else (jnp.full((B, Q, H_kv, gp), NEG_INF, jnp.float32),
                                  jnp.zeros((B, Q, H_kv, gp), jnp.float32), jnp.zeros((B, Q, H_kv, gp, V), jnp.float32))
    selections = []
    for l in reversed(range(L)):
        n = candidate_count(num_parents(parents), t, r, l).astype(jnp.int32)
        if l == 0:
            layer = LayerInputs(parents, n, None, None, keys[0], values[0], cos, sin)
            partials = decode_merge_pallas(q, layer, sts.bottom, interpret, zero_unmerged=zero_unmerged,
                                           value_pieces=pieces, values_from_keys=bool(value_dim),
                                           state=state if carried else None, scales=scales or None)
            if carried and state is not None:
                return partials, selections
        elif chosen:
            scores = decode_scores_pallas(q, parents, n, keys[l], cos, sin, st, interpret, None)[0]
            kept = pad_axis(chosen[L - 1 - l] + 1, 3, P) - 1  # `-1` padded to the walk's width
            packed = virtual_heads(kept_keys(real_heads(parents, split), kept, r, Mp), split)
            tau = jnp.ones(packed.shape[:-1] + (1,), jnp.int32)
            layer = LayerInputs(parents, n, packed, tau, None, values[l], cos, sin)
            partials = decode_merge_pallas(scores, layer, sts.merge, interpret, zero_unmerged=zero_unmerged,
                                           value_pieces=pieces, values_from_keys=bool(value_dim),
                                           state=state if carried else None)
            parents = virtual_heads(kept, split)
            selections.append(kept[..., : config.top_k])
        else:
            bound = None if qn is None else Bound(qn, radii[l - 1])
            scores, *ranked, m, total = decode_scores_pallas(q, parents, n, keys[l], cos, sin, st, interpret, bound)
            m, total = combine_max_sum(m, total)
            shift = importance_shift(m.reshape(-1), total.reshape(-1), real_head, gp, st.importance)
            ranking, shift = ranked[0] if ranked else scores, shift.reshape(m.shape)
            if wide:  # faster than XLA's fusion at the MLA shape (journal, 2026-11-25 (8))
                packed = decode_keys_pallas(ranking, shift, n, st, split, interpret)
            else:  # GQA: XLA's fusion, not measured against the kernel closely enough to swap
                packed = group_keys_from_scores(ranking, shift, n, st, split)
            next_parents, tau = select_top_k_pallas(packed, real_heads(parents, split), real_heads(n, split), st,
                                                    interpret)
            packed, next_parents, tau = (virtual_heads(x, split) for x in (packed, next_parents, tau))
            layer = LayerInputs(parents, n, packed, tau, None, values[l], cos, sin)
            partials = decode_merge_pallas(scores, layer, sts.merge, interpret, zero_unmerged=zero_unmerged,
                                           value_pieces=pieces, values_from_keys=bool(value_dim),
                                           state=state if carried else None)
            parents = next_parents[..., :P]
            selections.append(real_heads(parents[..., : config.top_k], split))
        if not carried:
            state = combine(state, partials)
        else:  # the new state, or the first one: a single split's partial state
            state = partials if state is not None else tuple(x.squeeze(3) for x in partials)
    _, S, U = state
    return (U / S[..., None]).astype(q.dtype), selections


def query_chunk(config: HTreeConfig, B: int, S: int, H_kv: int, gp: int, Mp: int, block_sizes: DecodeBlockSizes):
    """Query positions per launch: the stored scores and packed keys of a chunk
    (`B * Qc * H_kv * Mp * (4 * Gp + 12)` bytes) within the budget."""
    per_query = B * H_kv * Mp * (4 * gp + 12)
    return int(max(1, min(S, block_sizes.chunk_budget_bytes // per_query)))


@functools.partial(jax.jit, static_argnames=("config", "block_sizes", "interpret", "zero_unmerged"))
def attend_cache_pallas(q, tree: CacheTree, positions, config: HTreeConfig, *,
                        block_sizes: DecodeBlockSizes = DecodeBlockSizes(), interpret: bool = False,
                        zero_unmerged: bool = True, chosen=()):
    """htree attention of queries `q [B, S, H, K]` (un-rotated) at token positions
    `positions [S]`, or `[B, S]` per batch row (int32, may be traced; each row's
    candidates and work from its own positions), over a decode cache's `tree`
    (`CacheTree`: its keys, values, radii, FP8 scales and `value_dim`).
    The twin of `htree_jax.reference.attend_tree` (`TreeWalk(..., keys_rotated=False)`): returns
    `(o [B, S, H, V] in q.dtype, selections)`, selections top first, `[B, S, H_kv,
    top_k]`. Dims as `check_pallas_decode_dims` allows (checked by the caller).
    `zero_unmerged=False` skips zeroing the values a query does not merge, which only
    matters (SPEC 10: a NaN value times a weight of 0) where the cache holds tokens
    after a query: safe only when every query is the newest token, as in a one-token
    decode step. `selection="bound"` (SPEC 11) needs `tree.radii` (`q` then in
    `rope_layout` order, as the cache's keys). `tree.value_dim > 0`: the values are read
    from the key layers in place. FP8 tokens (`tree.scales`): the bottom merge widens
    each gathered row to q's dtype (exact) and scales its score and its weight. `chosen` (block selection, SPEC 12): every layer's kept nodes above
    0, top first, `[B, S, H_kv, top_k]` each (the selections a walk returned): the
    queries keep those instead of choosing (`_walk_layers`); they are returned as the
    selections. The statics are those of q's dtype."""
    keys, values, radii, value_dim = tree.keys, tree.values, tree.radii, tree.value_dim
    B, S, H, K = q.shape
    H_kv, V = keys[0].shape[2], value_dim or values[0].shape[-1]
    itemsize = jnp.dtype(q.dtype).itemsize  # FP8 tokens are widened to it in the kernel
    # Values read from the keys are gathered as a tile of their own (the same rows again):
    # a program holds the same bytes as with a value layer.
    rows, span = decode_program(config, H // H_kv, K, V, itemsize, block_sizes)
    split = H // (H_kv * rows) if rows < H // H_kv else 1  # virtual kv heads, the cache read in place
    H_kv, G = H_kv * split, H // (H_kv * split)
    gp = next_power_of_two(G, 16)
    C = query_chunk(config, B, S, H_kv, gp, candidate_layout(config, block_sizes)[1], block_sizes)
    st, Mp = decode_statics(config, q.dtype, K, G, C, B, H_kv, span, block_sizes)
    reuse = bool(value_dim) and values_in_key_tiles(cache_value_pieces(V, K, st.latent_half), K, st.latent_half)
    sts = pipelined(st, K, V, itemsize, reuse, decode_bound_width(config, K))
    cos, sin = (jnp.asarray(a) for a in rope_table(Mp, K, float(config.rope_base), config.partial_rope(K)))
    num_chunks = -(-S // C)
    per_query = lambda x: pad_axis(pad_axis(x.reshape((B, S, H_kv, G) + x.shape[3:]), 3, gp), 1, num_chunks * C)
    q5 = per_query(q)  # as stored: the kernels read the unrotated features so (`half_pieces`)
    qn = None
    if config.ranks_by_bound:
        if len(radii) != len(keys) - 1:
            raise ValueError(f"selection='bound' needs the radii of layers 1..{len(keys) - 1}, got {len(radii)}")
        qn = None if chosen else per_query(group_norms(q, config.rope_dim))
    # Padding queries repeat the last one (a valid position and selection).
    repeat_last = lambda x: jnp.concatenate([x, jnp.repeat(x[:, -1:], num_chunks * C - S, axis=1)], axis=1)
    padded = repeat_last(jnp.broadcast_to(positions, (B, S)))
    chosen = tuple(repeat_last(x) for x in chosen)
    tree = CacheTree(tuple(keys), tuple(values), tuple(radii), tuple(tree.scales), value_dim)
    walk = WalkSettings(config, sts, Mp, interpret, zero_unmerged)

    def chunk(i):
        rows = lambda x: lax.dynamic_slice_in_dim(x, i * C, C, axis=1)
        qn_c = None if qn is None else rows(qn)
        return _walk_layers(rows(q5), rows(padded), tree, walk, (cos, sin), qn_c, tuple(map(rows, chosen)))

    o, sels = lax.map(chunk, jnp.arange(num_chunks, dtype=jnp.int32))
    # o: [chunks, B, C, H_kv, Gp, V] -> [B, S, H, V]
    o = jnp.moveaxis(o, 0, 1).reshape(B, num_chunks * C, H_kv, gp, V)[:, :S, :, :G]
    sels = [jnp.moveaxis(s, 0, 1).reshape(B, num_chunks * C, H_kv // split, -1)[:, :S] for s in sels]
    return o.reshape(B, S, H, V).astype(q.dtype), sels


__all__ = ["DecodeBlockSizes", "attend_cache_pallas", "check_pallas_decode_dims"]
