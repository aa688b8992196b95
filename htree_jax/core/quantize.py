"""FP8 token storage for a decode cache: `e4m3` rows with one float32 scale per row, as
DeepSeek's sparse-attention serving stores its latent cache (the tree's nodes stay in the
cache's compute dtype).

A row `x [..., D]` (one token of one kv head) is stored as `round_e4m3(x / s)` with
`s = max|x| * float32(1 / 448)` (e4m3's largest finite value; `s = 1` for an all-zero row), and read
back as `stored * s` in float32. Every e4m3 value is exact in bfloat16 and float16, so a
kernel widens the stored row to the compute dtype without rounding and applies `s` to the
row's score and to its weight (`pallas_kernels.gqa.merge`), never to the row itself.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from htree_jax.core.tree import round_to_storage

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
# The scale is `amax * (1 / 448)` rounded to float32, a multiply: XLA rewrites a division
# by a constant into this multiply under `jit` but (jax 0.12.1 on) not eagerly, and the
# two differ in the last bit for about half the rows, which moves a quotient that lies
# between two e4m3 values to the other one. A multiply is the same everywhere.
INV_FP8_MAX = np.float32(1.0 / FP8_MAX)


def is_fp8(dtype) -> bool:
    return np.dtype(dtype) == np.dtype(FP8)


def quantize_rows(x):
    """`(stored [..., D] e4m3, scale [...] float32)` of `x [..., D]`, one scale per row. A
    non-finite row stays non-finite when read back (its scale is NaN or infinite)."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax == 0, 1.0, amax * INV_FP8_MAX)
    stored = jnp.clip(x / scale[..., None], -FP8_MAX, FP8_MAX).astype(FP8)
    return stored, scale


def dequantize_rows(stored, scale, dtype=jnp.float32):
    """`stored [..., D] * scale [...]` in float32, rounded to `dtype` (`round_to_storage`:
    also inside a fusion, where XLA may otherwise keep the float32 product)."""
    return round_to_storage(stored.astype(jnp.float32) * scale[..., None], dtype)
