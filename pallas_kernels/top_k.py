"""Sort-free top-K over packed importance keys (SPEC 2.3), usable inside any kernel.

`jnp.sort` and `lax.top_k` do not lower to Triton, so the K-th largest key is found by a
31-step bitwise threshold search (keys are distinct non-negative int32, invalid ones
negative), and the selected positions are compacted in ascending order with `cumsum`
ranks. The compaction writes a full permutation (selected first, then the rest), so
every lane has a distinct target: interpret mode writes masked-off scatter lanes too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import compiler_params


def kth_largest_key(keys, k):
    """The largest `tau` with `count(keys >= tau) >= k`: the k-th largest of distinct
    non-negative keys (`keys [M]` int32, negatives ignored; `k >= 1`, may be traced)."""

    def step(i, tau):
        candidate = tau | (jnp.int32(1) << (30 - i))
        count = jnp.sum((keys >= candidate).astype(jnp.int32))
        return jnp.where(count >= k, candidate, tau)

    return jax.lax.fori_loop(0, 31, step, jnp.int32(0))


def compaction_targets(selected, k):
    """Distinct targets `[M]`: the i-th selected position (ascending) goes to `i`, the
    unselected ones follow in order from `k` (`k = selected.sum()`)."""
    positions = jnp.arange(selected.shape[0], dtype=jnp.int32)
    rank = jnp.cumsum(selected.astype(jnp.int32)) - 1  # selected at or before, minus one
    return jnp.where(selected, rank, k + positions - (rank + 1))


def _select_kernel(keys_ref, k_ref, out_ref):
    keys = keys_ref[...]
    k = k_ref[0]
    selected = keys >= kth_largest_key(keys, k)
    positions = jnp.arange(keys.shape[0], dtype=jnp.int32)
    out_ref[compaction_targets(selected, k)] = jnp.where(selected, positions, -1)


@functools.partial(jax.jit, static_argnames=("interpret",))
def select_top_k_pallas(keys, k, interpret: bool = False):
    """`keys [P, M]` int32 (M a power of two), `k [P]` int32 in `[1, #valid]` ->
    `[P, M]`: the selected positions ascending in the first `k` slots, `-1` after."""
    P, M = keys.shape
    return pl.pallas_call(
        _select_kernel,
        grid=(P,),
        in_specs=[pl.BlockSpec((None, M), lambda i: (i, 0)), pl.BlockSpec((None, 1), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((None, M), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((P, M), jnp.int32),
        compiler_params=compiler_params(4, 1),
        interpret=interpret,
    )(keys, k[:, None].astype(jnp.int32))


def select_top_k_twin(keys, k):
    """Pure-JAX twin of `select_top_k_pallas` with `lax.top_k` and a sort."""
    P, M = keys.shape
    top, _ = jax.lax.top_k(keys, M)  # all keys, descending
    kth = jnp.take_along_axis(top, (k - 1)[:, None], axis=1)
    selected = keys >= kth
    positions = jnp.where(selected, jnp.arange(M, dtype=jnp.int32)[None, :], M)
    positions = jnp.sort(positions, axis=1)
    return jnp.where(positions < M, positions, -1)
