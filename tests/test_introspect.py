"""`htree_jax.introspect`: the merged-layer map is the query's tree cut (SPEC 3)."""

from __future__ import annotations

import numpy as np
import pytest

from htree_jax import HTreeConfig, htree_attention
from htree_jax.introspect import candidates_per_query, merged_layer_map
from tests.conftest import MULTI_LAYER_CASES, random_qkv
from tests.helpers import leaf_set


@pytest.mark.parametrize("r, top_k, T", MULTI_LAYER_CASES)
def test_merged_layer_map_is_the_leaf_set(r, top_k, T, rng):
    config = HTreeConfig(compression_rate=r, top_k=top_k, selection_block=1)
    q, k, v = random_qkv(rng, 2, T, 4, 2, 8, 8)
    _, selected = htree_attention(q, k, v, config, backend="reference", return_selected=True)
    queries = sorted({0, 1, T // 3, T // 2, T - 2, T - 1, *rng.integers(0, T, 4).tolist()})
    b, h = 1, 1
    got = merged_layer_map(selected, config, T, queries, batch=b, kv_head=h)
    assert got.shape == (len(queries), T)
    total = candidates_per_query(selected, config, T)[b, :, h]
    for row, t in zip(got, queries):
        want = np.full(T, -1)
        leaves = leaf_set(t, [np.asarray(s)[b, t, h] for s in selected], config, T)
        for layer, node, _, _ in leaves:
            span = want[node * r**layer: min((node + 1) * r**layer, t + 1)]
            assert np.all(span == -1), "leaves overlap"
            span[:] = layer
        np.testing.assert_array_equal(row, want)
        assert np.all(row[: t + 1] >= 0) and np.all(row[t + 1:] == -1)
        # the candidates scored: the leaves plus the selected nodes (which are refined)
        assert total[t] == len(leaves) + sum(int((np.asarray(s)[b, t, h] >= 0).sum()) for s in selected)


def test_merged_layer_map_errors(rng):
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    q, k, v = random_qkv(rng, 1, 40, 2, 1, 8, 8)
    _, selected = htree_attention(q, k, v, config, backend="reference", return_selected=True)
    with pytest.raises(ValueError, match="queries must lie in"):
        merged_layer_map(selected, config, 40, [40])
    with pytest.raises(ValueError, match="selected must hold"):
        merged_layer_map(selected, config, 200, [3])
