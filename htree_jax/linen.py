"""`htree_jax.linen.HTreeAttention`: the linen twin of the NNX `HTreeAttention`, same
arguments, same parameter layout (`query`, `key`, `value`, `out` as `DenseGeneral`,
kernels `[in, heads, head_dim]` and `[heads, head_dim, out]`), same output from the same
weights."""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

from htree_jax.config import HTreeConfig
from htree_jax.flax_attention import attend, check_backend, check_causal_mask
from htree_jax.module import check_inputs, module_dims
from htree_jax.validation import check_config


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
    use_bias: bool = False
    kernel_init: Callable = nn.linear.default_kernel_init
    bias_init: Callable = nn.initializers.zeros_init()
    precision: Any = None
    backend: str = "auto"
    interpret: bool = False

    def setup(self):
        dims = module_dims(self.num_heads, self.in_features, self.num_kv_heads, self.head_dim,
                           self.out_features)
        check_config(self.config)
        check_backend(self.backend)
        if not isinstance(self.interpret, bool):
            raise TypeError(f"interpret must be a bool, got {self.interpret!r}")
        self.dims = dims
        dense = dict(dtype=self.dtype, param_dtype=self.param_dtype, use_bias=self.use_bias,
                     kernel_init=self.kernel_init, bias_init=self.bias_init, precision=self.precision)
        self.query = nn.DenseGeneral((dims.num_heads, dims.head_dim), **dense)
        self.key = nn.DenseGeneral((dims.num_kv_heads, dims.head_dim), **dense)
        self.value = nn.DenseGeneral((dims.num_kv_heads, dims.head_dim), **dense)
        self.out = nn.DenseGeneral(dims.out_features, axis=(-2, -1), **dense)

    def __call__(self, inputs, mask=None):
        """`inputs [batch..., T, in_features]` -> `[batch..., T, out_features]`."""
        check_inputs(inputs, self.dims)
        batch_shape, T = inputs.shape[:-2], inputs.shape[-2]
        check_causal_mask(mask, batch_shape=batch_shape, num_heads=self.dims.num_heads, seq_len=T,
                          is_causal=mask is None)
        q, k, v = self.query(inputs), self.key(inputs), self.value(inputs)
        return self.out(attend(q, k, v, check_config(self.config), self.backend, self.interpret))
