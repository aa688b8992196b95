"""A one-layer tree is causal softmax attention (SPEC 1-3 with `L = 1`): every token up to
`t` is a candidate of the only layer and is merged, none is selected. So where the tree
has one layer (`T <= top_k * compression_rate`) the GPU path computes it as RoPE at
absolute positions followed by `jax.nn.dot_product_attention` (cuDNN's flash attention
on a GPU), which runs at dense attention's speed, forward and backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from htree_jax.core.config import HTreeConfig
from htree_jax.core.rope import rope_absolute

# cuDNN's flash attention: 16-bit inputs, equal head dims of a multiple of 8, at most 128.
DENSE_DTYPES = (jnp.bfloat16, jnp.float16)
DENSE_MAX_HEAD_DIM = 128


def one_layer(config: HTreeConfig, seq_len: int) -> bool:
    """Whether the tree of `seq_len` tokens has one layer."""
    return len(config.layer_sizes(seq_len)) == 1


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


__all__ = ["dense_eligible", "dense_takes", "one_layer", "one_layer_attention"]
