"""SPEC 2.3's shared top-K in a kernel, sort-free: one program per `(b, t, h_kv)` keeps
the `min(top_k, n)` largest packed keys and writes the kept nodes ascending (the next
layer's parents); the twin is `select_top_k_twin` (`lax.top_k` and a sort).

`jnp.sort` and `lax.top_k` do not lower to Triton, so the K-th largest key is found by a
bitwise threshold search of at most 31 steps (keys are distinct non-negative int32,
invalid ones negative), over the narrowest of a few static widths that holds the valid
keys (`select_widths`), and the selected positions are compacted in ascending order with
`cumsum` ranks into the `P` slots of the kept list by a masked scatter.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from htree_jax.core.indexing import candidate_nodes
from pallas_kernels.shared.common import LayerStatic, compiler_params


def kth_largest_key(keys, k):
    """The largest `tau` with `count(keys >= tau) >= k`: the k-th largest of distinct
    non-negative keys (`keys [M]` int32, negatives ignored; `k >= 1`, may be traced).
    Bit by bit from the top, stopping early once a candidate has exactly `k` keys at or
    above it (the k-th largest is then the least of them): about 20 of the 31 steps on
    the top layer's keys."""
    big = jnp.int32(2**31 - 1)

    def step(carry):
        i, tau, _ = carry
        candidate = tau | (jnp.int32(1) << (30 - i))
        count = jnp.sum((keys >= candidate).astype(jnp.int32))
        return i + 1, jnp.where(count >= k, candidate, tau), count == k

    _, tau, _ = lax.while_loop(lambda c: (c[0] < 31) & ~c[2], step, (jnp.int32(0), jnp.int32(0), False))
    return jnp.min(jnp.where(keys >= tau, keys, big))


def compaction_slots(selected, kept):
    """Each position's slot `[M]` in a kept list of `P` slots: the i-th selected position
    (ascending) goes to `i`, the first `P - kept` unselected ones fill slots `kept, ...,
    P - 1` (they write -1 there); the rest get slots `>= P`, so every slot below `P` is
    written by exactly one position."""
    positions = jnp.arange(selected.shape[0], dtype=jnp.int32)
    rank = jnp.cumsum(selected.astype(jnp.int32)) - 1  # selected at or before, minus one
    return jnp.where(selected, rank, kept + positions - (rank + 1))


def select_widths(Mp: int, P: int) -> tuple:
    """The key widths the select kernel is compiled for, widest first: `Mp`, `Mp/2` and
    `max(P, Mp/4)`. A query with `n` valid candidates searches the narrowest width `>= n`
    (at least `P`, so its unselected positions can fill the slots it does not keep): on
    the top layer, where `n` grows from 1 to `Mp` along the sequence, a third of the work.
    Narrower widths down to `P` would save 3% more of it at T=131072, top_k=512, and each
    costs a compiled branch (interpret mode: 1.33 s to compile five, 0.75 three)."""
    return tuple(sorted({Mp, Mp // 2, max(P, Mp // 4)}, reverse=True))


def _select_kernel(keys_ref, par_ref, n_ref, next_ref, tau_ref, *, st: LayerStatic):
    """Shared top-K of one query: the kept nodes (ascending, the next layer's parents,
    `-1` after them) and `tau`, the smallest kept key (kept <=> valid and key >= tau)."""
    n = n_ref[0]
    kept = jnp.minimum(st.top_k, n)
    P = par_ref.shape[0]
    widths = select_widths(keys_ref.shape[0], P)

    def select(width: int):  # keys past `width` are all invalid (n <= width)
        keys = keys_ref[pl.ds(0, width)]
        tau = kth_largest_key(keys, kept)
        selected = keys >= tau
        positions = jnp.arange(width, dtype=jnp.int32)
        parents = plgpu.load(par_ref.at[jnp.where(selected, positions // st.r, 0)], mask=selected, other=0)
        nodes = parents * st.r + positions % st.r  # ascending positions give ascending nodes
        slot = compaction_slots(selected, kept)
        # The positions past the list go to the scratch half `[P, 2P)`: a masked store, but
        # interpret mode writes its masked-off lanes (the old values), and they must not
        # land on a slot of the list.
        scratch = P + positions % P
        plgpu.store(next_ref.at[jnp.where(slot < P, slot, scratch)], jnp.where(selected, nodes, -1), mask=slot < P)
        tau_ref[...] = jnp.full((1,), tau, jnp.int32)

    for i, width in enumerate(widths):  # each query runs the narrowest width >= n (Mp >= 2P: two widths or more)
        bounds = ([n <= width] if i > 0 else []) + ([n > widths[i + 1]] if i + 1 < len(widths) else [])
        pl.when(functools.reduce(operator.and_, bounds))(functools.partial(select, width))


@functools.partial(jax.jit, static_argnames=("st", "interpret"))
def select_top_k_pallas(keys, parents, n, st: LayerStatic, interpret=False):
    """Per query: `(next_parents [B, Q, H_kv, P], tau [B, Q, H_kv, 1])`, the kept nodes
    ascending in the first `min(top_k, n)` slots and `-1` after. `parents [B, Q, H_kv,
    P]`, `n` per query; `P >= top_k` and `keys [..., Mp]` with `Mp >= 2 P` (`gqa.plan.layout`).
    The kernel writes `2 P` slots per query (the second half scratch), sliced here."""
    B, Q, H_kv, Mp = keys.shape
    P = parents.shape[-1]
    if P < st.top_k or Mp < 2 * P:
        raise ValueError(f"select_top_k_pallas needs parents of width P >= top_k ({st.top_k}) and keys of width "
                         f">= 2 P, got P={P}, keys {Mp}")
    spec = lambda w: pl.BlockSpec((None, None, None, w), lambda b, i, h: (b, i, h, 0))
    next_parents, tau = pl.pallas_call(
        functools.partial(_select_kernel, st=st),
        grid=(B, Q, H_kv),
        in_specs=[spec(Mp), spec(P), spec(1)],
        out_specs=[spec(2 * P), spec(1)],
        out_shape=[jax.ShapeDtypeStruct((B, Q, H_kv, 2 * P), jnp.int32),
                   jax.ShapeDtypeStruct((B, Q, H_kv, 1), jnp.int32)],
        compiler_params=compiler_params(st.num_warps, 1),
        interpret=interpret,
    )(keys, parents, n)
    return next_parents[..., :P], tau


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
