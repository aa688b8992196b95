"""The Pallas forward pass: tree build, then per layer (top down) the importance-keys
kernel and the select-and-merge kernel, over chunks of query positions.

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
from htree_jax.rope import rope_table
from pallas_kernels.common import next_power_of_two, pad_axis, pad_rope_halves
from pallas_kernels.layer_forward import LayerStatic, importance_keys_pallas, select_and_merge_pallas
from pallas_kernels.tree_build import PoolBlockSizes, pool_layer_pallas

MIN_DIM, MAX_DIM, MAX_GROUP = 32, 256, 16


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    tile: int = 128  # candidates per inner step (raised to >= 16 and >= r)
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


@functools.partial(jax.jit, static_argnames=("config", "block_sizes", "interpret", "precision"))
def htree_forward_pallas(q, k, v, config: HTreeConfig, block_sizes: BlockSizes = BlockSizes(),
                         interpret: bool = False, precision=lax.Precision.HIGHEST):
    """htree attention with Pallas kernels. Inputs validated by the caller.

    Returns `(o [B, T, H, V] in q.dtype, selections)` like the JAX reference.
    """
    B, T, H, K = q.shape
    H_kv, V = k.shape[2], v.shape[-1]
    G = H // H_kv
    r, k_top = config.compression_rate, config.top_k
    kp, vp, gp = next_power_of_two(K, 32), next_power_of_two(V, 16), next_power_of_two(G, 16)
    half = kp // 2
    tile, _, P, Mp = layout(config, block_sizes)
    st = LayerStatic(
        r=r, tile=tile, group=G, alpha=config.score_scale(K), importance=config.importance,
        strict_causal=config.strict_causal, log_n=config.log_n, top_k=k_top, precision=precision,
        num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages,
    )

    # Tree, in the kernels' layout [B, H_kv, N, D] with padded dims.
    k0 = jnp.swapaxes(pad_rope_halves(k, half), 1, 2)
    v0 = jnp.swapaxes(pad_axis(v, -1, vp), 1, 2)
    layers = [(k0, v0)]
    for _ in config.layer_sizes(T)[1:]:
        kl, vl = layers[-1]
        layers.append((pool_layer_pallas(kl, r, PoolBlockSizes(), interpret),
                       pool_layer_pallas(vl, r, PoolBlockSizes(), interpret)))
    L = len(layers)

    cos_np, sin_np = rope_table(Mp, K, float(config.rope_base))
    cos = pad_axis(jnp.asarray(cos_np), -1, half)
    sin = pad_axis(jnp.asarray(sin_np), -1, half)

    q5 = pad_axis(pad_rope_halves(q.reshape(B, T, H_kv, G, K), half), 3, gp)
    Qc = chunk_size(config, block_sizes, B, T, H_kv, Mp)
    num_chunks = -(-T // Qc)
    if num_chunks * Qc != T:
        q5 = pad_axis(q5, 1, num_chunks * Qc)
    slot = jnp.arange(P, dtype=jnp.int32)

    def chunk(c):
        qc = lax.dynamic_slice_in_dim(q5, c * Qc, Qc, axis=1)
        t = jnp.minimum(c * Qc + jnp.arange(Qc, dtype=jnp.int32), T - 1)[None, :, None, None]
        parents = jnp.where(slot <= t // r ** (L - 1) // r, slot, -1)
        parents = jnp.broadcast_to(parents, (B, Qc, H_kv, P))
        state = (
            jnp.full((B, Qc, H_kv, gp), -jnp.inf, jnp.float32),
            jnp.zeros((B, Qc, H_kv, gp), jnp.float32),
            jnp.zeros((B, Qc, H_kv, gp, vp), jnp.float32),
        )
        selections = []
        for l in reversed(range(L)):
            kl, vl = layers[l]
            num_parents = jnp.sum(parents >= 0, axis=-1, keepdims=True)
            n = ((num_parents - 1) * r + (t // r**l) % r + 1).astype(jnp.int32)
            if l > 0:
                keys = importance_keys_pallas(qc, parents, n, kl, cos, sin, st, interpret)
                state, next_parents = select_and_merge_pallas(
                    qc, parents, n, keys, kl, vl, cos, sin, state, st, interpret)
                parents = next_parents[..., :P]
                selections.append(parents[..., :k_top])
            else:
                o = select_and_merge_pallas(qc, parents, n, None, kl, vl, cos, sin, state, st,
                                            interpret, out_dtype=q.dtype)
        return o, selections

    o, sels = lax.map(chunk, jnp.arange(num_chunks, dtype=jnp.int32))
    # o: [chunks, B, Qc, H_kv, gp, vp] -> [B, T, H, V]
    o = jnp.moveaxis(o, 0, 1).reshape(B, num_chunks * Qc, H_kv, gp, vp)[:, :T, :, :G, :V]
    sels = [jnp.moveaxis(s, 0, 1).reshape(B, num_chunks * Qc, H_kv, k_top)[:, :T] for s in sels]
    return o.reshape(B, T, H, V), sels


__all__ = ["BlockSizes", "check_pallas_dims", "htree_forward_pallas"]
