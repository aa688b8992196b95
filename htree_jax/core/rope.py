"""Rotate-half RoPE (SPEC section 2.2) and its tables.

The tables are computed in float64 with NumPy and rounded once to float32, so that
every implementation (JAX reference, kernels) rotates by exactly the same cos/sin and
agrees with the float64 oracle to float32 rounding even at position 8191.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np


def rope_angles(num_positions: int, head_dim: int, base: float, rope_dim: int | None = None) -> np.ndarray:
    """`angles[p, i] = p * base**(-2i/K)`, float64 `[num_positions, K/2]`. With
    `rope_dim = R < K` (SPEC 7), for features in `rope_layout`: the first `(K-R)/2`
    pairs unrotated (angle 0), then `p * base**(-2i/R)`, `i in [0, R/2)`."""
    R = head_dim if rope_dim is None else rope_dim
    inv_freq = float(base) ** (-np.arange(0, R, 2, dtype=np.float64) / R)
    inv_freq = np.concatenate([np.zeros((head_dim - R) // 2), inv_freq])
    return np.arange(num_positions, dtype=np.float64)[:, None] * inv_freq[None, :]


@functools.lru_cache(maxsize=64)
def rope_table(num_positions: int, head_dim: int, base: float,
               rope_dim: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`(cos, sin)`, each float32 `[num_positions, K/2]`, exactly rounded from float64
    (`rope_dim`: as `rope_angles`)."""
    angles = rope_angles(num_positions, head_dim, base, rope_dim)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    cos.setflags(write=False)
    sin.setflags(write=False)
    return cos, sin


def apply_rope(x, cos, sin):
    """Rotate-half RoPE: `x [..., K]` with `cos, sin` broadcastable to `[..., K/2]`.

    `[x_lo, x_hi] -> [x_lo*cos - x_hi*sin, x_lo*sin + x_hi*cos]`.
    """
    half = x.shape[-1] // 2
    x_lo, x_hi = x[..., :half], x[..., half:]
    return jnp.concatenate([x_lo * cos - x_hi * sin, x_lo * sin + x_hi * cos], axis=-1)


def rope_permutation(head_dim: int, rope_dim: int) -> np.ndarray:
    """Partial RoPE (SPEC 7) as rotate-half RoPE: the feature order that pairs the rotated
    features `(K-R+i, K-R/2+i)` as `(j, j + K/2)` and the unrotated ones among
    themselves: `[nope_lo, rope_lo, nope_hi, rope_hi]`, `nope` the first `K-R` features
    in halves, `rope_lo/hi` the halves of the last `R`. The same order for q and k keeps
    their dot products; with `rope_angles(..., rope_dim)` the unrotated pairs get angle 0."""
    return np.concatenate([np.arange(a, b) for a, b in rope_runs(head_dim, rope_dim)])


def rope_layout(x, rope_dim: int | None):
    """`x [..., K]` in `rope_permutation` order (unchanged when `rope_dim` is None: all
    of K rotated). Every htree implementation rotates q and k in this layout."""
    if rope_dim is None:
        return x
    # Contiguous runs joined, not an index gather: under autodiff a gather's transpose
    # is a scatter-add over all of q (a large share of the MLA shape's fwd+bwd: journal,
    # 2026-11-25 (7)); a concatenate's is slices.
    return jnp.concatenate([x[..., a:b] for a, b in rope_runs(x.shape[-1], rope_dim) if b > a], axis=-1)


def rope_runs(head_dim: int, rope_dim: int) -> tuple:
    """`rope_permutation` as its four contiguous runs `(start, stop)` of the features."""
    K, R = head_dim, rope_dim
    nope = (K - R) // 2
    return (0, nope), (K - R, K - R // 2), (nope, K - R), (K - R // 2, K)


def rope_absolute(x, base: float, rope_dim: int | None = None):
    """RoPE at absolute positions for `x [B, T, H, K]` (position = index along T), on
    the last `rope_dim` features (`None`: all), `x` in `rope_layout` order."""
    cos, sin = rope_table(x.shape[1], x.shape[-1], float(base), rope_dim)
    cos, sin = jnp.asarray(cos)[None, :, None, :], jnp.asarray(sin)[None, :, None, :]
    return apply_rope(x.astype(jnp.float32), cos, sin)


def rope(x, rope_base: float = 10000.0, rope_dim: int | None = None):
    """RoPE as htree applies it, at absolute positions: `x [B, T, H, K]` (un-rotated, in
    the caller's feature order; position = index along T) -> the rotated `x` in its
    dtype. Rotate-half on the last `rope_dim` features `R` (`None`: all `K`): feature
    `K - R + i` pairs with `K - R + i + R/2` and turns by `t * rope_base**(-2i/R)`,
    `i < R/2`; the first `K - R` are left as they are (SPEC 7).

    Where the tree has one layer (`T <= top_k * compression_rate`), htree attention of
    `q, k, v` is causal softmax attention of `rope(q), rope(k), v` (the config's
    `rope_base` and `rope_dim`); interleaved RoPE (pairs `(2i, 2i+1)`) is another function."""
    K = x.shape[-1]
    R = K if rope_dim is None else rope_dim
    rotated = rope_absolute(x[..., K - R:], rope_base)
    return jnp.concatenate([x[..., :K - R].astype(jnp.float32), rotated], axis=-1).astype(x.dtype)

