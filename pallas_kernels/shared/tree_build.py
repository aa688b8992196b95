"""Mean-pooling tree build (SPEC 1): one layer up per launch, and its JAX twin."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from htree_jax.core.tree import child_reciprocals, pool_layer, round_to_storage
from pallas_kernels.shared.common import compiler_params


@dataclasses.dataclass(frozen=True)
class PoolBlockSizes:
    parents: int = 64  # parent nodes per program (a power of two)
    num_warps: int = 4
    num_stages: int = 1


def _pool_kernel(x_ref, o_ref, *, num_children: int, r: int, block: int):
    """x_ref: the whole layer below `[N, D]`; o_ref: `[block, D]` parents."""
    parents = pl.program_id(2) * block + jnp.arange(block, dtype=jnp.int32)
    acc = jnp.zeros(o_ref.shape, jnp.float32)
    for j in range(r):  # static: r children, each a gather of `block` rows
        rows = parents * r + j
        exists = rows < num_children
        x = x_ref[jnp.minimum(rows, num_children - 1), :].astype(jnp.float32)
        acc += jnp.where(exists[:, None], x, 0.0)
    count = jnp.clip(num_children - parents * r, 1, r)
    # times the float32 constant 1/count, as `pool_layer` does (a division here would
    # be Triton's approximate one)
    reciprocal = jnp.zeros(count.shape, jnp.float32)
    for c, value in enumerate(child_reciprocals(r), start=1):
        reciprocal = jnp.where(count == c, float(value), reciprocal)
    o_ref[...] = acc * reciprocal[:, None]


@functools.partial(jax.jit, static_argnames=("r", "block_sizes", "interpret"))
def pool_layer_pallas(x, r: int, block_sizes: PoolBlockSizes = PoolBlockSizes(), interpret: bool = False):
    """`x [B, H_kv, N, D]` (D a power of two) -> `[B, H_kv, ceil(N/r), D]` in x.dtype.

    Sums in float32, child by child, and scales by the reciprocal of the number of
    existing children (ragged last node), as `pool_layer` does.
    The kernel writes float32 and XLA rounds to the stored dtype: the rounding must be
    XLA's round-to-nearest-even so that tree nodes, and so selections, match the
    reference bit for bit in bfloat16.
    """
    B, H, N, D = x.shape
    n_up = -(-N // r)
    block = min(block_sizes.parents, 1 << (n_up - 1).bit_length())
    grid_n = -(-n_up // block)
    out = pl.pallas_call(
        functools.partial(_pool_kernel, num_children=N, r=r, block=block),
        grid=(B, H, grid_n),
        in_specs=[pl.BlockSpec((None, None, N, D), lambda b, h, i: (b, h, 0, 0))],
        out_specs=pl.BlockSpec((None, None, block, D), lambda b, h, i: (b, h, i, 0)),
        out_shape=jax.ShapeDtypeStruct((B, H, grid_n * block, D), jnp.float32),
        compiler_params=compiler_params(block_sizes.num_warps, block_sizes.num_stages),
        interpret=interpret,
    )(x)
    return round_to_storage(out[:, :, :n_up], x.dtype)


def pool_layer_twin(x, r: int):
    """Pure-JAX twin of `pool_layer_pallas` (same layout `[B, H_kv, N, D]`)."""
    return jnp.swapaxes(pool_layer(jnp.swapaxes(x, 1, 2), r), 1, 2)
