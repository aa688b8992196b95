"""The Pallas forward pass: tree build, then per layer (top down) the importance-keys
kernel, the per-query top-K kernel and the merge kernel (the bottom layer: merge and
normalise only), over chunks of query positions. The top layer, where neighbouring
queries share every candidate, runs flash-attention-shaped kernels over blocks of
queries (`pallas_kernels/top_layer.py`); the layers below, where each query has its
own parents, one program per query (`pallas_kernels/layer_forward.py`).

Device memory beyond inputs, tree and output: the rotated copies of the tree's keys
(the top layer once in float32; each lower layer in `span / r` copies, `rotate_phases`,
as the merge dots read them, and the upper ones also as the importance dots read them
when that differs: two bfloat16 or float32 parts, `key_operands`); per chunk of `Qc` positions the packed keys and next-parent
buffers (`2 * B * Qc * H_kv * Mp` int32), the scores of a layer below the top that
selects (`B * Qc * H_kv * Gp * Mp` float32, `Gp = max(16, G)`, only when `L >= 3`),
the queries padded and rotated for the top layer (`B * Qc * H_kv * Gt * Kp` float32)
and the softmax state (`B * Qc * H * (V + 2)` float32); the selections
(`(L-1) * B*T*H_kv*top_k` int32).
`Qc` is chosen so that `Qc * Mp <= T * top_k` (so nothing is `O(T * M)`) and the
buffers stay under `chunk_budget_bytes`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from htree_jax.config import HTreeConfig
from htree_jax.reference import candidate_count as reference_candidate_count
from htree_jax.rope import rope_table
from pallas_kernels.common import next_power_of_two, pad_axis, pad_rope_halves
from pallas_kernels.layer_forward import (
    BF16X3,
    LayerStatic,
    importance_keys_pallas,
    key_operands,
    merge_pallas,
    merge_scored_pallas,
    merge_score_precision,
    rotate_phases,
    select_top_k_layer_pallas,
)
from pallas_kernels.top_layer import (
    pad_nodes,
    rotate_keys,
    rotate_queries,
    top_importance_keys_pallas,
    top_merge_pallas,
)
from pallas_kernels.tree_build import PoolBlockSizes, pool_layer_pallas

MIN_DIM, MAX_DIM, MAX_GROUP = 32, 256, 16


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    # Below the top layer: candidates per score product, all scored with one rotation
    # of the query (the layer's keys are kept in span/r rotated copies, at most 16;
    # raised to >= 16 and >= r), and candidates per inner step (a multiple of it).
    span: int = 64
    tile: int = 64
    # Top layer: rows (queries x heads) per program and candidates per step. All queries
    # share the top layer's candidates, so one key tile serves `top_rows` rows.
    top_rows: int = 128
    top_tile: int = 64
    top_num_warps: int = 8
    # The top layer's importance kernel (H200, T=131072, 3xTF32 split in the kernel:
    # tile 64 / 2 stages 199 ms; with keys split in memory, two tiles per step: tile 64 /
    # 2 stages out of shared memory, 64 / 1 stage 215 ms, 32 / 2 stages 260 ms).
    top_keys_tile: int = 64
    top_keys_stages: int = 2
    # Per-query kernels below the top (importance; merges). H200, T=131072, bf16 inputs:
    # importance (top_k=64, layer 1) 114 ms at 2 warps, 135 at 4, 217 at 8; the bottom
    # merge with span 64 at 2 warps (probe: 338 ms vs 407 at 4, 2506 at 1).
    num_warps: int = 2
    merge_num_warps: int = 2
    num_stages: int = 2
    # Merges above the bottom read the scores their importance pass stored
    # (`merge_scored_pallas`) instead of gathering and scoring the keys again; False is
    # the earlier path, kept to compare the two in `benchmarks/profile_forward.py`.
    merge_from_scores: bool = True
    scored_merge_num_warps: int = 4
    # Per-chunk buffers (see `chunk_size`). H200, T=131072, top_k=64: 2 GiB (18 chunks)
    # 167 ms end to end, 1 GiB (36 chunks) 171 ms.
    chunk_budget_bytes: int = 2 << 30


def check_pallas_dims(dims) -> None:
    """The Pallas backend's limits, checked before any launch."""
    if not MIN_DIM <= dims.head_dim <= MAX_DIM:
        raise ValueError(f"backend 'pallas' supports head dim K in [{MIN_DIM}, {MAX_DIM}], got K = {dims.head_dim}")
    if not MIN_DIM <= dims.value_dim <= MAX_DIM:
        raise ValueError(f"backend 'pallas' supports value dim V in [{MIN_DIM}, {MAX_DIM}], got V = {dims.value_dim}")
    if dims.group_size > MAX_GROUP:
        raise ValueError(
            f"backend 'pallas' supports GQA groups of at most {MAX_GROUP} query heads per kv head, "
            f"got H / H_kv = {dims.group_size}"
        )


def layout(config: HTreeConfig, block_sizes: BlockSizes):
    """`(span, tile, P, Mp)`: candidates per product and per step below the top layer,
    and the padded candidate-buffer geometry (`P` parent slots, `Mp = P * r` positions)."""
    r, M = config.compression_rate, config.max_candidates
    span = max(16, r, min(next_power_of_two(block_sizes.span), 16 * r, M))
    tile = max(span, min(next_power_of_two(block_sizes.tile), M))
    per_tile = tile // r
    P = -(-config.top_k // per_tile) * per_tile
    return span, tile, P, P * r


def chunk_size(config, block_sizes, B, T, H_kv, Mp, score_rows=0):
    """Query positions per chunk: the per-chunk buffers (packed keys and next parents,
    int32, and `score_rows` float32 scores per candidate where a layer below the top
    selects) within `chunk_budget_bytes`, and `Qc * Mp <= T * top_k`."""
    per_query = (8 + 4 * score_rows) * B * H_kv * Mp
    limit = max(1, min(block_sizes.chunk_budget_bytes // per_query, T // config.compression_rate, T))
    return int(limit)


def default_precision(dtype):
    """Score dots that decide selections: exact float32 for float32 inputs (they must
    match the reference to 1e-4); 3xTF32 (`HIGH`, see `layer_forward._dot_t`) for
    bfloat16/float16 inputs: scores to ~1e-6, 7x faster than exact dots on an H200."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.HIGH


def default_merge_precision(dtype):
    """Score dots of the merge passes, which only weigh values in the output: exact for
    float32 inputs, TF32 (~5e-4, below bfloat16's own 4e-3) for bfloat16/float16."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def default_importance_operands(dtype):
    """bfloat16/float16 inputs: the importance dots (which decide selections) in `BF16X3`,
    float32-grade (~4e-6 relative, against ~1e-6 for 3xTF32 and 4e-3 for plain bfloat16)
    at bfloat16 tensor-core rate, reading half the bytes of 3xTF32's split keys. H200,
    T=32768, against the float32 reference: parent lists identical 0.9988 (softmax) /
    0.9968 (shared_max), 0.9997 / 0.9994 with 3xTF32, 0.61 with plain bfloat16; at
    T=131072 the forward ran 465 ms vs 528 ms with 3xTF32. float32 inputs: None (the
    dots at `default_precision`, exact float32)."""
    return BF16X3 if jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) else None


def default_merge_operands(dtype):
    """bfloat16/float16 inputs: the merge dots take operands in the input dtype (the
    rotated query and keys and the softmax weights rounded to it, float32 accumulation),
    as flash attention does; the merges do not select, so this only touches the output,
    at the input dtype's own precision. float32 inputs: float32 operands."""
    return jnp.dtype(dtype).name if jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) else None


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["layers", "top_k_imp", "top_k_merge", "top_v", "cos", "sin", "q4"],
                   meta_fields=["st", "st_top", "st_top_keys", "parents_width", "chunk"])
@dataclasses.dataclass(frozen=True)
class Prepared:
    """Everything the per-layer launches share: padded tree, RoPE tables, queries."""

    # [(importance keys, merge keys, V_l [B, H_kv, N_l, Vp]), ...], bottom first, the top
    # layer left out. The keys: `key_operands` of `rotate_phases(K_l)` for the dots that
    # read them: the bottom layer only merges (no importance keys: None), the layers
    # above it merge from their stored scores (no merge keys: None).
    layers: list
    top_k_imp: tuple  # key_operands of the top layer's keys rotated by position, tile-padded
    top_k_merge: tuple  # the same for the merge dots (often the same arrays)
    top_v: jax.Array  # the top layer's values, tile-padded
    cos: jax.Array  # [Mp, Kp/2]
    sin: jax.Array
    q4: jax.Array  # [B, chunks * Qc, H_kv, G, Kp]; heads padded per chunk, per kernel
    st: LayerStatic  # the layers below the top: one query per program
    st_top: LayerStatic  # the top layer: `block_queries` queries per program
    st_top_keys: LayerStatic  # its importance kernel (its own tile and pipeline depth)
    parents_width: int  # P
    chunk: int  # Qc, a multiple of st_top.block_queries


def prepare(q, k, v, config: HTreeConfig, block_sizes: BlockSizes, interpret: bool, precision,
            merge_operands="auto", importance_operands="auto", for_backward: bool = False) -> Prepared:
    """The padded tree, keys as the products read them, tables and queries. With
    `for_backward`, every layer below the top keeps merge keys (the backward scores
    every merged candidate again)."""
    B, T, H, K = q.shape
    H_kv, V = k.shape[2], v.shape[-1]
    G = H // H_kv
    r = config.compression_rate
    kp, vp = next_power_of_two(K, 32), next_power_of_two(V, 16)
    half = kp // 2
    span, tile, P, Mp = layout(config, block_sizes)
    st = LayerStatic(
        r=r, tile=tile, span=span, group=G, alpha=config.score_scale(K), importance=config.importance,
        strict_causal=config.strict_causal, log_n=config.log_n, top_k=config.top_k,
        precision=default_precision(q.dtype) if precision is None else precision,
        merge_precision=default_merge_precision(q.dtype) if precision is None else precision,
        merge_operands=(default_merge_operands(q.dtype) if precision is None else None)
        if merge_operands == "auto" else merge_operands,
        importance_operands=(default_importance_operands(q.dtype) if precision is None else None)
        if importance_operands == "auto" else importance_operands,
        num_warps=block_sizes.num_warps, merge_num_warps=block_sizes.merge_num_warps,
        num_stages=block_sizes.num_stages,
    )
    layers = [(jnp.swapaxes(pad_rope_halves(k, half), 1, 2), jnp.swapaxes(pad_axis(v, -1, vp), 1, 2))]
    for _ in config.layer_sizes(T)[1:]:
        layers.append(tuple(pool_layer_pallas(x, r, PoolBlockSizes(), interpret) for x in layers[-1]))
    cos_np, sin_np = rope_table(Mp, K, float(config.rope_base))
    cos, sin = (pad_axis(jnp.asarray(a), -1, half) for a in (cos_np, sin_np))
    # Top layer: rows = queries x next_power_of_two(G) heads, at least 16 (a dot's minimum).
    gt = next_power_of_two(G)
    bq = max(1, next_power_of_two(block_sizes.top_rows) // gt, 16 // gt)
    top_tile = min(next_power_of_two(block_sizes.top_tile, 16), Mp)
    st_top = dataclasses.replace(st, block_queries=bq, tile=top_tile, num_warps=block_sizes.top_num_warps)
    st_top_keys = dataclasses.replace(st_top, tile=min(next_power_of_two(block_sizes.top_keys_tile, 16), top_tile),
                                      num_stages=block_sizes.top_keys_stages)
    top_v = pad_nodes(layers[-1][1], top_tile)
    # The keys as the products read them: rotated, then split for 3xTF32 or cast to the
    # operand dtype, once per layer (one array when both dots take the same operands).
    imp_spec = (st.precision, st.importance_operands)
    merge_spec = (merge_score_precision(st), st.merge_operands)

    top_rotated = rotate_keys(layers[-1][0], cos, sin, top_tile)
    top_k_merge = key_operands(top_rotated, *merge_spec)
    top_k_imp = key_operands(top_rotated, *imp_spec, split=False) if imp_spec != merge_spec else top_k_merge
    # Below the top: the keys in span/r rotated copies, for the importance products of
    # the layers that select (their merges reuse the stored scores) and for the bottom
    # layer's merge.
    merges_keys = lambda l: l == 0 or not block_sizes.merge_from_scores or for_backward
    lower = []
    for l, (kl, vl) in enumerate(layers[:-1]):
        phases = rotate_phases(kl, cos, sin, st)
        lower.append((key_operands(phases, *imp_spec) if l > 0 else None,
                      key_operands(phases, *merge_spec) if merges_keys(l) else None, vl))
    layers = lower
    # Layers below the top that select (L >= 3) store their scores per chunk.
    score_rows = next_power_of_two(G, 16) if len(config.layer_sizes(T)) >= 3 else 0
    Qc = -(-chunk_size(config, block_sizes, B, T, H_kv, Mp, score_rows) // bq) * bq
    q4 = pad_rope_halves(q.reshape(B, T, H_kv, G, K), half)
    q4 = pad_axis(q4, 1, -(-T // Qc) * Qc)
    return Prepared(layers, top_k_imp, top_k_merge, top_v, cos, sin, q4, st, st_top, st_top_keys, P, Qc)


def top_layer_parents(t, prep: Prepared, num_layers: int, shape):
    """Virtual parents of the top layer, `0 .. floor(i*_{L-1} / r)`, `-1` padded."""
    r = prep.st.r
    slot = jnp.arange(prep.parents_width, dtype=jnp.int32)
    return jnp.broadcast_to(jnp.where(slot <= t // r ** (num_layers - 1) // r, slot, -1), shape)


def chunk_queries(prep: Prepared, c, T: int, num_layers: int, interpret: bool):
    """Chunk `c`'s queries and top layer, shared by the forward and the backward:
    `(qc [B, Qc, H_kv, G, Kp], t [1, Qc, 1, 1], n_top, q_top, top)`. `n_top [B, Qc,
    H_kv, 1]`: the top layer's candidates are the nodes `[0, n)`, `n = i*_{L-1} + 1`
    (SPEC 2.1); `q_top` each query rotated by its `n - 1`, `Gt` rows. `top`: `(keys, tau,
    parents of the layer below)` from the top layer's importance keys and shared top-K,
    or `(None, None, None)` when the top layer is the bottom one (`L = 1`)."""
    st, Qc = prep.st, prep.chunk
    B, _, H_kv, G, _ = prep.q4.shape
    qc = lax.dynamic_slice_in_dim(prep.q4, c * Qc, Qc, axis=1)
    t = jnp.minimum(c * Qc + jnp.arange(Qc, dtype=jnp.int32), T - 1)[None, :, None, None]
    n_top = jnp.broadcast_to(t // st.r ** (num_layers - 1) + 1, (B, Qc, H_kv, 1))
    q_top = rotate_queries(pad_axis(qc, 3, next_power_of_two(G)), n_top, prep.cos, prep.sin)
    if num_layers == 1:
        return qc, t, n_top, q_top, (None, None, None)
    keys = top_importance_keys_pallas(q_top, n_top, prep.top_k_imp, prep.cos.shape[0], prep.st_top_keys, interpret)
    parents = top_layer_parents(t, prep, num_layers, (B, Qc, H_kv, prep.parents_width))
    next_parents, tau = select_top_k_layer_pallas(keys, parents, n_top, st, interpret)
    return qc, t, n_top, q_top, (keys, tau, next_parents[..., : prep.parents_width])


def candidate_count(parents, t, r: int, layer: int):
    """Valid candidates per query, `[B, Q, H_kv, 1]` int32 (the reference's rule)."""
    num_parents = jnp.sum(parents >= 0, axis=-1, keepdims=True)
    return reference_candidate_count(num_parents, t, r, layer).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "block_sizes", "interpret", "precision", "merge_operands",
                                             "importance_operands", "return_lse"))
def htree_forward_pallas(q, k, v, config: HTreeConfig, block_sizes: BlockSizes = BlockSizes(),
                         interpret: bool = False, precision=None, merge_operands="auto", importance_operands="auto",
                         return_lse: bool = False):
    """htree attention with Pallas kernels. Inputs validated by the caller.

    `precision` of the in-kernel score dots; `None` means `default_precision(q.dtype)`
    with `default_importance_operands` for the importance keys and
    `default_merge_precision` / `default_merge_operands` for the merges (an explicit
    `precision` sets float32 operands for both unless they are named).
    `merge_operands`: "auto", None (float32) or a dtype name; `importance_operands`:
    "auto", None (float32 at `precision`, 3xTF32 for `HIGH`), `BF16X3` or a dtype name.
    Returns `(o [B, T, H, V] in q.dtype, selections)` like the JAX reference; with
    `return_lse`, also the log-sum-exp of every row's merged scores `[B, T, H]` float32
    (what the backward needs besides `o`).
    """
    B, T, H, _ = q.shape
    H_kv, V = k.shape[2], v.shape[-1]
    G = H // H_kv
    prep = prepare(q, k, v, config, block_sizes, interpret, precision, merge_operands, importance_operands)
    st, st_top, Qc, P, L = prep.st, prep.st_top, prep.chunk, prep.parents_width, len(prep.layers) + 1
    num_chunks = prep.q4.shape[1] // Qc
    vp = prep.top_v.shape[-1]
    gt, gp = next_power_of_two(G), next_power_of_two(G, 16)

    def empty_state(rows):
        return (jnp.full((B, Qc, H_kv, rows), -jnp.inf, jnp.float32), jnp.zeros((B, Qc, H_kv, rows), jnp.float32),
                jnp.zeros((B, Qc, H_kv, rows, vp), jnp.float32))

    def chunk(c):
        qc, t, n_top, q_top, (keys, tau, parents) = chunk_queries(prep, c, T, L, interpret)
        if L == 1:
            o, lse = top_merge_pallas(q_top, n_top, None, None, prep.top_k_merge, prep.top_v, empty_state(gt),
                                      st_top, interpret, out_dtype=q.dtype, return_lse=True)
            return o[:, :, :, :G], lse[..., :G], []
        state = top_merge_pallas(q_top, n_top, keys, tau, prep.top_k_merge, prep.top_v, empty_state(gt), st_top,
                                 interpret)
        # The layers below: one query per program, its G heads padded to >= 16 rows.
        state = tuple(pad_axis(x, 3, gp) for x in state)
        selections = [parents[..., : config.top_k]]
        q_rows = pad_axis(qc, 3, gp)
        for l in reversed(range(L - 1)):
            kl, kl_rot, vl = prep.layers[l]
            n = candidate_count(parents, t, st.r, l)
            if l > 0:
                # The merge reads the scores the importance pass stored, not the keys.
                keys, scores = importance_keys_pallas(q_rows, parents, n, kl, prep.cos, prep.sin, st, interpret,
                                                      return_scores=True)
                next_parents, tau = select_top_k_layer_pallas(keys, parents, n, st, interpret)
                if block_sizes.merge_from_scores:
                    st_scored = dataclasses.replace(st, merge_num_warps=block_sizes.scored_merge_num_warps)
                    state = merge_scored_pallas(scores, parents, n, keys, tau, vl, state, st_scored, interpret)
                else:
                    state = merge_pallas(q_rows, parents, n, keys, tau, kl_rot, vl, prep.cos, prep.sin, state, st,
                                         interpret)
                parents = next_parents[..., :P]
                selections.append(parents[..., : config.top_k])
            else:
                o, lse = merge_pallas(q_rows, parents, n, None, None, kl_rot, vl, prep.cos, prep.sin, state, st,
                                      interpret, out_dtype=q.dtype, return_lse=True)
        return o[:, :, :, :G], lse[..., :G], selections

    o, lse, sels = lax.map(chunk, jnp.arange(num_chunks, dtype=jnp.int32))
    # o: [chunks, B, Qc, H_kv, G, vp] -> [B, T, H, V]
    o = jnp.moveaxis(o, 0, 1).reshape(B, num_chunks * Qc, H_kv, G, vp)[:, :T, :, :, :V]
    sels = [jnp.moveaxis(s, 0, 1).reshape(B, num_chunks * Qc, H_kv, -1)[:, :T] for s in sels]
    if return_lse:
        lse = jnp.moveaxis(lse, 0, 1).reshape(B, num_chunks * Qc, H_kv * G)[:, :T]
        return o.reshape(B, T, H, V), sels, lse
    return o.reshape(B, T, H, V), sels


__all__ = ["BlockSizes", "Prepared", "check_pallas_dims", "htree_forward_pallas", "prepare"]
