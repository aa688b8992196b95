"""Rotate-half RoPE (SPEC section 2.2) and its tables.

The tables are computed in float64 with NumPy and rounded once to float32, so that
every implementation (JAX reference, kernels) rotates by exactly the same cos/sin and
agrees with the float64 oracle to float32 rounding even at position 8191.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np


def rope_angles(num_positions: int, head_dim: int, base: float) -> np.ndarray:
    """`angles[p, i] = p * base**(-2i/K)`, float64 `[num_positions, K/2]`."""
    inv_freq = float(base) ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    return np.arange(num_positions, dtype=np.float64)[:, None] * inv_freq[None, :]


@functools.lru_cache(maxsize=64)
def rope_table(num_positions: int, head_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """`(cos, sin)`, each float32 `[num_positions, K/2]`, exactly rounded from float64."""
    angles = rope_angles(num_positions, head_dim, base)
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


def rope_absolute(x, base: float):
    """RoPE at absolute positions for `x [B, T, H, K]` (position = index along T)."""
    cos, sin = rope_table(x.shape[1], x.shape[-1], float(base))
    cos, sin = jnp.asarray(cos)[None, :, None, :], jnp.asarray(sin)[None, :, None, :]
    return apply_rope(x.astype(jnp.float32), cos, sin)
