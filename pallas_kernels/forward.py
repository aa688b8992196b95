"""The Pallas forward pass: tree build, then per layer (top down) the importance-keys
kernel, the per-query top-K kernel and the merge kernel (the bottom layer: merge and
normalise only), over chunks of query positions. On the top layer, where neighbouring
queries share everything, each program serves a block of queries.

Device memory beyond inputs, tree and output: per chunk of `Qc` positions the packed
keys and next-parent buffers (`2 * B * Qc * H_kv * Mp` int32) and the softmax state
(`B * Qc * H * (V + 2)` float32), plus the selections (`(L-1) * B*T*H_kv*top_k` int32).
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
from pallas_kernels.layer_forward import LayerStatic, importance_keys_pallas, merge_pallas, select_top_k_layer_pallas
from pallas_kernels.tree_build import PoolBlockSizes, pool_layer_pallas

MIN_DIM, MAX_DIM, MAX_GROUP = 32, 256, 16


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    # Candidates per inner step (raised to >= 16 and >= r). H200 sweep, T=8192, top_k=512,
    # TF32 dots: tile 32 / 4 warps 27.8 ms; 64/4 28.0; 128/4 46.7; 16/4 40.4 (RESULTS.md).
    tile: int = 32
    # Queries per program on the top layer, where a block of r^(L-1) neighbours shares
    # parents, candidates and RoPE positions: one key tile then serves the whole block.
    top_block_queries: int = 8
    num_warps: int = 4
    num_stages: int = 2
    chunk_budget_bytes: int = 1 << 30


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
    """`(tile, parents_per_tile, P, Mp)`: the padded candidate-buffer geometry."""
    r, M = config.compression_rate, config.max_candidates
    tile = max(16, r, min(next_power_of_two(block_sizes.tile), M))
    per_tile = tile // r
    P = -(-config.top_k // per_tile) * per_tile
    return tile, per_tile, P, P * r


def chunk_size(config, block_sizes, B, T, H_kv, Mp):
    per_query = 8 * B * H_kv * Mp
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


@functools.partial(jax.tree_util.register_dataclass, data_fields=["layers", "cos", "sin", "q5"],
                   meta_fields=["st", "st_top", "parents_width", "chunk"])
@dataclasses.dataclass(frozen=True)
class Prepared:
    """Everything the per-layer launches share: padded tree, RoPE tables, queries."""

    layers: list  # [(K_l [B, H_kv, N_l, Kp], V_l [B, H_kv, N_l, Vp]), ...] bottom first
    cos: jax.Array  # [Mp, Kp/2]
    sin: jax.Array
    q5: jax.Array  # [B, chunks * Qc, H_kv, Gp, Kp]
    st: LayerStatic  # every layer but the top one
    st_top: LayerStatic  # the top layer: `block_queries` queries per program
    parents_width: int  # P
    chunk: int  # Qc, a multiple of st_top.block_queries


def prepare(q, k, v, config: HTreeConfig, block_sizes: BlockSizes, interpret: bool, precision) -> Prepared:
    B, T, H, K = q.shape
    H_kv, V = k.shape[2], v.shape[-1]
    G = H // H_kv
    r = config.compression_rate
    kp, vp, gp = next_power_of_two(K, 32), next_power_of_two(V, 16), next_power_of_two(G, 16)
    half = kp // 2
    tile, _, P, Mp = layout(config, block_sizes)
    st = LayerStatic(
        r=r, tile=tile, group=G, alpha=config.score_scale(K), importance=config.importance,
        strict_causal=config.strict_causal, log_n=config.log_n, top_k=config.top_k,
        precision=default_precision(q.dtype) if precision is None else precision,
        merge_precision=default_merge_precision(q.dtype) if precision is None else precision,
        num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages,
    )
    layers = [(jnp.swapaxes(pad_rope_halves(k, half), 1, 2), jnp.swapaxes(pad_axis(v, -1, vp), 1, 2))]
    for _ in config.layer_sizes(T)[1:]:
        layers.append(tuple(pool_layer_pallas(x, r, PoolBlockSizes(), interpret) for x in layers[-1]))
    cos_np, sin_np = rope_table(Mp, K, float(config.rope_base))
    cos, sin = (pad_axis(jnp.asarray(a), -1, half) for a in (cos_np, sin_np))
    q5 = pad_axis(pad_rope_halves(q.reshape(B, T, H_kv, G, K), half), 3, gp)
    L = len(layers)
    # Blocks of queries must not straddle a top-layer node: BQ divides r^(L-1).
    bq = min(r ** (L - 1), next_power_of_two(block_sizes.top_block_queries)) if L > 1 else 1
    st_top = dataclasses.replace(st, block_queries=bq)
    Qc = -(-chunk_size(config, block_sizes, B, T, H_kv, Mp) // bq) * bq
    q5 = pad_axis(q5, 1, -(-T // Qc) * Qc)
    return Prepared(layers, cos, sin, q5, st, st_top, P, Qc)


def top_layer_parents(t, prep: Prepared, num_layers: int, shape):
    """Virtual parents of the top layer, `0 .. floor(i*_{L-1} / r)`, `-1` padded."""
    r = prep.st.r
    slot = jnp.arange(prep.parents_width, dtype=jnp.int32)
    return jnp.broadcast_to(jnp.where(slot <= t // r ** (num_layers - 1) // r, slot, -1), shape)


def candidate_count(parents, t, r: int, layer: int):
    """Valid candidates per query, `[B, Q, H_kv, 1]` int32 (the reference's rule)."""
    num_parents = jnp.sum(parents >= 0, axis=-1, keepdims=True)
    return reference_candidate_count(num_parents, t, r, layer).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "block_sizes", "interpret", "precision"))
def htree_forward_pallas(q, k, v, config: HTreeConfig, block_sizes: BlockSizes = BlockSizes(),
                         interpret: bool = False, precision=None):
    """htree attention with Pallas kernels. Inputs validated by the caller.

    `precision` of the in-kernel score dots; `None` means `default_precision(q.dtype)`.
    Returns `(o [B, T, H, V] in q.dtype, selections)` like the JAX reference.
    """
    B, T, H, _ = q.shape
    H_kv, V = k.shape[2], v.shape[-1]
    G = H // H_kv
    prep = prepare(q, k, v, config, block_sizes, interpret, precision)
    st, Qc, P, L = prep.st, prep.chunk, prep.parents_width, len(prep.layers)
    num_chunks = prep.q5.shape[1] // Qc
    gp, vp = prep.q5.shape[3], prep.layers[0][1].shape[-1]

    def chunk(c):
        qc = lax.dynamic_slice_in_dim(prep.q5, c * Qc, Qc, axis=1)
        t = jnp.minimum(c * Qc + jnp.arange(Qc, dtype=jnp.int32), T - 1)[None, :, None, None]
        parents = top_layer_parents(t, prep, L, (B, Qc, H_kv, P))
        state = (
            jnp.full((B, Qc, H_kv, gp), -jnp.inf, jnp.float32),
            jnp.zeros((B, Qc, H_kv, gp), jnp.float32),
            jnp.zeros((B, Qc, H_kv, gp, vp), jnp.float32),
        )
        selections = []
        for l in reversed(range(L)):
            kl, vl = prep.layers[l]
            n = candidate_count(parents, t, st.r, l)
            if l > 0:
                st_l = prep.st_top if l == L - 1 else st
                bq = st_l.block_queries
                blocks = lambda x: x[:, ::bq]  # one row per block of queries sharing it
                keys = importance_keys_pallas(qc, blocks(parents), blocks(n), kl, prep.cos, prep.sin, st_l,
                                              interpret)
                next_parents, tau = select_top_k_layer_pallas(keys, parents, n, st, interpret)
                state = merge_pallas(qc, blocks(parents), blocks(n), keys, tau, kl, vl, prep.cos, prep.sin,
                                     state, st_l, interpret)
                parents = next_parents[..., :P]
                selections.append(parents[..., : config.top_k])
            else:
                o = merge_pallas(qc, parents, n, None, None, kl, vl, prep.cos, prep.sin, state, st,
                                 interpret, out_dtype=q.dtype)
        return o, selections

    o, sels = lax.map(chunk, jnp.arange(num_chunks, dtype=jnp.int32))
    # o: [chunks, B, Qc, H_kv, gp, vp] -> [B, T, H, V]
    o = jnp.moveaxis(o, 0, 1).reshape(B, num_chunks * Qc, H_kv, gp, vp)[:, :T, :, :G, :V]
    sels = [jnp.moveaxis(s, 0, 1).reshape(B, num_chunks * Qc, H_kv, -1)[:, :T] for s in sels]
    return o.reshape(B, T, H, V), sels


__all__ = ["BlockSizes", "Prepared", "check_pallas_dims", "htree_forward_pallas", "prepare"]
