"""`htree_jax.linen.HTreeAttention`: the linen twin of the NNX `HTreeAttention`, same
arguments, same parameter layout (`query`, `key`, `value`, `out` as `DenseGeneral`,
kernels `[in, heads, head_dim]` and `[heads, head_dim, out]`), same output from the same
weights."""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

from htree_jax.backends import check_backend, check_block_kernels, check_block_sizes
from htree_jax.cache import init_cache
from htree_jax.core.config import HTreeConfig
from htree_jax.core.validation import check_config
from htree_jax.decode import check_decode_block_sizes, prefill
from htree_jax.flax_attention import attend, check_causal_mask, check_inputs, module_dims


class HTreeAttention(nn.Module):
    """Causal multi-head (GQA) self-attention with htree attention inside (linen).

    Fields as in `htree_jax.HTreeAttention` (nnx), less `rngs` (linen takes them at
    `init`). RoPE is applied inside htree: the module does not rotate `q` or `k`, and a
    model must not rotate them before it. `__call__(inputs, mask=None)`: `mask` is `None`
    (causal) or the causal mask itself (`nn.make_causal_mask(x[..., 0])`); any other mask
    is refused.
    """

    num_heads: int
    in_features: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    out_features: int | None = None
    config: HTreeConfig = HTreeConfig()
    dtype: Any = None
    param_dtype: Any = jnp.float32
    use_bias: bool = True
    kernel_init: Callable = nn.linear.default_kernel_init
    bias_init: Callable = nn.initializers.zeros_init()
    precision: Any = None
    backend: str = "auto"
    block_sizes: Any = None
    # Block selection's kernels (`htree_jax.BlockKernels`, None: the plan's), as in `htree_attention`.
    block_kernels: Any = None
    decode: bool = False
    # The Pallas decode kernels' `DecodeBlockSizes` (None: the defaults).
    decode_block_sizes: Any = None
    # The decode cache's tokens: None (the inputs' dtype) or jnp.float8_e4m3fn (e4m3 with
    # per-token scales, 16-bit inputs; `htree_jax.init_cache(..., token_dtype=)`).
    cache_token_dtype: Any = None

    def _checked(self):
        dims = module_dims(self.num_heads, self.in_features, self.num_kv_heads, self.head_dim,
                           self.out_features)
        if check_config(self.config).selection == "indexer":
            raise ValueError("the linen HTreeAttention does not take selection='indexer' yet (SPEC 13): the nnx "
                             "HTreeAttention(..., indexer=htree_jax.IndexerConfig()) owns the indexer's projections")
        check_backend(self.backend)
        check_block_sizes(self.block_sizes)
        check_block_kernels(self.block_kernels)
        check_decode_block_sizes(self.decode_block_sizes)
        return dims

    def _dense(self, features, name, axis=-1):
        return nn.DenseGeneral(features, axis=axis, dtype=self.dtype, param_dtype=self.param_dtype,
                               use_bias=self.use_bias, kernel_init=self.kernel_init, bias_init=self.bias_init,
                               precision=self.precision, name=name)

    @nn.compact
    def __call__(self, inputs, mask=None, decode: bool | None = None, lengths=None, segment_ids=None,
                 max_documents: int | None = None, max_document_len: int | None = None):
        """`inputs [batch..., T, in_features]` -> `[batch..., T, out_features]`.

        Decoding, as in `nn.MultiHeadDotProductAttention`: `init` with `decode=True` on
        inputs `[B, max_len, in_features]` makes the `cache` collection (an empty
        `HTreeCache` for `max_len` tokens); `apply(..., decode=True, mutable=["cache"])`
        then appends `inputs [B, S, in_features]` and attends with them (with the module's
        backend, as `htree_jax.prefill` takes it; `lengths` int `[B]`: the tokens each row
        appends, as `prefill` takes them). `segment_ids [batch..., T]`, `max_documents`, `max_document_len`:
        packed documents, as the nnx module takes them (not with `decode`)."""
        dims = self._checked()
        check_inputs(inputs, dims)
        decode = self.decode if decode is None else decode
        q = self._dense((dims.num_heads, dims.head_dim), "query")(inputs)
        k = self._dense((dims.num_kv_heads, dims.head_dim), "key")(inputs)
        v = self._dense((dims.num_kv_heads, dims.head_dim), "value")(inputs)
        out = self._dense(dims.out_features, "out", axis=(-2, -1))
        config = check_config(self.config)
        if decode:
            if segment_ids is not None:
                raise ValueError("segment_ids: packed documents are for full sequences, not decode=True")
            if mask is not None:
                raise ValueError("mask must be None with decode=True: the new tokens attend causally to the cache")
            if inputs.ndim != 3:
                raise ValueError(
                    f"inputs must have shape [B, S, in_features] with decode=True, got {list(inputs.shape)}")
            initialized = self.has_variable("cache", "tree")
            B, S = inputs.shape[:2]
            tree = self.variable("cache", "tree", lambda: init_cache(
                B, S, dims.num_kv_heads, dims.head_dim, dims.head_dim, config, k.dtype,
                token_dtype=self.cache_token_dtype, num_heads=dims.num_heads))
            if initialized:
                o, tree.value = prefill(q, k, v, tree.value, config, lengths=lengths, backend=self.backend,
                                                 block_sizes=self.decode_block_sizes)
                return out(o)
        batch_shape, T = inputs.shape[:-2], inputs.shape[-2]
        check_causal_mask(mask, batch_shape=batch_shape, num_heads=dims.num_heads, seq_len=T,
                          is_causal=mask is None)
        return out(attend(q, k, v, config, self.backend, self.block_sizes, segment_ids, max_documents,
                          max_document_len, block_kernels=self.block_kernels))
