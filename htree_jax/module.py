"""`HTreeAttention`: the Flax NNX module (projections + htree attention + output).

It follows `flax.nnx.MultiHeadAttention`'s conventions and parameter layout (`query`,
`key`, `value`: `LinearGeneral` to `[heads, head_dim]`; `out`: `LinearGeneral` from
`[num_heads, head_dim]`), so weights move between the two with `nnx.update`. The linen
twin is `htree_jax.linen.HTreeAttention`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers
from flax.nnx.nn.linear import default_kernel_init

from htree_jax.config import HTreeConfig
from htree_jax.flax_attention import attend, check_backend, check_causal_mask
from htree_jax.validation import check_config


@dataclasses.dataclass(frozen=True)
class ModuleDims:
    """The checked sizes of an `HTreeAttention` (nnx or linen)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    in_features: int
    out_features: int


def _positive_int(name: str, x) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise ValueError(f"{name} must be a positive int, got {x!r}")
    return x


def module_dims(num_heads, in_features, num_kv_heads=None, head_dim=None, out_features=None) -> ModuleDims:
    """Validates the constructor's sizes; every error names the argument and the rule."""
    H = _positive_int("num_heads", num_heads)
    D_in = _positive_int("in_features", in_features)
    H_kv = H if num_kv_heads is None else _positive_int("num_kv_heads", num_kv_heads)
    if H % H_kv:
        raise ValueError(
            f"num_heads must be a multiple of num_kv_heads (GQA groups), got num_heads={H}, "
            f"num_kv_heads={H_kv}"
        )
    if head_dim is None:
        if D_in % H:
            raise ValueError(
                f"in_features must be divisible by num_heads when head_dim is not given, got "
                f"in_features={D_in}, num_heads={H}; pass head_dim"
            )
        head_dim = D_in // H
    D = _positive_int("head_dim", head_dim)
    if D % 2:
        raise ValueError(f"head_dim must be even (htree applies rotate-half RoPE), got {D}")
    D_out = D_in if out_features is None else _positive_int("out_features", out_features)
    return ModuleDims(H, H_kv, D, D_in, D_out)


def check_inputs(inputs, dims: ModuleDims) -> None:
    shape = getattr(inputs, "shape", None)
    if shape is None or len(shape) < 2:
        raise ValueError(f"inputs must have shape [batch..., T, in_features], got {shape!r}")
    if shape[-1] != dims.in_features:
        raise ValueError(
            f"inputs: last axis must be in_features={dims.in_features}, got shape {list(shape)}"
        )


class HTreeAttention(nnx.Module):
    """Causal multi-head (GQA) self-attention with htree attention inside.

    `y = HTreeAttention(num_heads, in_features, rngs=nnx.Rngs(0))(x)` maps
    `x [batch..., T, in_features]` to `[batch..., T, out_features]`: `q = x Wq`
    `[.., T, num_heads, head_dim]`, `k = x Wk`, `v = x Wv` `[.., T, num_kv_heads, head_dim]`,
    `o = htree_attention(q, k, v, config)`, `y = o Wo`.

    RoPE is applied inside htree, at each candidate's position in its buffer (SPEC 2.2),
    so this module does not rotate `q` or `k`, and a model must not rotate them before
    it either. Attention is causal by construction; the candidate buffers have the static
    size `config.max_candidates`, so the module compiles once per sequence length.

    Args:
      num_heads: query heads `H`.
      in_features: size of the inputs' last axis.
      num_kv_heads: key/value heads `H_kv` (default `num_heads`); `num_heads % num_kv_heads == 0`.
      head_dim: per-head size of q, k and v (default `in_features // num_heads`); even.
      out_features: size of the output's last axis (default `in_features`).
      config: the `HTreeConfig`.
      dtype: dtype of the projections' computation (default: inferred from the inputs and
        parameters, as in `nnx.Linear`); htree then runs in that dtype (float32, bfloat16
        or float16).
      param_dtype, use_bias, kernel_init, bias_init, precision: as in `nnx.MultiHeadAttention`
        (applied to the four projections).
      backend, interpret: as in `htree_attention` (`"auto"`: Pallas kernels on a GPU).
      rngs: `nnx.Rngs` for the parameter initialisers.

    `__call__(inputs, *, mask=None)`: `mask` may be `None` (causal) or the causal mask
    itself (e.g. `nnx.make_causal_mask(x[..., 0])`); any other mask is refused.
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        out_features: int | None = None,
        config: HTreeConfig = HTreeConfig(),
        dtype=None,
        param_dtype=jnp.float32,
        use_bias: bool = False,
        kernel_init=default_kernel_init,
        bias_init=initializers.zeros_init(),
        precision=None,
        backend: str = "auto",
        interpret: bool = False,
        decode: bool = False,
        rngs: nnx.Rngs,
    ):
        dims = module_dims(num_heads, in_features, num_kv_heads, head_dim, out_features)
        self.config = check_config(config)
        self.backend = check_backend(backend, interpret)
        self.interpret = interpret
        if not isinstance(decode, bool):
            raise TypeError(f"decode must be a bool, got {decode!r}")
        self.decode = decode
        self.param_dtype = param_dtype
        self.cache = nnx.data(None)
        self.dims = dims
        self.num_heads, self.num_kv_heads, self.head_dim = dims.num_heads, dims.num_kv_heads, dims.head_dim
        self.in_features, self.out_features = dims.in_features, dims.out_features
        self.dtype = dtype
        linear = dict(dtype=dtype, param_dtype=param_dtype, use_bias=use_bias, kernel_init=kernel_init,
                      bias_init=bias_init, precision=precision, rngs=rngs)
        self.query = nnx.LinearGeneral(dims.in_features, (dims.num_heads, dims.head_dim), **linear)
        self.key = nnx.LinearGeneral(dims.in_features, (dims.num_kv_heads, dims.head_dim), **linear)
        self.value = nnx.LinearGeneral(dims.in_features, (dims.num_kv_heads, dims.head_dim), **linear)
        self.out = nnx.LinearGeneral((dims.num_heads, dims.head_dim), dims.out_features, axis=(-2, -1),
                                     **linear)

    def init_cache(self, batch_size: int, max_len: int, dtype=None):
        """Makes an empty decode cache (`htree_jax.init_cache`) for `batch_size` rows of up
        to `max_len` tokens, in `dtype` (default: the module's `dtype`, else `param_dtype`:
        the projections' dtype). Then `module(x, decode=True)` appends `x [B, S, in_features]`
        (a prompt, or one token) and attends with it."""
        from htree_jax.decode import init_cache

        dtype = dtype or self.dtype or self.param_dtype
        self.cache = nnx.Cache(init_cache(batch_size, max_len, self.num_kv_heads, self.head_dim,
                                          self.head_dim, self.config, dtype))

    def __call__(self, inputs, *, mask=None, decode: bool | None = None, lengths=None, segment_ids=None,
                 max_documents: int | None = None, max_document_len: int | None = None):
        """`inputs [batch..., T, in_features]` -> `[batch..., T, out_features]`.

        With `decode=True` (or the constructor's `decode`), `inputs [B, S, in_features]`
        are the next `S` tokens: they are appended to the cache made by `init_cache` and
        attend to everything before them; the result equals the full-sequence output at
        those positions, with the module's backend (`"auto"`: the Pallas decode kernels on
        a GPU where the head dims allow, else the JAX reference walk). Every cache row is
        its own sequence: `lengths` (int `[B]`) says how many of the `S` tokens each row
        appends (right-padded prompts of different lengths; `None`: all `S`); the
        padding positions' outputs are those of zero attention outputs. Rows restart
        with `htree_jax.reset_rows` on `self.cache`.

        Packed documents (SPEC 6): `segment_ids` int32 `[batch..., T]`, each maximal run
        of equal ids attended as a sequence of its own; `max_documents`,
        `max_document_len` as in `htree_attention`. Not with `decode` (a cache row is one sequence)."""
        check_inputs(inputs, self.dims)
        decode = self.decode if decode is None else decode
        if decode:
            if segment_ids is not None:
                raise ValueError("segment_ids: packed documents are for full sequences, not decode=True")
            return self._decode(inputs, mask, lengths)
        batch_shape, T = inputs.shape[:-2], inputs.shape[-2]
        check_causal_mask(mask, batch_shape=batch_shape, num_heads=self.num_heads, seq_len=T,
                          is_causal=mask is None)
        q, k, v = self.query(inputs), self.key(inputs), self.value(inputs)
        o = attend(q, k, v, self.config, self.backend, self.interpret, segment_ids, max_documents,
                   max_document_len)
        return self.out(o)

    def _decode(self, inputs, mask, lengths):
        from htree_jax.decode import decode_backend, prefill

        if self.cache is None:
            raise ValueError("decode=True needs a cache: call init_cache(batch_size, max_len) first")
        if mask is not None:
            raise ValueError("mask must be None with decode=True: the new tokens attend causally to the cache")
        if inputs.ndim != 3:
            raise ValueError(f"inputs must have shape [B, S, in_features] with decode=True, got {list(inputs.shape)}")
        q, k, v = self.query(inputs), self.key(inputs), self.value(inputs)
        o, cache = prefill(q, k, v, self.cache.get_value(), self.config, lengths=lengths,
                           backend=decode_backend(self.backend, self.interpret))
        self.cache.set_value(cache)
        return self.out(o)
