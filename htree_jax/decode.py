"""Incremental decoding (SPEC 3, strict causality): htree attention for new queries over
a KV cache holding the whole tree (`cache.py`), which each call updates in place.

    cache = init_cache(B, max_len, H_kv, K, V, config, jnp.bfloat16)
    o, cache = prefill(q, k, v, cache, config, lengths=prompt_lengths)  # right-padded prompts [B, S, ...]
    o_t, cache = decode_step(q_t, k_t, v_t, cache, config)  # then one token per row per call
    cache = reset_rows(cache, finished)                     # rows that start a new sequence

Every row is its own sequence with its own length (SPEC 9, `cache.lengths [B]`): a batch
of prompts of different lengths, and rows reused as sequences finish (continuous
batching). No step does a host callback or a host sync under `jit`; an append past
`max_len` raises when the lengths are concrete (an eager call), and under `jit` gives
that row NaN outputs and leaves its cache rows as they were. A decode step costs
`O(r * L)` row reads for the tree and `O(L * top_k * r)` for the attention.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from htree_jax.backends import attend_cache, decode_backend
from htree_jax.cache import (
    HTreeCache,
    append_to_cache,
    check_cache,
    check_decode_config,
    check_lengths,
    check_query_heads,
    check_room,
)
from htree_jax.core.blocks import block_rows, with_recent
from htree_jax.core.config import HTreeConfig
from htree_jax.core.one_layer import fitted_to_length
from htree_jax.core.rope import rope_layout
from htree_jax.sharding import partitioned_cache_attention
from pallas_kernels.decode.append import append_token_pallas
from pallas_kernels.decode.kept import kept_merge_dims, kept_step_pallas
from pallas_kernels.shared.configs import DecodeBlockSizes


def _check_tokens(cache: HTreeCache, q, k, v, step: bool):
    """Shapes and dtypes of the new tokens against the cache; returns `S` (tokens added)."""
    B, H_kv = cache.batch_size, cache.num_kv_heads
    K, V = cache.keys[0].shape[-1], cache.v_dim
    if cache.values_from_keys != (v is None):
        raise ValueError("v must be None: this cache reads the values from the keys (init_cache(..., "
                         "values_from_keys=True))" if v is not None else
                         "v=None needs a cache that reads the values from the keys (init_cache(..., "
                         "values_from_keys=True))")
    axis = "" if step else "S, "
    want = {"q": f"[B, {axis}H, K] = [{B}, {axis}H, {K}]",
            "k": f"[B, {axis}H_kv, K] = [{B}, {axis}{H_kv}, {K}]",
            "v": f"[B, {axis}H_kv, V] = [{B}, {axis}{H_kv}, {V}]"}
    rank = 3 if step else 4
    given = [(name, x) for name, x in (("q", q), ("k", k), ("v", v)) if x is not None]
    for name, x in given:
        shape = tuple(getattr(x, "shape", ()))
        if len(shape) != rank:
            raise ValueError(f"{name} must have shape {want[name]}, got {list(shape)}")
    S = 1 if step else q.shape[1]
    if S == 0:
        raise ValueError("prefill needs at least one token (axis 1 of q, k, v), got 0")
    qs, ks, vs = (x.shape if not step else x.shape[:1] + (1,) + x.shape[1:] for x in (q, k, k if v is None else v))
    if ks != (B, S, H_kv, K):
        raise ValueError(f"k must have shape {want['k']} (the cache's), got {list(k.shape)}")
    if v is not None and vs != (B, S, H_kv, V):
        raise ValueError(f"v must have shape {want['v']} (the cache's), got {list(v.shape)}")
    if qs[0] != B or qs[1] != S or qs[3] != K:
        raise ValueError(f"q must have shape {want['q']}, got {list(q.shape)}")
    if qs[2] == 0 or qs[2] % H_kv:
        raise ValueError(f"query heads H must be a positive multiple of H_kv = {H_kv}, got H = {qs[2]}")
    for name, x in given:
        if np.dtype(x.dtype) != np.dtype(cache.dtype):
            raise TypeError(f"{name} must have the cache's dtype {np.dtype(cache.dtype).name}, "
                            f"got {np.dtype(x.dtype).name}")
    return S


def _resolve(backend, cache: HTreeCache, num_heads: int, config: HTreeConfig) -> str:
    """The concrete decode backend (`htree_jax.backends.decode_backend`: the rule of
    `htree_attention`, with the decode kernels' limits)."""
    K, V = cache.keys[0].shape[-1], cache.v_dim
    latent_half = None
    if cache.values_from_keys:
        latent_half = (K - (config.partial_rope(K) or K)) // 2
    return decode_backend(backend, K, V, num_heads // cache.num_kv_heads, latent_half, config)


def check_decode_block_sizes(block_sizes) -> None:
    """`block_sizes` must be a `DecodeBlockSizes` or None."""
    if block_sizes is not None and not isinstance(block_sizes, DecodeBlockSizes):
        raise TypeError(f"block_sizes must be an htree_jax.DecodeBlockSizes or None, got {type(block_sizes).__name__}")


def _attend_cache(q, cache: HTreeCache, positions, config: HTreeConfig, impl: str, block_sizes, rank_rows=None,
                  chosen=()):
    if jax.device_count() > 1:
        # A cache sharded along the batch or the kv heads: one local walk per shard.
        return partitioned_cache_attention(q, cache.tree, positions, config, impl, block_sizes, rank_rows)
    return attend_cache(q, cache.tree, positions, config, impl, block_sizes=block_sizes, rank_rows=rank_rows,
                        chosen=chosen)


def _block_attend(q, cache: HTreeCache, positions, counts, rank_rows, config: HTreeConfig, impl: str, block_sizes):
    """Block selection on the decode kernels (SPEC 12, decoding): `(o, selections)` of
    the new queries, each keeping its block's selection of every layer above 0. The
    ranking rows walk (`rank_cache`) for a prompt, and for one token a row only where
    some row's token starts a block; otherwise each row's token is in the block of the
    cache's newest token, whose selection `cache.selections` holds, and the step is one
    launch (`kept_step_pallas`) where it takes the shape, else the walk keeping it."""
    def walk():  # `attend_cache` ranks (`rank_cache`), then keeps what the ranking rows kept
        return _attend_cache(q, cache, positions, config, impl, block_sizes, rank_rows)

    if positions.shape[1] > 1 or not cache.selections or jax.device_count() > 1:
        # A sharded cache walks each shard's rows on the kernels (`partitioned_cache_attention`):
        # a token inside its block ranks again on its block's rows, which picks what they kept.
        return walk()
    kept = tuple(cache.selections)
    B, _, H, K = q.shape

    def keep():
        if kept_merge_dims(config, H // cache.num_kv_heads, K, cache.v_dim, q.dtype, cache.fp8_tokens,
                           cache.values_from_keys):
            o = kept_step_pallas(q[:, 0], cache.keys, cache.values, positions[:, 0], kept, config,
                                 block_sizes or DecodeBlockSizes(), interpret=impl == "pallas_interpret")
            return o[:, None], [x[:, None] for x in kept]
        o, selected = _attend_cache(q, cache, positions, config, impl, block_sizes, rank_rows,
                                    tuple(x[:, None] for x in kept))
        return o, list(selected)

    starts = jnp.any((positions[:, 0] % config.selection_block == 0) & (counts > 0))
    o, selected = jax.lax.cond(starts, lambda: tuple(walk()), keep)
    return o, list(selected)


def _newest_selections(cache: HTreeCache, selected, counts):
    """`cache.selections` after a call: each row's newest token's (`selected`, the
    call's, `[B, S, H_kv, top_k]` per layer), unchanged where a row appended nothing."""
    newest = jnp.maximum(counts - 1, 0)[:, None, None, None]
    take = lambda x: jnp.take_along_axis(x, newest, axis=1)[:, 0]
    return tuple(jnp.where(counts[:, None, None] > 0, take(x), old) for x, old in zip(selected, cache.selections))


def _query_history(q, cache: HTreeCache):
    """Block selection (SPEC 12): each row's recent queries (those before the call, oldest
    first) followed by the call's `q [B, S, H, K]`, `[B, P + S, H_kv, G, K]`; None
    without block selection."""
    if not cache.queries:
        return None
    recent = cache.queries[0]  # [B, P, H_kv, G, K]
    return jnp.concatenate([recent, q.reshape(q.shape[:2] + recent.shape[2:]).astype(recent.dtype)], axis=1)


def _ranking_rows(history, cache: HTreeCache, positions, config: HTreeConfig):
    """Each new query's ranking rows `[B, S, H_kv, R, K]` from `_query_history`'s `history`."""
    # A query's own row: P + its position's offset in the call (padding positions repeat the last real one).
    own = cache.queries[0].shape[1] + positions - cache.lengths[:, None]
    return jax.lax.stop_gradient(block_rows(history, own, positions, config))


def _tree_writer(impl: str, cache: HTreeCache, S: int, config: HTreeConfig):
    """The Pallas append (`append_token_pallas`: the token and every layer's changed node
    in one launch) for one token a row with the Pallas backends, one device and no FP8
    tokens; else None (`append_to_cache`'s XLA scatters)."""
    if impl not in ("pallas", "pallas_interpret") or S != 1 or cache.scales or jax.device_count() > 1:
        return None
    return functools.partial(append_token_pallas, r=config.compression_rate, interpret=impl == "pallas_interpret")


@functools.partial(jax.jit, static_argnames=("config", "return_selected", "impl", "block_sizes"),
                   donate_argnames=("cache",))
def _prefill(q, k, v, cache, counts, config, return_selected, impl, block_sizes=None):
    """Rows append `counts [B]` tokens; a row that would overflow appends none and answers
    NaN (SPEC 9); outputs at a row's padding positions (`s >= counts[b]`) are 0."""
    B, S = q.shape[:2]
    fits = cache.lengths + counts <= cache.max_len  # [B]
    counts = jnp.where(fits, counts, 0)
    s = jnp.arange(S, dtype=jnp.int32)
    real = s[None, :] < counts[:, None]  # [B, S]
    # Padding positions attend as the row's last real token would (a valid position).
    positions = cache.lengths[:, None] + jnp.minimum(s[None, :], jnp.maximum(counts[:, None] - 1, 0))
    positions = jnp.minimum(positions, cache.max_len - 1)
    history = _query_history(q, cache)
    rank_rows = None
    if history is not None:  # block selection: rank with the recent queries, then move them on
        rank_rows = _ranking_rows(history, cache, positions, config)
        cache = dataclasses.replace(cache, queries=(with_recent(history, counts, cache.queries[0].shape[1]),))
    cache = append_to_cache(cache, k, v, config, counts, _tree_writer(impl, cache, S, config))
    if history is not None and impl != "reference":
        o, selected = _block_attend(q, cache, positions, counts, rank_rows, config, impl, block_sizes)
    else:
        o, selected = _attend_cache(q, cache, positions, config, impl, block_sizes, rank_rows)
    if history is not None:  # the newest token's block selection, for the next tokens of its block
        cache = dataclasses.replace(cache, selections=_newest_selections(cache, selected, counts))
    answer = jnp.where(fits, 0.0, jnp.nan).astype(o.dtype)  # padding: 0; a row that overflows: NaN
    o = jnp.where((real & fits[:, None])[..., None, None], o, answer[:, None, None, None])
    selected = [jnp.where(real[..., None, None], x, -1) for x in selected]
    return (o, cache, selected) if return_selected else (o, cache)


def prefill(q, k, v, cache: HTreeCache, config: HTreeConfig | None = None, *, lengths=None, backend: str = "auto",
            return_selected: bool = False, block_sizes: DecodeBlockSizes | None = None):
    """Appends up to `S` tokens per row (`q [B, S, H, K]`, `k [B, S, H_kv, K]`, `v [B, S,
    H_kv, V]` or None for a cache made with `values_from_keys=True`; un-rotated, the
    cache's dtype), row `b` its first `lengths[b]` (`lengths`
    int `[B]`, right-padded prompts; `None`: all `S`), at that row's own length, and
    attends with their queries. Returns `(o [B, S, H, V], cache)` (and the selections,
    as `htree_attention` returns them, with `return_selected=True`); row `b`'s outputs
    at `s < lengths[b]` equal its full-sequence output at those positions, the padding
    positions give 0 (selections `-1`).

    A row that would grow past `max_len` raises `ValueError` when the lengths are
    concrete (an eager call); under `jit` it appends nothing and its outputs are NaN
    (SPEC 9), with no host callback or sync. Works at any cache length; jittable; the
    cache argument is donated: use the returned one (a donated cache passed again is
    refused with an error that says so). `backend`: `"reference"` (the jittable JAX
    walk, every platform), `"pallas"` (the Pallas decode kernels,
    `pallas_kernels/decode/walk.py`: CUDA GPUs, K in [32, 576] a multiple of 32, V in [32,
    512] a multiple of 16; up to 16 query heads per kv head, or a multiple of 16 up to
    128), `"pallas_interpret"` (the same kernels interpreted, any
    platform) or `"auto"` (`"pallas"` on a GPU where the dims allow, else `"reference"`).
    Block selection (SPEC 12) on the kernels: one device, at most 128 ranking rows a kv
    head (`backends.check_block_decode_dims`); the cache keeps each row's block selection
    (`HTreeCache.selections`), which the steps inside a block reuse.
    `block_sizes`: the Pallas decode kernels' `DecodeBlockSizes` (None: the defaults)."""
    config = check_decode_config(config)
    check_cache(cache, config)
    config = fitted_to_length(config, cache.max_len)  # one layer: the same function, buffers of its tokens
    S = _check_tokens(cache, q, k, v, step=False)
    check_query_heads(cache, q.shape[2])
    check_decode_block_sizes(block_sizes)
    counts = check_lengths(lengths, cache.batch_size, S)
    impl = _resolve(backend, cache, q.shape[2], config)
    check_room(cache, counts)
    q, k = rotation_layout(q, k, config)
    return _prefill(q, k, v, cache, counts, config, return_selected, impl, block_sizes)


def rotation_layout(q, k, config: HTreeConfig):
    """q and k in `rope.rope_layout` (SPEC 7's partial RoPE; the cache keeps its keys in
    it), after checking `rope_dim <= K`."""
    K = q.shape[-1]
    config.check_rope_dim(K)
    R = config.partial_rope(K)
    return rope_layout(jnp.asarray(q), R), rope_layout(jnp.asarray(k), R)


def decode_step(q_t, k_t, v_t, cache: HTreeCache, config: HTreeConfig | None = None, *, backend: str = "auto",
                block_sizes: DecodeBlockSizes | None = None):
    """One token per batch row, at that row's own length: `q_t [B, H, K]`, `k_t [B, H_kv,
    K]`, `v_t [B, H_kv, V]` (None for a cache that reads the values from the keys).
    Returns `(o_t [B, H, V], cache)`; each row equals `htree_attention` on its own whole
    sequence at that position (strict causality). `backend`, `block_sizes` and the overflow rule as in `prefill`."""
    config = check_decode_config(config)
    check_cache(cache, config)
    config = fitted_to_length(config, cache.max_len)
    _check_tokens(cache, q_t, k_t, v_t, step=True)
    check_query_heads(cache, q_t.shape[1])
    check_decode_block_sizes(block_sizes)
    impl = _resolve(backend, cache, q_t.shape[1], config)
    counts = jnp.ones((cache.batch_size,), jnp.int32)
    check_room(cache, np.ones((cache.batch_size,), np.int32))
    q_t, k_t = rotation_layout(q_t, k_t, config)
    v = None if v_t is None else v_t[:, None]
    o, cache = _prefill(q_t[:, None], k_t[:, None], v, cache, counts, config, False, impl, block_sizes)
    return o[:, 0], cache
