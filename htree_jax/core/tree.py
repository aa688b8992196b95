"""`build_tree`: the mean-pooling tree of SPEC section 1."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from htree_jax.core.config import HTreeConfig
from htree_jax.core.validation import check_config, check_kv


def child_counts(num_children: int, compression_rate: int) -> np.ndarray:
    """Existing children of each parent of a layer with `num_children` nodes, `[ceil(N/r)]`.

    Every parent has `r` children except possibly the last (ragged) one.
    """
    num_parents = -(-num_children // compression_rate)
    counts = np.full((num_parents,), compression_rate, dtype=np.int64)
    counts[-1] = num_children - (num_parents - 1) * compression_rate
    return counts


def child_reciprocals(compression_rate: int) -> np.ndarray:
    """`1 / c` in float32 for `c = 1 .. r`: a mean is the float32 sum of the children times
    the reciprocal of their count. A multiplication by a fixed constant is rounded the
    same way everywhere, where a division is not (XLA on the CPU turns `x / 3` into
    `x * (1/3)` in some programs and not in others), and the decode cache
    (`htree_jax.decode`) must reproduce these means bit for bit."""
    return (1.0 / np.arange(1, compression_rate + 1)).astype(np.float32)


def pool_layer(x, compression_rate: int):
    """One step up the tree: the mean of each node's existing children.

    `x [B, N, H_kv, D]` (any float dtype) -> `[B, ceil(N/r), H_kv, D]` in `x.dtype`,
    summed child by child in float32 and scaled by `child_reciprocals` (SPEC: computed in float32 from the stored layer
    below, stored in the input dtype).
    """
    B, N, H, D = x.shape
    r = compression_rate
    counts = child_counts(N, r)
    num_parents = counts.shape[0]
    x32 = x.astype(jnp.float32)
    pad = num_parents * r - N
    if pad:
        x32 = jnp.pad(x32, ((0, 0), (0, pad), (0, 0), (0, 0)))
    children = x32.reshape(B, num_parents, r, H, D)
    # Summed child by child, in order: the incremental tree of decoding
    # (`htree_jax.decode`) and the Pallas pool kernel add in this same order, so all
    # three give bitwise the same means.
    sums = children[:, :, 0]
    for c in range(1, r):
        sums = sums + children[:, :, c]
    means = sums * jnp.asarray(child_reciprocals(r)[counts - 1])[None, :, None, None]
    return round_to_storage(means, x.dtype)


def round_to_storage(x32, dtype):
    """Rounds float32 `x32` to `dtype`, guaranteed even inside one jitted computation.

    A plain `astype` is not enough: XLA's default `xla_allow_excess_precision` may drop
    a float32 -> bfloat16 -> float32 round trip inside a fusion, so a jitted consumer
    would see the unrounded float32 means and select differently from the spec (which
    stores each layer in the input dtype). `reduce_precision` is always honoured.
    """
    if jnp.dtype(dtype) != jnp.float32:
        info = jnp.finfo(dtype)
        x32 = jax.lax.reduce_precision(x32, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    return x32.astype(dtype)


def build_tree(k, v, config: HTreeConfig | None = None) -> list[tuple[jax.Array, jax.Array]]:
    """The mean-pooling tree of `k [B,T,H_kv,K]` and `v [B,T,H_kv,V]`.

    Returns `[(K_0, V_0), ..., (K_{L-1}, V_{L-1})]`, bottom layer first, with
    `K_0 = k`, `V_0 = v` and `K_l [B, N_l, H_kv, K]`, `N_l = config.layer_sizes(T)[l]`.
    Node `i` of layer `l` is the mean of children `[i*r, min(i*r + r, N_{l-1}))`.
    """
    config = check_config(config)
    dims = check_kv(k, v)
    k, v = jnp.asarray(k), jnp.asarray(v)
    layers = [(k, v)]
    for _ in config.layer_sizes(dims.seq_len)[1:]:
        k_up, v_up = layers[-1]
        layers.append((pool_layer(k_up, config.compression_rate), pool_layer(v_up, config.compression_rate)))
    return layers


@functools.partial(jax.tree_util.register_dataclass, data_fields=["keys", "values", "radii", "scales"],
                   meta_fields=["value_dim"])
@dataclasses.dataclass(frozen=True)
class CacheTree:
    """A decode cache's tree as the attention over it reads it: the per-layer `keys`
    `[B, N_l, H_kv, K]` and `values` `[B, N_l, H_kv, V]` (bottom first, un-rotated), the
    `radii` `[B, N_l, H_kv, n_groups]` of layers 1.. (`selection="bound"`, else `()`),
    FP8 tokens' row `scales` (`htree_jax.core.quantize`: layer 0's keys, and values
    unless read from the keys, e4m3 with these float32 row scales `[B, H_kv, N_0]`;
    else `()`), and `value_dim > 0` where the values are the keys' first `value_dim`
    latent features (DeepSeek's absorbed form; `values` is then `()`). A pytree whose
    `value_dim` is static."""

    keys: tuple
    values: tuple
    radii: tuple = ()
    scales: tuple = ()
    value_dim: int = 0
