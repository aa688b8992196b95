"""Introspection of htree selections, for plots and analysis (SPEC 5): how many
candidates each query scores, and at which layer each past token is merged."""

from __future__ import annotations

import numpy as np

from htree_jax.core.indexing import candidate_count, num_top_parents


def candidates_per_query(selected, config, seq_len):
    """Candidates each query scores, summed over layers: `[B, T, H_kv]`, from the
    selections (SPEC 2.1: `n = (n_P - 1) * r + c* + 1`)."""
    r, L = config.compression_rate, config.num_layers(seq_len)
    t = np.arange(seq_len)[None, :, None]
    num_parents = num_top_parents(t, r, L)
    total = 0
    for depth, l in enumerate(reversed(range(L))):
        n = candidate_count(num_parents, t, r, l)
        total = total + n
        if l > 0:
            num_parents = (np.asarray(selected[depth]) >= 0).sum(axis=-1)
    return total


def merged_layer_map(selected, config, seq_len: int, queries, *, batch: int = 0, kv_head: int = 0):
    """For each query `t` in `queries`, the layer of the merged node that covers each
    token: `[len(queries), T]` int, `0` where the token itself is merged, `l` where its
    ancestor at layer `l` is, `-1` after `t`. A picture of the query's tree cut.

    `selected`: the list `htree_attention(..., return_selected=True)` returns (top layer
    first, each `[B, T, H_kv, top_k]`, `-1` padded). A token moves down from layer `l`
    to `l - 1` when its ancestor at `l` was selected for refinement; the top layer's
    nodes are all candidates."""
    r, L = config.compression_rate, config.num_layers(seq_len)
    if len(selected) != L - 1:
        raise ValueError(f"selected must hold L - 1 = {L - 1} layers for T={seq_len}, got {len(selected)}")
    chosen = [np.asarray(x)[batch, :, kv_head] for x in selected]
    tokens = np.arange(seq_len)
    out = np.full((len(queries), seq_len), -1, np.int32)
    for i, t in enumerate(queries):
        if not 0 <= t < seq_len:
            raise ValueError(f"queries must lie in [0, {seq_len}), got {t}")
        past = tokens[: t + 1]
        level = np.full(t + 1, L - 1, np.int32)
        refining = np.ones(t + 1, bool)
        for depth, l in enumerate(range(L - 1, 0, -1)):
            nodes = chosen[depth][t]
            refining &= np.isin(past // r**l, nodes[nodes >= 0])
            level[refining] = l - 1
        out[i, : t + 1] = level
    return out
