"""Shared pieces of the Pallas (Triton lowering) kernels."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu


def next_power_of_two(x: int, minimum: int = 1) -> int:
    x = max(int(x), minimum)
    return 1 << (x - 1).bit_length()


def compiler_params(num_warps: int, num_stages: int):
    """Selects the Triton lowering (Pallas on GPU defaults to Mosaic GPU)."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def pad_axis(x, axis: int, size: int):
    """Zero-pads `x` along `axis` up to `size`."""
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def pad_rope_halves(x, half: int):
    """`[..., K]` -> `[..., 2*half]` as `[x_lo, 0, x_hi, 0]`: rotate-half pairs dim `i`
    with `i + K/2`, so each half is padded on its own and the pairs stay aligned."""
    k2 = x.shape[-1] // 2
    lo, hi = x[..., :k2], x[..., k2:]
    return jnp.concatenate([pad_axis(lo, -1, half), pad_axis(hi, -1, half)], axis=-1)
