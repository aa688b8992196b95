"""`HTreeAttention`: the Flax NNX module (projections + htree attention + output).

It follows `flax.nnx.MultiHeadAttention`'s conventions and parameter layout (`query`,
`key`, `value`: `LinearGeneral` to `[heads, head_dim]`; `out`: `LinearGeneral` from
`[num_heads, head_dim]`), so weights move between the two with `nnx.update`. The linen
twin is `htree_jax.linen.HTreeAttention`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers
from flax.nnx.nn.linear import default_kernel_init

from htree_jax.backends import check_backend, check_block_kernels, check_block_sizes
from htree_jax.cache import init_cache
from htree_jax.core.config import HTreeConfig
from htree_jax.core.indexer import Index, IndexerConfig
from htree_jax.core.validation import check_config
from htree_jax.decode import check_decode_block_sizes, prefill
from htree_jax.flax_attention import attend, check_causal_mask, check_inputs, module_dims


class IndexLoss(nnx.Variable):
    """SPEC 13's loss of a module's last call (`HTreeAttention` with an indexer), a float32
    scalar: the mean over its queries and kv heads of the KL divergence from the
    attention's distribution over each layer's candidates to the indexer's. Add the sum
    of a model's to its training loss, read inside the differentiated function:
    `sum(jax.tree.leaves(nnx.state(model, htree_jax.IndexLoss)))`."""


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
      backend, block_sizes, block_kernels: as in `htree_attention` (`"auto"`: Pallas kernels on a GPU;
        decoding uses the backend's decode kernels).
      decode_block_sizes: the Pallas decode kernels' `DecodeBlockSizes`, as `prefill` and
        `decode_step` take them (None: the defaults).
      indexer: with `config.selection="indexer"` (SPEC 13), the learned indexer's
        `IndexerConfig` (None: `IndexerConfig()`): the module owns its projections
        (`index_query`, `index_key`, `index_weight`, from the inputs with no gradient back
        into them: the indexer learns from its loss alone) and records each call's loss
        in `self.index_loss` (`IndexLoss`) for the training step to add. Full
        sequences on `backend="reference"` only, for now.
      rngs: `nnx.Rngs` for the parameter initialisers.

    `__call__(inputs, *, mask=None)`: `mask` may be `None` (causal) or the causal mask
    itself (e.g. `nnx.make_causal_mask(x[..., 0])`); any other mask is refused.

    Decoding (`init_cache`, then `decode=True`): a row appended past the cache's
    `max_len` raises a `ValueError` in an eager call; under `jax.jit` (`nnx.jit`) it
    cannot (no host sync), so that row's outputs are NaN and its cache row stays as it
    was (`cache.lengths` unchanged). Size `max_len` for the longest sequence.
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
        use_bias: bool = True,
        kernel_init=default_kernel_init,
        bias_init=initializers.zeros_init(),
        precision=None,
        backend: str = "auto",
        block_sizes=None,
        block_kernels=None,
        decode: bool = False,
        decode_block_sizes=None,
        indexer: IndexerConfig | None = None,
        rngs: nnx.Rngs,
    ):
        dims = module_dims(num_heads, in_features, num_kv_heads, head_dim, out_features)
        self.config = check_config(config)
        self.backend = check_backend(backend)
        check_block_sizes(block_sizes)
        self.block_sizes = block_sizes
        check_block_kernels(block_kernels)
        self.block_kernels = block_kernels
        check_decode_block_sizes(decode_block_sizes)
        self.decode_block_sizes = decode_block_sizes
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
        self.indexer = index_config(self.config, indexer, dims.num_kv_heads)
        if self.indexer is not None:
            ix = self.indexer
            self.index_query = nnx.LinearGeneral(dims.in_features, (ix.heads, ix.head_dim), **linear)
            self.index_key = nnx.LinearGeneral(dims.in_features, (ix.key_heads(dims.num_kv_heads), ix.head_dim),
                                               **linear)
            self.index_weight = nnx.LinearGeneral(dims.in_features, (ix.heads,), **linear)
            self.index_loss = IndexLoss(jnp.zeros((), jnp.float32))

    def init_cache(self, batch_size_or_input_shape, max_len: int | None = None, dtype=None, token_dtype=None):
        """Makes an empty decode cache (`htree_jax.init_cache`). Two calls:

        - `init_cache(batch_size, max_len)`: `batch_size` rows of up to `max_len` tokens;
        - `init_cache(input_shape, dtype=jnp.float32)`, `nnx.MultiHeadAttention`'s call:
          `input_shape = (B, max_len, in_features)`, the shape of the whole sequence the
          cache will hold (so code written for MHA's decoding runs unchanged).

        The cache's `dtype` defaults to the module's `dtype`, else `param_dtype` (the
        projections' dtype). Then `module(x, decode=True)` appends `x [B, S, in_features]`
        (a prompt, or one token) and attends with it. `token_dtype=jnp.float8_e4m3fn`:
        the tokens stored in e4m3 with per-token scales, about half the bytes (`dtype`
        16-bit; `htree_jax.init_cache` says what it computes)."""
        batch_size, max_len = self._cache_shape(batch_size_or_input_shape, max_len)
        dtype = dtype or self.dtype or self.param_dtype
        self.cache = nnx.Cache(init_cache(batch_size, max_len, self.num_kv_heads, self.head_dim,
                                          self.head_dim, self.config, dtype, token_dtype=token_dtype,
                                          num_heads=self.num_heads))

    def _cache_shape(self, batch_size_or_input_shape, max_len):
        """`(batch_size, max_len)` from either form `init_cache` takes."""
        arg = batch_size_or_input_shape
        if isinstance(arg, (tuple, list)):
            if max_len is not None:
                raise TypeError("init_cache(input_shape, ...) takes max_len from input_shape[-2]; "
                                "pass either (input_shape) or (batch_size, max_len)")
            if len(arg) != 3 or arg[-1] != self.in_features:
                raise ValueError(f"init_cache: input_shape must be (batch, max_len, in_features={self.in_features}) "
                                 f"(a decode cache has one batch axis), got {tuple(arg)}")
            return int(arg[0]), int(arg[1])
        if max_len is None:
            raise TypeError("init_cache needs max_len: init_cache(batch_size, max_len), or MHA's "
                            "init_cache(input_shape) with input_shape = (batch, max_len, in_features)")
        return arg, max_len

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
        if self.indexer is not None:
            if segment_ids is not None:
                raise ValueError("segment_ids: selection='indexer' (SPEC 13) takes one document a row for now")
            x = jax.lax.stop_gradient(inputs)  # the indexer learns from its own loss only
            index = Index(self.index_query(x), self.index_key(x),
                          self.index_weight(x) * self.indexer.weight_scale())
            o, loss = attend(q, k, v, self.config, self.backend, self.block_sizes, index=index,
                             block_kernels=self.block_kernels)
            self.index_loss.set_value(jnp.mean(loss))
            return self.out(o)
        o = attend(q, k, v, self.config, self.backend, self.block_sizes, segment_ids, max_documents,
                   max_document_len, block_kernels=self.block_kernels)
        return self.out(o)

    def _decode(self, inputs, mask, lengths):
        if self.cache is None:
            raise ValueError("decode=True needs a cache: call init_cache(batch_size, max_len) first")
        if mask is not None:
            raise ValueError("mask must be None with decode=True: the new tokens attend causally to the cache")
        if inputs.ndim != 3:
            raise ValueError(f"inputs must have shape [B, S, in_features] with decode=True, got {list(inputs.shape)}")
        q, k, v = self.query(inputs), self.key(inputs), self.value(inputs)
        o, cache = prefill(q, k, v, self.cache.get_value(), self.config, lengths=lengths, backend=self.backend,
                           block_sizes=self.decode_block_sizes)
        self.cache.set_value(cache)
        return self.out(o)


def index_config(config: HTreeConfig, indexer: IndexerConfig | None, num_kv_heads: int) -> IndexerConfig | None:
    """The module's indexer: `indexer` (or `IndexerConfig()`) with `selection="indexer"`,
    None otherwise; a ValueError naming the rule where the two disagree or the heads do
    not divide."""
    if config.selection != "indexer":
        if indexer is not None:
            raise ValueError(f"indexer is for HTreeConfig(selection='indexer') (SPEC 13), got selection="
                             f"{config.selection!r}")
        return None
    indexer = IndexerConfig() if indexer is None else indexer
    if not isinstance(indexer, IndexerConfig):
        raise TypeError(f"indexer must be an htree_jax.IndexerConfig or None, got {type(indexer).__name__}")
    if indexer.heads % indexer.key_heads(num_kv_heads):
        raise ValueError(f"IndexerConfig.heads ({indexer.heads}) must be a multiple of the index key heads "
                         f"({indexer.key_heads(num_kv_heads)}: shared_key=False gives one a kv head)")
    return indexer
