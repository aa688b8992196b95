"""The index arithmetic of the spec (docs/SPEC.md sections 2.1 and 2.3): which nodes a
query's candidate buffer holds, how many are valid, the top layer's virtual parents, and
the bit-packed keys of the stable top-K order.

Plain integer arithmetic and `lax` bit operations on NumPy or JAX arrays, so the JAX
reference, the Pallas kernels (inside and outside a kernel) and the decode walk share
one copy of it.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def num_top_parents(t, r: int, num_layers: int):
    """SPEC 2: the top layer's virtual parents are `0 .. floor(i*_{L-1} / r)`: this many.
    Plain arithmetic (Python, NumPy or JAX integers)."""
    return t // r ** (num_layers - 1) // r + 1


def top_layer_parents(t, r: int, num_layers: int, width: int):
    """The top layer's virtual parents as a padded list: `t [...]` int -> `[..., width]`
    int32, slot `s` holding node `s` while `s < num_top_parents(t)`, `-1` after."""
    slot = jnp.arange(width, dtype=jnp.int32)
    return jnp.where(slot < num_top_parents(jnp.asarray(t)[..., None], r, num_layers), slot, -1).astype(jnp.int32)


def num_parents(parents):
    """Length of each padded parent list `[..., P]` (`-1` padded): `[..., 1]`."""
    return jnp.sum(parents >= 0, axis=-1, keepdims=True, dtype=jnp.int32)


def candidate_count(parent_count, t, r: int, layer: int):
    """SPEC 2.1: valid candidates `n = (n_P - 1) * r + c* + 1`, with `c* = (t // r^l) mod r`
    and `n_P = parent_count`.

    Plain arithmetic, so it serves NumPy and JAX arrays alike (any broadcastable shapes).
    """
    return (parent_count - 1) * r + (t // r**layer) % r + 1


def candidate_nodes(parents, positions, r: int):
    """SPEC 2.1: buffer position `p = s*r + c` holds node `parents[s]*r + c`.
    `parents [..., P]`, `positions [M]` -> `[..., M]` (garbage where the slot is `-1`:
    the caller masks positions `>= n`)."""
    return parents[..., positions // r] * r + positions % r


def pack_importance(importance, positions, log_n: int):
    """SPEC 2.3 stable order: float32 bits, low `log_n` bits replaced by `~p`, as int32.

    Keys compare as integers (order-preserving for importance >= 0, and immune to
    denormal flushing); ties in the kept high bits go to the smaller position. A NaN
    importance (scores that overflowed, SPEC 10) packs as 0: its bits would compare above
    the forced rightmost node's and push the node holding `t` out of the selection.
    Plain `lax` bit operations, so the kernels use it as it is.
    """
    mask = (1 << log_n) - 1
    importance = importance.astype(jnp.float32)
    importance = jnp.where(jnp.isnan(importance), 0.0, importance)
    bits = lax.bitcast_convert_type(importance, jnp.int32)
    return (bits & ~mask) | (mask - positions)
