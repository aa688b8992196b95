"""The Pallas forward pass: the tree and keys as the kernels read them (`plan.prepare`),
then per chunk of query positions, per layer top down: the top layer's importance keys,
shared top-K and merge over blocks of queries (`top_layer.py`: neighbouring queries
share every candidate there), and below it, one program per query, the importance keys,
the top-K and the merge of the stored scores (`importance.py`, `top_k.py`, `merge.py`);
the bottom layer merges and normalises. Memory: `plan.py`'s docstring.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from htree_jax.core.config import HTreeConfig
from pallas_kernels.gqa.chunks import chunk_queries, select_below_top, valid_candidates
from pallas_kernels.gqa.merge import merge_pallas, merge_scored_pallas
from pallas_kernels.gqa.plan import Places, Prepared, group_rows, prepare, split_heads
from pallas_kernels.gqa.top_layer import top_merge_pallas
from pallas_kernels.shared.common import LayerInputs, TopInputs, next_power_of_two, real_heads
from pallas_kernels.shared.common import check_query_layout, check_selections_only
from pallas_kernels.shared.configs import BlockSizes, KernelConfigs
from pallas_kernels.shared.guarded import KernelCall
from pallas_kernels.shared.precision import Precisions


def bottom_merge(prep: Prepared, q_rows, parents, t, state, interpret: bool, out_dtype):
    """The bottom layer of a chunk, one program per query (`merge_pallas`): `(o, lse)`
    `[B, Qc, H_kv, Gp, Vp]`, `[B, Qc, H_kv, Gp]`."""
    _, k_merge, v0 = prep.layers[0]
    n = valid_candidates(parents, t, 0, prep)
    layer = LayerInputs(parents, n, None, None, k_merge, v0, prep.cos, prep.sin)
    return merge_pallas(q_rows, layer, state, prep.st_merge, interpret, out_dtype=out_dtype, return_lse=True)


@functools.partial(jax.jit, static_argnames=("config", "block_sizes", "interpret", "precisions", "return_lse",
                                             "return_importance", "value_dim", "q_layout", "selections_only"))
def htree_forward_pallas(q, k, v, *, config: HTreeConfig, block_sizes: BlockSizes | KernelConfigs | None = None,
                         interpret: bool = False, precisions: Precisions | None = None, return_lse: bool = False,
                         packing=None, positions=None, return_importance: bool = False, value_dim: int | None = None,
                         q_layout: str = "rope_layout", query_packing=None, selections_only: bool = False):
    """htree attention with Pallas kernels. Inputs validated by the caller.
    `packing`: packed rows (`htree_jax.core.packing.Packing`); the selections returned are
    then rows of the virtual tree (`packing.local_selections` makes them document-local);
    `query_packing` (a `Packing` of the queries' own virtual places, `[B, S]`): the
    queries are not the tokens of `packing` (block selection's ranking rows, SPEC 12).
    `positions [S]` int32: the queries' positions among `k`'s `T` tokens (`q [B, S, H,
    K]`; context parallelism), `None`: `S = T`, all of them. `return_importance`: the
    kept nodes' importance (SPEC 8) last, aligned with the selections.

    `q_layout`: `"rope_layout"` only (`"given"`, the caller's feature order, is the wide
    family's). `v=None` (the values read from the keys) is the wide family's
    (`htree_jax.backends.choose_route` chooses the family) and refused here.
    `precisions`: the dots' precisions, `None` for `Precisions.for_dtype(q.dtype)` (what
    `htree_attention` runs); `block_sizes`: a `BlockSizes` (`None`: the tuned values
    for `K, V`) or a `KernelConfigs` (`configs.KernelConfigs.resolve`).
    Returns `(o [B, T, H, V] in q.dtype, selections)` like the
    JAX reference; with `return_lse`, also the log-sum-exp of every row's merged scores
    `[B, T, H]` float32 (what the backward needs besides `o`). `selections_only`: no
    merge runs and `o` is None (block selection's ranking pass, SPEC 12, reads only
    the choices; `return_lse` is then refused).
    """
    B, T, H, K = q.shape
    H_kv, V = k.shape[2], value_dim if v is None else v.shape[-1]
    tuning = KernelConfigs.resolve(block_sizes, K, V)
    check_query_layout(q_layout)
    if v is None:
        raise ValueError("values read from the keys (v=None) need the wide kernels: groups of 32 or more heads per "
                         "kv head, BlockSizes.wide_rows > 0, one document per row")
    check_selections_only(selections_only, return_lse)
    k, v, split = split_heads(k, v, H // H_kv)
    H_kv, G = H_kv * split, H // (H_kv * split)
    prep = prepare(q, k, v, KernelCall(config, tuning, interpret), precisions or Precisions.for_dtype(q.dtype),
                   places=Places(packing, positions, query_packing), split=split)
    st_top, Qc, L = prep.st_top, prep.chunk, len(prep.layers) + 1
    st_scored = dataclasses.replace(prep.st_merge, merge_num_warps=tuning.layer.scored_merge_num_warps)
    num_chunks = prep.q4.shape[1] // Qc
    vp = prep.top_v.shape[-1]
    gt, gp = next_power_of_two(G), group_rows(G, tuning)

    def empty_state(rows):
        return (jnp.full((B, Qc, H_kv, rows), -jnp.inf, jnp.float32), jnp.zeros((B, Qc, H_kv, rows), jnp.float32),
                jnp.zeros((B, Qc, H_kv, rows, vp), jnp.float32))

    def chunk(c):
        rows, t, n_top, first, q_top, top = chunk_queries(prep, c, T, L, interpret, export=return_importance)
        keys, tau, parents = top[:3]
        exported = list(top[3:])
        if L == 1 and selections_only:
            return None, [], []
        if L == 1:
            inputs = TopInputs(n_top, first, None, None, prep.top_k_merge, prep.top_v)
            o, lse = top_merge_pallas(q_top, inputs, empty_state(gt), st_top, interpret, out_dtype=q.dtype,
                                      return_lse=True)
            return (o[:, :, :, :G], lse[..., :G]), [], []
        state = None
        if not selections_only:
            inputs = TopInputs(n_top, first, keys, tau, prep.top_k_merge, prep.top_v)
            state = top_merge_pallas(q_top, inputs, empty_state(gt), st_top, interpret)
            # The layers below: one query per program, its G heads padded to Gp rows (`group_rows`).
            state = tuple(jnp.pad(x, [(0, 0)] * 3 + [(0, gp - gt)] + [(0, 0)] * (x.ndim - 4)) for x in state)
        selections = [parents[..., : config.top_k]]
        for l in reversed(range(1, L - 1)):
            vl = prep.layers[l][2]
            n = valid_candidates(parents, t, l, prep)
            # The merge reads the scores the importance pass stored, not the keys.
            keys, next_parents, tau, scores, imp = select_below_top(prep, rows, parents, n, l, interpret,
                                                                    return_importance)
            if return_importance:
                exported.append(imp)
            if not selections_only:
                state = merge_scored_pallas(scores, parents, n, keys, tau, vl, state, st_scored, interpret)
            parents = next_parents
            selections.append(parents[..., : config.top_k])
        if selections_only:
            return None, selections, exported
        o, lse = bottom_merge(prep, rows.per_query, parents, t, state, interpret, q.dtype)
        return (o[:, :, :, :G], lse[..., :G]), selections, exported

    merged, sels, imps = lax.map(chunk, jnp.arange(num_chunks, dtype=jnp.int32))
    # Selections (and importance) of the real kv heads: each split head holds its kv head's.
    sels = [real_heads(jnp.moveaxis(s, 0, 1).reshape(B, num_chunks * Qc, H_kv, -1)[:, :T], split) for s in sels]
    if merged is None:
        result = (None, sels)
    else:
        o, lse = merged  # o: [chunks, B, Qc, H_kv, G, vp] -> [B, T, H, V]
        o = jnp.moveaxis(o, 0, 1).reshape(B, num_chunks * Qc, H_kv, G, vp)[:, :T, :, :, :V]
        result = (o.reshape(B, T, H, V), sels)
    if return_lse:
        result += (jnp.moveaxis(lse, 0, 1).reshape(B, num_chunks * Qc, H_kv * G)[:, :T],)
    if return_importance:
        result += ([real_heads(jnp.moveaxis(x, 0, 1).reshape(B, num_chunks * Qc, H_kv, -1)[:, :T], split)
                    for x in imps],)
    return result
