"""The decode cache (SPEC 3, SPEC 9): `HTreeCache`, the tree of every row's tokens so far
in buffers sized for `max_len`, made by `init_cache`, grown by `append_to_cache` (what
`prefill` and `decode_step` call), and `reset_rows` for rows that start a new sequence.

The tree has the layers of `config.layer_sizes(max_len)` from the start (static shapes).
With `strict_causal=True` (the default) that changes no output: a query's output does
not depend on tokens after it, nor on the number of layers (SPEC 3), so decoding token
by token reproduces `htree_attention` on the full sequence, position by position.

Appending `S` tokens rewrites, per layer `l >= 1`, only the nodes whose children
changed (at most `ceil((S - 1) / r**l) + 1`), each the mean of its existing children read
back from the layer below: `r` stored children, summed in order in float32 and scaled by
the reciprocal of their count, exactly as `build_tree` does, so the cache's tree equals `build_tree`
of the prefix bit for bit, ragged last nodes included. An append past `max_len` raises
when the lengths are concrete (an eager call); under `jit` that row's cache rows are
left as they were (`decode_step` gives it NaN outputs).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from htree_jax.core.blocks import recent_queries
from htree_jax.core.one_layer import fitted_to_length
from htree_jax.core.bounds import children_radii, num_groups
from htree_jax.core.config import HTreeConfig
from htree_jax.core.quantize import FP8, dequantize_rows, is_fp8, quantize_rows
from htree_jax.core.tree import CacheTree, child_reciprocals, round_to_storage
from htree_jax.core.validation import check_config, check_dtype, check_latent_value_dim


@functools.partial(jax.tree_util.register_dataclass, data_fields=["keys", "values", "lengths", "radii", "scales", "queries",
                                                                "selections"],
                   meta_fields=["value_dim", "compute_dtype"])
@dataclasses.dataclass(frozen=True)
class HTreeCache:
    """The decode cache: the tree of every row's tokens so far, in buffers sized for `max_len`.

    keys:    per layer `l` (bottom first) `[B, N_l, H_kv, K]`, `N_l = config.layer_sizes(max_len)[l]`,
             in the cache dtype; nodes not yet reached are zero.
    values:  per layer `[B, N_l, H_kv, V]`; `()` where the values are the keys' first
             `value_dim` latent features (`init_cache(..., values_from_keys=True)`).
    radii:   with `selection="bound"` (SPEC 11), per layer `l >= 1` the nodes' radii
             float32 `[B, N_l, H_kv, n_groups]` (layer 0's are 0: not stored); else `()`.
    lengths: int32 `[B]`, the tokens each row holds (rows are independent sequences).
    scales:  with FP8 tokens (`init_cache(..., token_dtype=jnp.float8_e4m3fn)`), layer 0's
             keys (and values) are e4m3 and these are their float32 per-row scales
             `[B, H_kv, N_0]` (keys', then values' unless the values are the keys';
             heads first, so a parent's children's scales are adjacent for the kernels),
             `htree_jax.core.quantize`; else `()`. The tree's nodes (layers >= 1) stay in
             the compute dtype (`compute_dtype`, the dtype of q, k, v).
    queries: with block selection (SPEC 12, `config.selection_block = b > 1`), the last
             `2b` queries of each row `[B, 2b, H_kv, G, K]` (rotation layout, the
             compute dtype), oldest first, zero before a row's first token: the ranking
             rows of the next tokens' blocks (`htree_jax.core.blocks`); else `()`.
    selections: with block selection, per layer above 0 (top first) the nodes each
             row's newest token kept, int32 `[B, H_kv, top_k]` (ascending, `-1`
             padded; `-1` before a row's first token): the selection of every later
             token of its block (SPEC 12, decoding), which the decode kernels reuse
             instead of walking again; else `()`.

    A NaN or infinity appended at position `p` stays in the tree (SPEC 10): no output
    before `p` reads it (every merge zeroes the values it does not merge, and the node
    holding `p` is, before `p`, a rightmost candidate: kept, and left out of the
    normaliser), and every output from `p` on does, as in dense attention.
    """

    keys: tuple
    values: tuple
    lengths: jax.Array
    radii: tuple = ()
    # > 0: no values stored; they are the first `value_dim` unrotated features of the keys
    # (DeepSeek's absorbed form: one latent row per token, read once for both).
    value_dim: int = 0
    scales: tuple = ()
    # With FP8 tokens: the name of the dtype the cache computes in (q, k, v and the
    # tree's nodes); "" where that is the tokens' own dtype.
    compute_dtype: str = ""
    queries: tuple = ()
    selections: tuple = ()

    @property
    def values_from_keys(self) -> bool:
        return self.value_dim > 0

    @property
    def tree(self) -> CacheTree:
        """The tree the attention over the cache reads (`core.tree.CacheTree`)."""
        return CacheTree(tuple(self.keys), tuple(self.values), tuple(self.radii), tuple(self.scales), self.value_dim)

    @property
    def fp8_tokens(self) -> bool:
        return bool(self.scales)

    @property
    def v_dim(self) -> int:
        return self.value_dim or self.values[0].shape[-1]

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[1]

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.keys[0].shape[2]

    @property
    def dtype(self):
        """The dtype of q, k, v and of the tree's nodes (the tokens' too unless FP8)."""
        return np.dtype(self.compute_dtype) if self.compute_dtype else self.keys[0].dtype


def _positive_int(name, x) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1:
        raise ValueError(f"{name} must be a positive int, got {x!r}")
    return int(x)


def init_cache(batch_size: int, max_len: int, num_kv_heads: int, k_dim: int, v_dim: int,
               config: HTreeConfig | None = None, dtype=jnp.float32, *, values_from_keys: bool = False,
               token_dtype=None, num_heads: int | None = None) -> HTreeCache:
    """An empty cache for up to `max_len` tokens (the layers of `config.layer_sizes(max_len)`).
    `values_from_keys=True` (DeepSeek's absorbed form, as `htree_attention(q, k, None,
    value_dim=v_dim)`): no values are stored, they are the first `v_dim` unrotated
    features of each key (`v_dim <= k_dim - config.rope_dim`); `prefill` and
    `decode_step` then take `v=None`.

    `token_dtype=jnp.float8_e4m3fn`: the tokens' keys and values (layer 0, nearly all of
    the cache's bytes) are stored in e4m3 with a float32 scale per token and kv head
    (`htree_jax.core.quantize`), the tree's nodes in `dtype` (16-bit): (K + 4) / 2K of
    the tokens' bytes. Such a cache decodes what a `dtype` cache of the tokens as read
    back in `dtype` decodes (the same tree and selections; the kernels scale each
    token's score and weight in float32 where the reference rounds the token). Against
    a `dtype` cache of the tokens themselves (e4m3 keeps 3 mantissa bits: each feature
    within 1/16 of itself): within 0.05 relative RMS of the outputs where every token is
    attended exactly, where the walk selects within 0.25 with the mean and 0.3 with the
    bound (its radii move with the rounding too), as near ties flip (random normal
    tokens, `tests/test_fp8_cache.py`). `None`: the tokens in `dtype`.

    `num_heads`: the query heads `H` (a multiple of `num_kv_heads`), needed with block
    selection (SPEC 12, `config.selection_block > 1`), where the cache keeps each row's
    last `2 * selection_block` queries: the rows that rank for the next tokens' blocks."""
    config = check_decode_config(config)
    B = _positive_int("batch_size", batch_size)
    T = _positive_int("max_len", max_len)
    config = fitted_to_length(config, T)  # a one-layer cache is sized by its tokens, not by top_k
    H_kv = _positive_int("num_kv_heads", num_kv_heads)
    K = _positive_int("k_dim", k_dim)
    V = _positive_int("v_dim", v_dim)
    if K % 2:
        raise ValueError(f"k_dim must be even (htree applies rotate-half RoPE), got {K}")
    check_dtype("dtype", np.dtype(dtype))
    fp8 = token_dtype is not None
    if fp8 and not is_fp8(token_dtype):
        raise ValueError(f"token_dtype must be None or jnp.float8_e4m3fn (e4m3 tokens with per-token scales), got "
                         f"{token_dtype!r}")
    if fp8 and np.dtype(dtype).itemsize != 2:
        raise ValueError(f"token_dtype=float8_e4m3fn needs a 16-bit dtype (bfloat16 or float16) for the tree and "
                         f"the queries, got dtype {np.dtype(dtype).name}")
    if not isinstance(values_from_keys, bool):
        raise TypeError(f"values_from_keys must be a bool, got {type(values_from_keys).__name__}")
    if values_from_keys:
        check_latent_value_dim(V, K, config)
    queries = ()
    if config.selects_by_block:
        if num_heads is None:
            raise ValueError(f"init_cache needs num_heads (the query heads) with config.selection_block="
                             f"{config.selection_block}: block selection (SPEC 12) keeps each row's recent queries")
        H = _positive_int("num_heads", num_heads)
        if H % H_kv:
            raise ValueError(f"num_heads must be a multiple of num_kv_heads = {H_kv}, got {H}")
        queries = (jnp.zeros((B, recent_queries(config), H_kv, H // H_kv, K), dtype),)
    elif num_heads is not None:
        _positive_int("num_heads", num_heads)
    sizes = config.layer_sizes(T)
    layer_dtype = lambda l: FP8 if fp8 and l == 0 else dtype
    keys = tuple(jnp.zeros((B, n, H_kv, K), layer_dtype(l)) for l, n in enumerate(sizes))
    values = () if values_from_keys else tuple(jnp.zeros((B, n, H_kv, V), layer_dtype(l)) for l, n in enumerate(sizes))
    scales = tuple(jnp.zeros((B, H_kv, T), jnp.float32) for _ in range(1 if values_from_keys else 2)) if fp8 else ()
    radii = ()
    if config.ranks_by_bound:
        config.check_rope_dim(K)
        groups = num_groups(K, config.partial_rope(K))
        radii = tuple(jnp.zeros((B, n, H_kv, groups), jnp.float32) for n in sizes[1:])
    selections = tuple(jnp.full((B, H_kv, config.top_k), -1, jnp.int32) for _ in sizes[1:]) if queries else ()
    return HTreeCache(keys, values, jnp.zeros((B,), jnp.int32), radii, V if values_from_keys else 0, scales,
                      np.dtype(dtype).name if fp8 else "", queries, selections)


def check_cache(cache, config: HTreeConfig) -> None:
    if not isinstance(cache, HTreeCache):
        raise TypeError(f"cache must be an HTreeCache (from init_cache), got {type(cache).__name__}")
    deleted = [x for x in jax.tree_util.tree_leaves(cache)
               if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted()]
    if deleted:
        raise ValueError(
            "cache: its buffers were donated to an earlier prefill/decode_step call (which updates the "
            "cache in place) and are gone; pass the cache that call returned: "
            "`o, cache = decode_step(q_t, k_t, v_t, cache, config)`"
        )
    lengths = cache.lengths
    if getattr(lengths, "shape", None) != (cache.batch_size,) or np.dtype(lengths.dtype) != np.int32:
        raise ValueError(f"cache.lengths must be int32 [B] = [{cache.batch_size}], got "
                         f"{getattr(lengths, 'dtype', type(lengths).__name__)} {list(getattr(lengths, 'shape', ()))}")
    if len(cache.values) != (0 if cache.values_from_keys else len(cache.keys)):
        raise ValueError("cache: its values do not match its value_dim (a cache from init_cache stores values per "
                         "layer, or none with values_from_keys=True)")
    if cache.values_from_keys:  # the config must leave that many unrotated features
        check_latent_value_dim(cache.value_dim, cache.keys[0].shape[-1], config)
    if cache.fp8_tokens:
        want = (cache.batch_size, cache.num_kv_heads, cache.max_len)
        if (len(cache.scales) != (1 if cache.values_from_keys else 2)
                or any(x.shape != want or np.dtype(x.dtype) != np.float32 for x in cache.scales)
                or any(not is_fp8(x.dtype) for x in (cache.keys[0],) + cache.values[:1]) or not cache.compute_dtype):
            raise ValueError(f"cache: its FP8 tokens need float32 scales {list(want)} for the keys (and values) "
                             "and a compute dtype; make the cache with init_cache(..., token_dtype=jnp.float8_e4m3fn)")
    sizes = config.layer_sizes(cache.max_len)
    got = tuple(k.shape[1] for k in cache.keys)
    # The layers first: a config of another compression_rate or top_k has another layer
    # count, and so another count of radii too, which is not another selection rule.
    if got != sizes:
        raise ValueError(
            f"cache: its layers {got} are not those of config for max_len={cache.max_len} {sizes} "
            f"(compression_rate={config.compression_rate}, top_k={config.top_k}); use the config the cache was "
            "made with"
        )
    if len(cache.radii) != (len(sizes) - 1 if config.ranks_by_bound else 0):
        raise ValueError(f"cache: made for another selection rule than config.selection={config.selection!r}; use "
                         "the config the cache was made with")
    P = recent_queries(config)
    fits = lambda x: x.shape[:3] == (cache.batch_size, P, cache.num_kv_heads) and x.shape[-1] == cache.keys[0].shape[-1]
    if len(cache.queries) != (1 if P else 0) or not all(fits(x) for x in cache.queries):
        raise ValueError(f"cache: made for another selection_block than config.selection_block="
                         f"{config.selection_block}; use the config the cache was made with")
    kept = (cache.batch_size, cache.num_kv_heads, config.top_k)
    if (len(cache.selections) != (len(sizes) - 1 if P else 0)
            or any(x.shape != kept or np.dtype(x.dtype) != np.int32 for x in cache.selections)):
        raise ValueError(f"cache: its block selections do not fit config (selection_block={config.selection_block}, "
                         f"top_k={config.top_k}: int32 {list(kept)} per layer above 0); use the config the cache "
                         "was made with")


def check_query_heads(cache: HTreeCache, num_heads: int) -> None:
    """A block-selection cache keeps `H` query heads: the new queries must have as many."""
    kept = cache.queries[0].shape[2] * cache.queries[0].shape[3] if cache.queries else num_heads
    if kept != num_heads:
        raise ValueError(f"q must have the {kept} heads of the cache (init_cache's num_heads), got {num_heads}: "
                         "block selection ranks with the cache's recent queries")


def _concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_lengths(lengths, batch_size: int, S: int):
    """`prefill`'s `lengths` (`None`: every row `S`): int `[B]`, each in `[0, S]`. Returns
    them as int32. Checked on the host when concrete (an eager call)."""
    if lengths is None:
        return jnp.full((batch_size,), S, jnp.int32)
    if not hasattr(lengths, "shape"):
        lengths = np.asarray(lengths)
    if lengths.shape != (batch_size,) or not np.issubdtype(np.dtype(lengths.dtype), np.integer):
        raise ValueError(f"lengths must be an int array of shape [B] = [{batch_size}] (each row's prompt length), "
                         f"got {np.dtype(lengths.dtype).name} {list(lengths.shape)}")
    if _concrete(lengths):
        values = np.asarray(lengths)
        if np.any(values < 0) or np.any(values > S):
            raise ValueError(f"lengths must be in [0, S] = [0, {S}] (the prompts are right-padded to S tokens), "
                             f"got {values.tolist()}")
    return jnp.asarray(lengths, jnp.int32)


def check_room(cache: HTreeCache, added) -> None:
    """SPEC 9: no row grows past `max_len`. Raised here when the lengths are concrete (an
    eager call); under `jit` the step itself gives an overflowing row NaN outputs and
    leaves its cache rows as they were (no host callback, no sync)."""
    if not (_concrete(cache.lengths) and _concrete(added)):
        return
    have, add = np.asarray(cache.lengths), np.asarray(added)
    over = np.nonzero(have + add > cache.max_len)[0]
    if over.size:
        b = int(over[0])
        raise ValueError(
            f"cache overflow: appending {int(add[b])} token(s) to row {b} holding {int(have[b])} of "
            f"max_len={cache.max_len} ({over.size} row(s) would overflow); make the cache with a larger max_len, "
            "or start those rows anew with reset_rows"
        )


def reset_rows(cache: HTreeCache, rows) -> HTreeCache:
    """The cache with the rows where `rows [B]` (bool) is True emptied: their length is
    0 and their tree zero, so their next tokens start a new sequence while the other
    rows go on (a continuous-batching server reuses a finished row). Jittable."""
    rows = jnp.asarray(rows)
    if rows.shape != (cache.batch_size,) or rows.dtype != jnp.bool_:
        raise ValueError(f"rows must be a bool array of shape [B] = [{cache.batch_size}], got "
                         f"{np.dtype(rows.dtype).name} {list(rows.shape)}")
    clear = lambda x: jnp.where(rows.reshape((-1,) + (1,) * (x.ndim - 1)), jnp.zeros((), x.dtype), x)
    return HTreeCache(tuple(map(clear, cache.keys)), tuple(map(clear, cache.values)),
                      jnp.where(rows, 0, cache.lengths).astype(jnp.int32), tuple(map(clear, cache.radii)),
                      cache.value_dim, tuple(map(clear, cache.scales)), cache.compute_dtype,
                      tuple(map(clear, cache.queries)),
                      tuple(jnp.where(rows[:, None, None], -1, x) for x in cache.selections))


def _set_rows(layer, index, rows):
    """`layer.at[index].set(rows, mode="drop")` on the bit patterns: XLA widens a 16-bit
    float scatter to float32 (a float32 copy of the whole cache layer per step: 18 GiB
    of keys at B=64, T=131072, K=576); an integer scatter of the same bits is in place."""
    bits = jnp.dtype(f"uint{8 * layer.dtype.itemsize}")
    as_bits = lambda x: jax.lax.bitcast_convert_type(x.astype(layer.dtype), bits)
    return jax.lax.bitcast_convert_type(as_bits(layer).at[index].set(as_bits(rows), mode="drop"), layer.dtype)


def _append_row(arrays, start, k, v, count, r: int, rope_dim):
    """One row of the cache's `arrays = (keys, values, radii, scales)`: appends the first
    `count` of `k [S, H_kv, K]`, `v [S, H_kv, V]` at `start` and updates the tree above
    them (layers `[N_l, H_kv, D]`), and the radii of
    the rewritten nodes where `radii` holds them (SPEC 11: `rho_i = max over the existing
    children of rho_j + ||K_j - K_i||`, from the stored keys, as `core.bounds` computes
    them for a whole tree). `scales` (FP8 tokens, `[H_kv, N_0]` each): the tokens are
    stored quantized, and the nodes above them are those of the tokens as read back
    in the nodes' dtype (the tree is `build_tree` of those tokens, bit for bit).
    `count = 0` changes nothing (the nodes it rewrites get their own values back)."""
    S = k.shape[0]
    keys, values, radii, scales = (list(x) for x in arrays)
    s = jnp.arange(S, dtype=jnp.int32)
    positions = jnp.where(s < count, start + s, keys[0].shape[0])  # past the layer: dropped
    for i, (layer, rows) in enumerate(((keys, k), (values, v))[:2 if values else 1]):
        # (no values: they are the keys' latent features, `HTreeCache.value_dim`)
        if scales:
            rows, scale = quantize_rows(rows)
            scales[i] = scales[i].at[:, positions].set(scale.T, mode="drop")  # float32: in place
        layer[0] = _set_rows(layer[0], positions, rows)
    for l in range(1, len(keys)):
        nodes, children, exists = _rewritten_nodes(start, count, S, r, l, keys[l].shape[0])
        count_children = jnp.sum(exists, axis=1)  # [W]
        reciprocal = jnp.asarray(child_reciprocals(r))[jnp.maximum(count_children, 1) - 1]
        for i, layer in enumerate((keys, values)[:2 if values else 1]):
            rows = _children_of(i, layer, l, scales, children)  # [W, r, H, D]
            rows = jnp.where(exists[:, :, None, None], rows, 0.0)
            sums = rows[:, 0]
            for c in range(1, r):
                sums = sums + rows[:, c]
            means = sums * reciprocal[:, None, None]
            means = jnp.where((count_children > 0)[:, None, None], means, 0.0)
            # nodes past the layer's end are dropped (their index is out of range)
            layer[l] = _set_rows(layer[l], nodes, round_to_storage(means, layer[l].dtype))
    return tuple(keys), tuple(values), _append_radii(keys, radii, scales, start, count, S, r, rope_dim), tuple(scales)


def _rewritten_nodes(start, count, S: int, r: int, l: int, N_l: int):
    """`(nodes [W], children [W, r], exists [W, r])` of layer `l` an append of `count` of
    `S` tokens at `start` rewrites: the nodes whose children changed (those S positions
    can meet: one for one token), their children's indices, which of them exist."""
    width = min(N_l, -(-(S - 1) // r**l) + 1)
    nodes = start // r**l + jnp.arange(width, dtype=jnp.int32)
    existing_below = (start + count + r ** (l - 1) - 1) // r ** (l - 1)
    children = nodes[:, None] * r + jnp.arange(r, dtype=jnp.int32)[None, :]
    return nodes, children, children < existing_below


def _children_rows(layer, children):
    return layer[jnp.minimum(children, layer.shape[0] - 1)]


def _children_of(i: int, layer, l: int, scales, children):
    """The children rows `[W, r, H, D]` float32 of layer `l` (`layer` the array's layers);
    FP8 tokens (`scales`) as read back in the nodes' dtype."""
    if l == 1 and scales:
        scale = jnp.moveaxis(scales[i][:, jnp.minimum(children, scales[i].shape[1] - 1)], 0, -1)  # [W, r, H]
        return dequantize_rows(_children_rows(layer[0], children), scale, layer[1].dtype).astype(jnp.float32)
    return _children_rows(layer[l - 1], children).astype(jnp.float32)


def _append_radii(keys, radii, scales, start, count, S: int, r: int, rope_dim):
    """One row's radii of the nodes an append rewrote (SPEC 11), from the stored keys
    after the append (`keys` the updated layers), layer by layer up; `()` without radii."""
    radii = list(radii)
    if not radii:
        return ()
    for l in range(1, len(keys)):
        nodes, children, exists = _rewritten_nodes(start, count, S, r, l, keys[l].shape[0])
        below = _children_rows(radii[l - 2], children) if l > 1 else 0.0  # layer 0's radii are 0
        stored = keys[l][jnp.minimum(nodes, keys[l].shape[0] - 1)]
        rho = children_radii(_children_of(0, keys, l, scales, children), below, stored, exists, rope_dim)
        radii[l - 1] = _set_rows(radii[l - 1], nodes, rho)
    return tuple(radii)


def append_to_cache(cache: HTreeCache, k, v, config: HTreeConfig, counts=None, tree_writer=None) -> HTreeCache:
    """Appends, per row `b`, the first `counts[b]` tokens (`None`: all `S`) of `k [B, S,
    H_kv, K]`, `v [B, S, H_kv, V]` (validated by the caller) at that row's length, and
    updates the tree above them. Bit for bit the tree `build_tree` makes of each row's
    tokens. `tree_writer(layers, tokens, lengths, counts) -> layers` (one token a row,
    a cache without FP8 tokens): writes the tokens and the nodes above them in its own
    way (`pallas_kernels.decode.append.append_token_pallas`; `layers` and `tokens` per array,
    keys then values); the radii are then this module's, from the keys it wrote."""
    B, S = k.shape[:2]
    counts = jnp.full((B,), S, jnp.int32) if counts is None else counts
    r, rope_dim = config.compression_rate, config.partial_rope(k.shape[-1])
    if tree_writer is not None:
        if S != 1 or cache.scales:
            raise ValueError("append_to_cache: a tree_writer appends one token a row to a cache without FP8 tokens")
        tokens = (k[:, 0], v[:, 0]) if cache.values else (k[:, 0],)
        arrays = tree_writer((cache.keys, cache.values) if cache.values else (cache.keys,), tokens, cache.lengths,
                             counts)
        keys, values = arrays[0], arrays[1] if cache.values else ()
        radii = jax.vmap(functools.partial(_append_radii, S=1, r=r, rope_dim=rope_dim), in_axes=(0, 0, None, 0, 0))(
            keys, cache.radii, (), cache.lengths, counts) if cache.radii else ()
        scales = cache.scales
    else:
        append = jax.vmap(functools.partial(_append_row, r=r, rope_dim=rope_dim))
        keys, values, radii, scales = append((cache.keys, cache.values, cache.radii, cache.scales), cache.lengths, k,
                                             v, counts)
    return HTreeCache(keys, values, (cache.lengths + counts).astype(jnp.int32), radii, cache.value_dim, scales,
                      cache.compute_dtype, cache.queries, cache.selections)


def check_decode_config(config) -> HTreeConfig:
    config = check_config(config)
    if config.selection == "indexer":
        raise ValueError("selection='indexer' (SPEC 13) does not decode yet: full sequences on backend='reference' "
                         "only (the cache keeps no index keys' tree)")
    if not config.strict_causal:
        raise ValueError(
            "config.strict_causal must be True for decoding: with False a query's selection "
            "depends on tokens after it (SPEC 2.3), so no cache of the past can reproduce the "
            "full-sequence output"
        )
    return config
