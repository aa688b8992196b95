"""`attention_fn`: htree attention behind Flax's `attention_fn` hook, and what the Flax
modules (nnx `module.py`, linen `linen.py`) share: their sizes, the checks of causal
masks, dropout and the keyword arguments Flax passes.

`nnx.MultiHeadAttention(..., attention_fn=htree_jax.attention_fn(config))` and
`nn.MultiHeadDotProductAttention(..., attention_fn=...)` call it with projected
`q [batch..., T, H, K]`, `k, v [batch..., T, H_kv, D]` and keyword arguments; htree is
causal self-attention with RoPE inside, so what those arguments may ask is narrow:
causal masking (a causal `mask`, or `is_causal=True`), no dropout, no sown weights.
Everything else is refused by name before any kernel runs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from htree_jax.attention import htree_attention
from htree_jax.backends import check_backend, check_block_kernels, check_block_sizes
from htree_jax.core.config import HTreeConfig
from htree_jax.core.indexer import Index
from htree_jax.core.validation import check_config

CAUSAL_ONLY = (
    "htree attention is causal by construction (SPEC 2: each query walks the tree of "
    "the tokens before it)"
)


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


def _is_traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _raise_not_causal(ok) -> None:
    if not bool(ok):
        raise ValueError(
            f"mask: {CAUSAL_ONLY}; the mask passed under jit is not the causal mask "
            "(True exactly where key position <= query position)"
        )


TRACED_MASK_RULES = ("refuse", "device", "trust")


def check_causal_mask(mask, *, batch_shape, num_heads: int, seq_len: int, is_causal: bool = False,
                      traced: str = "refuse") -> None:
    """Refuses any attention mask that would make the attention other than causal.

    `mask` (Flax's convention: `True` or nonzero = attend; `make_causal_mask` gives
    float32 ones and zeros) must broadcast to
    `[*batch_shape, num_heads, T, T]`. Without `is_causal` it must equal the causal mask
    (`key <= query`); with `is_causal=True` (Flax ANDs the two) it must be `True` on and
    below the diagonal. `None` needs `is_causal=True`. A concrete mask is checked here.
    A traced one (under `jit`) has no values until the kernels run; `traced` says what
    then: `"refuse"` raises a ValueError now, saying how to ask for causal attention
    without a mask; `"device"` compares it with the causal mask on the device and
    reports through a host callback (a wrong mask then raises when the result is
    computed, as JAX's `JaxRuntimeError` around this ValueError); `"trust"` takes it."""
    if traced not in TRACED_MASK_RULES:
        raise ValueError(f"traced must be one of {TRACED_MASK_RULES}, got {traced!r}")
    if mask is None:
        if not is_causal:
            raise ValueError(
                f"mask: {CAUSAL_ONLY}, and no mask with is_causal=False asks for full "
                "(bidirectional) attention. Pass is_causal=True (nnx.MultiHeadAttention) or "
                "a causal mask (mask=nnx.make_causal_mask(x) / nn.make_causal_mask(x))"
            )
        return
    shape = tuple(getattr(mask, "shape", ()))
    want = (*batch_shape, num_heads, seq_len, seq_len)
    if len(shape) < 2 or len(shape) > len(want):
        raise ValueError(f"mask must broadcast to [batch..., H, T, T] = {list(want)}, got shape {list(shape)}")
    try:
        np.broadcast_shapes(shape, want)
    except ValueError:
        raise ValueError(
            f"mask must broadcast to [batch..., H, T, T] = {list(want)}, got shape {list(shape)}"
        ) from None
    if shape[-2:] != (seq_len, seq_len):
        raise ValueError(
            f"mask: {CAUSAL_ONLY}; its last two axes must be [T, T] = [{seq_len}, {seq_len}], "
            f"got shape {list(shape)}"
        )
    if not (jnp.issubdtype(mask.dtype, jnp.bool_) or jnp.issubdtype(mask.dtype, jnp.number)):
        raise TypeError(f"mask must be boolean or numeric (nonzero = attend), got dtype {np.dtype(mask.dtype).name}")
    if _is_traced(mask):
        if traced == "refuse":
            raise ValueError(
                f"mask: {CAUSAL_ONLY}, and a mask traced under jit has no values to check before "
                "the kernels run. Ask for causal attention without a mask: is_causal=True "
                "(nnx.MultiHeadAttention) or mask=None (HTreeAttention, where None is causal); or "
                "build the mask outside jit; or attention_fn(config, check_mask='device') to "
                "compare a traced mask with the causal one on the device (a wrong one then "
                "raises when the result is computed)"
            )
        if traced == "device":
            mask = mask.astype(bool)
            causal = jnp.tril(jnp.ones((seq_len, seq_len), bool))
            effective = mask & causal if is_causal else mask
            jax.debug.callback(_raise_not_causal, jnp.all(effective == causal))
        return
    values = np.asarray(mask).astype(bool)
    causal = np.tril(np.ones((seq_len, seq_len), bool))
    effective = values & causal if is_causal else values
    if not np.all(effective == causal):
        rule = "True on and below the diagonal" if is_causal else "True exactly where key position <= query position"
        raise ValueError(f"mask: {CAUSAL_ONLY}; only the causal mask is supported ({rule})")


def check_no_dropout(dropout_rate) -> None:
    if dropout_rate is None:
        return
    if not isinstance(dropout_rate, (int, float)) or isinstance(dropout_rate, bool) or dropout_rate < 0:
        raise ValueError(f"dropout_rate must be a number >= 0, got {dropout_rate!r}")
    if dropout_rate > 0:
        raise ValueError(
            f"dropout_rate: dropout on htree attention weights is not supported (got "
            f"{dropout_rate}); the merged nodes' weights never exist as a matrix. Set "
            "dropout_rate=0 (dropout elsewhere in the model is unaffected)"
        )


def attend(q, k, v, config, backend, block_sizes=None, segment_ids=None, max_documents=None, max_document_len=None,
           index=None, block_kernels=None):
    """`htree_attention` on `[batch..., T, heads, dim]` projections (any number of
    leading batch axes; `segment_ids [batch..., T]` for packed documents). With `index`
    (an `Index` of `[batch..., T, ...]` arrays, SPEC 13): `(o, SPEC 13's loss [batch...,
    T, H_kv])`."""
    batch_shape = q.shape[:-3]
    flat = lambda x: x.reshape((-1,) + x.shape[-3:])
    if index is not None:
        rows = lambda x, axes: x.reshape((-1,) + x.shape[-axes:])
        o, loss = htree_attention(flat(q), flat(k), flat(v), config, backend=backend, block_sizes=block_sizes,
                                  block_kernels=block_kernels,
                                  index=Index(rows(index.q, 3), rows(index.k, 3), rows(index.w, 2)))
        return o.reshape(batch_shape + o.shape[1:]), loss.reshape(batch_shape + loss.shape[1:])
    if segment_ids is not None:
        if tuple(segment_ids.shape) != tuple(q.shape[:-2]):
            raise ValueError(f"segment_ids must have shape [batch..., T] = {list(q.shape[:-2])}, "
                             f"got {list(segment_ids.shape)}")
        segment_ids = segment_ids.reshape(-1, segment_ids.shape[-1])
    o = htree_attention(flat(q), flat(k), flat(v), config, backend=backend, block_sizes=block_sizes,
                        block_kernels=block_kernels, segment_ids=segment_ids, max_documents=max_documents,
                        max_document_len=max_document_len)
    return o.reshape(batch_shape + o.shape[1:])


def traced_mask_rule(check_mask, is_causal) -> str:
    """`check_causal_mask`'s `traced` for `attention_fn(check_mask=...)`: `True` refuses a
    traced mask where the caller could have said `is_causal` (nnx passes it; `None`:
    linen's attention module, which cannot) and compares it on the device where not."""
    if check_mask is False:
        return "trust"
    if check_mask is True and is_causal is not None:
        return "refuse"
    return "device"


def attention_fn(config: HTreeConfig | None = None, *, backend: str = "auto", block_sizes=None,
                 check_mask: bool | str = True, block_kernels=None):
    """htree attention with the `attention_fn` contract of `nnx.MultiHeadAttention` and
    `nn.MultiHeadDotProductAttention`, so an existing Flax model switches with one argument:

        nnx.MultiHeadAttention(num_heads, d, ..., attention_fn=htree_jax.attention_fn(config))
        y = mha(x, is_causal=True)            # or mask=nnx.make_causal_mask(x[..., 0])

    The returned function takes the projected `query [batch..., T, H, K]`, `key
    [batch..., T, H_kv, K]`, `value [batch..., T, H_kv, V]` (un-rotated: RoPE is applied
    inside htree, so the model must not rotate them) and returns `[batch..., T, H, V]`.
    Keyword arguments, checked before any kernel runs:
      mask: a causal boolean mask broadcasting to `[batch..., H, T, T]`, or `None` with
        `is_causal=True`; anything else is refused (`check_causal_mask`). A mask traced
        under `jit` has no values before the kernels run: `check_mask=True` refuses it
        with a ValueError where the caller can ask for causal attention without one
        (`nnx.MultiHeadAttention` passes `is_causal`: call with `is_causal=True`), and
        compares it with the causal mask on the device where it cannot (linen's
        `nn.MultiHeadDotProductAttention` passes no `is_causal`; a wrong mask then raises
        when the result is computed, as a `JaxRuntimeError`); `check_mask="device"`
        always compares on the device, `check_mask=False` takes a traced mask unchecked.
      dropout_rate: must be 0 (`dropout_rng`, `broadcast_dropout`, `deterministic` are
        then irrelevant and accepted).
      dtype: if given, q, k, v are cast to it (float32, bfloat16 or float16).
      precision, force_fp32_for_softmax: accepted; htree's dots accumulate in float32 and
        its softmax is float32 whatever they say.
      module: must be `None` (`sow_weights=True` asks for dense attention weights, which
        htree never forms).
      qk_attn_weights_einsum, attn_weights_value_einsum: must be `None`.

    `config`: the `HTreeConfig` (static); `backend`, `block_sizes`, `block_kernels`: as in
    `htree_attention`.

    Packed documents cannot come through here: Flax's attention modules pass no segment
    ids to `attention_fn` (and a block-diagonal `mask` is refused above). Pack through
    `HTreeAttention(...)(x, segment_ids=...)` (nnx or linen) or
    `htree_attention(..., segment_ids=...)`.
    """
    config = check_config(config)
    if config.selection == "indexer":
        raise ValueError("attention_fn does not take selection='indexer' (SPEC 13): Flax's attention modules pass no "
                         "indexer inputs; use htree_attention(..., index=htree_jax.Index(...))")
    check_backend(backend)
    check_block_sizes(block_sizes)
    check_block_kernels(block_kernels)
    if not (check_mask is True or check_mask is False or check_mask == "device"):
        raise ValueError(f"check_mask must be True, False or 'device', got {check_mask!r}")

    def htree_attention_fn(
        query,
        key,
        value,
        bias=None,
        mask=None,
        broadcast_dropout: bool = True,
        dropout_rng=None,
        dropout_rate: float = 0.0,
        deterministic: bool = False,
        dtype=None,
        precision=None,
        module=None,
        is_causal: bool | None = None,
        force_fp32_for_softmax: bool = False,
        qk_attn_weights_einsum=None,
        attn_weights_value_einsum=None,
    ):
        if bias is not None:
            raise ValueError("bias: an additive attention bias is not supported by htree attention")
        check_no_dropout(dropout_rate)
        if module is not None:
            raise ValueError(
                "module / sow_weights=True: htree attention never forms the dense attention "
                "weights, so there is nothing to sow; call without sow_weights"
            )
        if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
            raise ValueError(
                "qk_attn_weights_einsum / attn_weights_value_einsum: custom einsums are not "
                "supported by htree attention"
            )
        for name, x in (("query", query), ("key", key), ("value", value)):
            if getattr(x, "ndim", 0) < 3:
                raise ValueError(f"{name} must have shape [batch..., T, heads, dim], got {getattr(x, 'shape', x)!r}")
        if query.shape[:-3] != key.shape[:-3] or key.shape[:-3] != value.shape[:-3]:
            raise ValueError(
                f"query, key and value must share their batch axes, got {query.shape}, "
                f"{key.shape}, {value.shape}"
            )
        if query.shape[-3] != key.shape[-3]:
            raise ValueError(
                f"query and key must have the same length T (self-attention over the whole "
                f"sequence), got {query.shape[-3]} and {key.shape[-3]}; token-by-token decoding "
                "needs htree's own cache, not the dense KV cache of nnx.MultiHeadAttention(decode=True): "
                "use htree_jax.HTreeAttention(..., decode=True) (or htree_jax.init_cache with prefill and "
                "decode_step)"
            )
        batch_shape, (T, H) = query.shape[:-3], query.shape[-3:-1]
        check_causal_mask(mask, batch_shape=batch_shape, num_heads=H, seq_len=T, is_causal=bool(is_causal),
                          traced=traced_mask_rule(check_mask, is_causal))
        if dtype is not None:
            query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
        return attend(query, key, value, config, backend, block_sizes, block_kernels=block_kernels)

    return htree_attention_fn
