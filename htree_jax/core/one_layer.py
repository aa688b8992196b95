"""A one-layer tree is causal softmax attention (SPEC 1-3 with `L = 1`): every token up to
`t` is a candidate of the only layer and is merged, none is selected. So where the tree
has one layer (`T <= top_k * compression_rate`):

- its function does not depend on `top_k`: `fitted_to_length` gives the config of the
  smallest `top_k` that keeps the one layer, so no path sizes a buffer by a `top_k`
  larger than the sequence needs (`top_k=2**20` at T=512 is 512 tokens' work);
- the GPU path computes it as RoPE at absolute positions followed by
  `jax.nn.dot_product_attention` (cuDNN's flash attention), which runs at dense
  attention's speed, forward and backward (`one_layer_attention`);
- the reference computes it as float32 causal attention in query chunks
  (`causal_attention_reference`), at dense attention's cost, not the walk's."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from htree_jax.core.config import HTreeConfig
from htree_jax.core.rope import apply_rope, rope_absolute, rope_table

# cuDNN's flash attention: 16-bit inputs, equal head dims of a multiple of 8, at most 128.
DENSE_DTYPES = (jnp.bfloat16, jnp.float16)
DENSE_MAX_HEAD_DIM = 128


def one_layer(config: HTreeConfig, seq_len: int) -> bool:
    """Whether the tree of `seq_len` tokens has one layer."""
    return len(config.layer_sizes(seq_len)) == 1


def fitted_to_length(config: HTreeConfig, seq_len: int) -> HTreeConfig:
    """`config` with the smallest `top_k` (a power of two) whose single layer still holds
    `seq_len` tokens, where `config`'s tree of `seq_len` tokens has one layer (the same
    function: nothing is selected); `config` itself otherwise."""
    if not one_layer(config, seq_len):
        return config
    top_k = 1
    while top_k * config.compression_rate < seq_len:
        top_k *= 2
    return config if top_k == config.top_k else dataclasses.replace(config, top_k=top_k)


def dense_takes(dtype, head_dim: int, value_dim: int) -> bool:
    """Whether `jax.nn.dot_product_attention` takes inputs of one `dtype` with head dims
    `K, V` on cuDNN (else the kernels run: XLA's dense attention would hold a `[B, H, T,
    T]` array)."""
    return (any(jnp.dtype(dtype) == d for d in DENSE_DTYPES) and head_dim == value_dim and head_dim % 8 == 0
            and head_dim <= DENSE_MAX_HEAD_DIM)


def dense_eligible(q, k, v) -> bool:
    """`dense_takes` for the arrays `q, k, v`, which must share their dtype."""
    return q.dtype == k.dtype == v.dtype and dense_takes(q.dtype, q.shape[-1], v.shape[-1])


def one_layer_attention(q, k, v, config: HTreeConfig, implementation: str | None = None):
    """htree attention of a one-layer tree: `q [B, T, H, K]`, `k [B, T, H_kv, K]` in
    `rope_layout` order (un-rotated), `v [B, T, H_kv, V]` -> `o [B, T, H, V]` in q's
    dtype. RoPE (the config's base, on its `rope_dim` features, rotate-half) at each
    token's index, then causal `softmax(alpha q.k) v` with `alpha = config.score_scale(K)`.
    `implementation`: `jax.nn.dot_product_attention`'s (None: cuDNN where it applies)."""
    R = config.partial_rope(q.shape[-1])
    rotate = lambda x: rope_absolute(x, config.rope_base, R).astype(v.dtype)
    return jax.nn.dot_product_attention(rotate(q), rotate(k), v, is_causal=True,
                                        scale=config.score_scale(q.shape[-1]), implementation=implementation)


def causal_attention_reference(q, k, v, config: HTreeConfig, *, positions=None, budget_bytes: int = 64 << 20):
    """The one-layer tree in float32 on any platform: `q [B, S, H, K]`, `k [B, T, H_kv,
    K]` (`rope_layout` order, un-rotated), `v [B, T, H_kv, V]` -> `o [B, S, H, V]` in q's
    dtype. RoPE (the config's base and `rope_dim`) at absolute positions, query `s` at
    `positions[s]` (`[S]` int32, may be traced; None: `s`), then causal `softmax(alpha
    q.k) v` over the keys up to it. Queries run in chunks whose `[B, H, chunk, T]`
    scores, weights and mask stay under `budget_bytes` (at least one query), each chunk
    rematerialised under autodiff, so memory is bounded as the reference's walk is."""
    B, S, H, K = q.shape
    T, H_kv = k.shape[1], k.shape[2]
    G = H // H_kv
    cos, sin = (jnp.asarray(a) for a in rope_table(T, K, float(config.rope_base), config.partial_rope(K)))
    positions = jnp.arange(S, dtype=jnp.int32) if positions is None else positions.astype(jnp.int32)
    keys = apply_rope(k.astype(jnp.float32), cos[None, :, None, :], sin[None, :, None, :])
    queries = apply_rope(q.astype(jnp.float32), cos[positions][None, :, None, :], sin[positions][None, :, None, :])
    values = v.astype(jnp.float32)
    alpha = config.score_scale(K)
    C = int(max(1, min(S, budget_bytes // (3 * 4 * B * H * T))))
    num_chunks = -(-S // C)
    queries = jnp.pad(queries, ((0, 0), (0, num_chunks * C - S), (0, 0), (0, 0))).reshape(B, num_chunks * C, H_kv, G, K)
    positions = jnp.pad(positions, (0, num_chunks * C - S), constant_values=T - 1)
    token = jnp.arange(T, dtype=jnp.int32)

    def chunk(i):
        qc = lax.dynamic_slice_in_dim(queries, i * C, C, axis=1)  # [B, C, H_kv, G, K]
        tc = lax.dynamic_slice_in_dim(positions, i * C, C)
        s = alpha * jnp.einsum("bchgk,bthk->bchgt", qc, keys)
        s = jnp.where((token[None, :] <= tc[:, None])[None, :, None, None, :], s, -jnp.inf)
        return jnp.einsum("bchgt,bthv->bchgv", jax.nn.softmax(s, axis=-1), values)

    o = lax.map(jax.checkpoint(chunk), jnp.arange(num_chunks, dtype=jnp.int32))  # [chunks, B, C, H_kv, G, V]
    o = jnp.moveaxis(o, 0, 1).reshape(B, num_chunks * C, H, -1)[:, :S]
    return o.astype(q.dtype)


__all__ = ["causal_attention_reference", "dense_eligible", "dense_takes", "fitted_to_length", "one_layer",
           "one_layer_attention"]
