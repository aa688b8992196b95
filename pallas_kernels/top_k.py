"""SPEC 2.3's shared top-K in a kernel, sort-free: one program per `(b, t, h_kv)` keeps
the `min(top_k, n)` largest packed keys and writes the kept nodes ascending (the next
layer's parents); the twin is `select_top_k_twin` (`lax.top_k` and a sort).

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
from jax import lax
from jax.experimental import pallas as pl

from htree_jax.core.indexing import candidate_nodes
from pallas_kernels.common import LayerStatic, compiler_params


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



def _select_kernel(keys_ref, par_ref, n_ref, next_ref, tau_ref, *, st: LayerStatic):
    """Shared top-K of one query: the kept nodes (ascending, the next layer's parents)
    and `tau`, the smallest kept key (kept <=> valid and key >= tau)."""
    keys = keys_ref[...]
    kept = jnp.minimum(st.top_k, n_ref[0])
    tau = kth_largest_key(keys, kept)
    selected = keys >= tau
    positions = jnp.arange(keys.shape[0], dtype=jnp.int32)
    nodes = par_ref[positions // st.r] * st.r + positions % st.r
    # Ascending positions give ascending nodes.
    next_ref[compaction_targets(selected, kept)] = jnp.where(selected, nodes, -1)
    tau_ref[...] = jnp.full((1,), tau, jnp.int32)


@functools.partial(jax.jit, static_argnames=("st", "interpret"))
def select_top_k_pallas(keys, parents, n, st: LayerStatic, interpret=False):
    """Per query: `(next_parents [B, Q, H_kv, Mp], tau [B, Q, H_kv, 1])`, the kept nodes
    ascending in the first `min(top_k, n)` slots and `-1` after. `parents, n` per query."""
    B, Q, H_kv, Mp = keys.shape
    spec = lambda w: pl.BlockSpec((None, None, None, w), lambda b, i, h: (b, i, h, 0))
    return pl.pallas_call(
        functools.partial(_select_kernel, st=st),
        grid=(B, Q, H_kv),
        in_specs=[spec(Mp), spec(parents.shape[-1]), spec(1)],
        out_specs=[spec(Mp), spec(1)],
        out_shape=[jax.ShapeDtypeStruct((B, Q, H_kv, Mp), jnp.int32),
                   jax.ShapeDtypeStruct((B, Q, H_kv, 1), jnp.int32)],
        compiler_params=compiler_params(st.num_warps, 1),
        interpret=interpret,
    )(keys, parents, n)


def select_top_k_twin(keys, parents, n, st: LayerStatic):
    """Twin of `select_top_k_pallas` (`parents, n` per query) with `lax.top_k`."""
    Mp = keys.shape[-1]
    positions = jnp.arange(Mp, dtype=jnp.int32)
    nodes = candidate_nodes(parents, positions, st.r)
    kept = jnp.minimum(st.top_k, n)
    top, _ = lax.top_k(keys, Mp)
    tau = jnp.take_along_axis(top, kept - 1, axis=-1)
    order = jnp.sort(jnp.where(keys >= tau, positions, Mp), axis=-1)
    next_parents = jnp.where(order < Mp, jnp.take_along_axis(nodes, jnp.minimum(order, Mp - 1), -1), -1)
    return next_parents, tau


def kept_values(keys, tau, values, top_k: int):
    """`values [..., Mp]` at the positions a layer kept (`keys >= tau`), ascending
    (the order of the kept nodes), 0 after: `[..., top_k]` (SPEC 8's export)."""
    kept = keys >= tau
    order = jnp.argsort(~kept, axis=-1, stable=True)[..., :top_k]
    picked = jnp.take_along_axis(values, order, axis=-1)
    slots = jnp.arange(top_k, dtype=jnp.int32)
    return jnp.where(slots < jnp.sum(kept, axis=-1, keepdims=True, dtype=jnp.int32), picked, 0.0)
