"""SPEC 10's poisoned rows written in place: `htree_jax.core.non_finite.poison_rows` as
a kernel that writes only the rows it poisons.

`poison_rows` is a `where` over the whole output, a pass that reads and writes `[B, S, H,
V]` whatever the inputs; with finite inputs (always, in practice) it changes nothing. On
the one-layer path (`htree_jax.core.one_layer`), where cuDNN's attention is only some ten
such passes long, it was a measurable share of the forward (benchmarks/RESULTS.md,
2026-11-26 (8)). Here a program per (row, block of tokens, head) stores
NaN to its block's rows at or after the first non-finite position and touches nothing
where there is none (the output buffer is aliased, so untouched rows keep their values).
The gradient zeroes the same rows of the cotangent the same way."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.shared.common import compiler_params
from pallas_kernels.shared.importance import feature_pieces

# Rows per program: the largest power of two dividing S, at most this (the stores stay
# inside the array without padding it, so no lane is clamped in interpret mode).
MAX_BLOCK_ROWS = 64


def block_rows(seq_len: int) -> int:
    """The tokens one program covers: the largest power of two dividing `seq_len`, at most
    `MAX_BLOCK_ROWS`."""
    return min(MAX_BLOCK_ROWS, seq_len & -seq_len)


def _fill_kernel(first_ref, x_ref, out_ref, *, rows: int, group: int, value: float):
    del x_ref  # aliased with out_ref: rows not written keep their values
    b, i, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    first = first_ref[b, h // group]

    @pl.when(i * rows + rows > first)
    def _():
        dead = (i * rows + jnp.arange(rows, dtype=jnp.int32) >= first)[:, None]
        for offset, size in feature_pieces(out_ref.shape[-1]):
            plgpu.store(out_ref.at[b, pl.ds(i * rows, rows), h, pl.ds(offset, size)],
                        jnp.full((rows, size), value, out_ref.dtype), mask=jnp.broadcast_to(dead, (rows, size)))


def fill_dead_rows(x, first, value: float, interpret: bool = False):
    """`x [B, S, H, V]` with `value` in every row `s >= first[b, h // G]` (`first [B, H_kv]`
    int32, `G = H / H_kv`), written in place: rows before it are not read or written."""
    B, S, H, _ = x.shape
    rows = block_rows(S)
    return pl.pallas_call(
        functools.partial(_fill_kernel, rows=rows, group=H // first.shape[1], value=value),
        grid=(B, S // rows, H),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        input_output_aliases={1: 0},
        compiler_params=compiler_params(1, 1),
        interpret=interpret,
    )(first, x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def poison_rows_in_place(o, first, interpret: bool = False):
    """`htree_jax.core.non_finite.poison_rows(o, arange(S), first)`: NaN in every row of
    `o [B, S, H, V]` at or after `first [B, H_kv]`, through `fill_dead_rows`. Its gradient
    is the cotangent with those rows zeroed, the same way."""
    return fill_dead_rows(o, first, float("nan"), interpret)


def _poison_forward(o, first, interpret):
    return fill_dead_rows(o, first, float("nan"), interpret), first


def _poison_backward(interpret, first, g):
    return fill_dead_rows(g, first, 0.0, interpret), None


poison_rows_in_place.defvjp(_poison_forward, _poison_backward)

__all__ = ["block_rows", "fill_dead_rows", "poison_rows_in_place"]
