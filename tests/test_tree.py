"""build_tree: mean pooling with ragged last nodes, float32 arithmetic, stored dtype."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from htree_jax import HTreeConfig, build_tree
from reference_numpy import build_tree_numpy
from tests.conftest import random_qkv


@pytest.mark.parametrize("r, top_k, T", [(4, 4, 150), (2, 2, 37), (8, 2, 129), (4, 1, 5), (2, 4, 1)])
@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-6), (ml_dtypes.bfloat16, 1e-2), (np.float16, 1e-3)])
def test_build_tree_matches_oracle(rng, r, top_k, T, dtype, tol):
    config = HTreeConfig(compression_rate=r, top_k=top_k, selection_block=1)
    _, k, v = random_qkv(rng, 2, T, 2, 2, 6, 3, dtype=dtype)
    tree = build_tree(k, v, config)
    ref = build_tree_numpy(k, v, config)
    assert [kl.shape[1] for kl, _ in tree] == list(config.layer_sizes(T))
    for (kl, vl), (rk, rv) in zip(tree, ref):
        assert kl.dtype == dtype and vl.dtype == dtype
        np.testing.assert_allclose(np.asarray(kl, np.float64), rk, rtol=tol, atol=tol)
        np.testing.assert_allclose(np.asarray(vl, np.float64), rv, rtol=tol, atol=tol)


def test_ragged_last_node_divides_by_existing_children():
    config = HTreeConfig(compression_rate=2, top_k=1, selection_block=1)  # M = 2
    T = 5  # layers 5 -> 3 (children 2, 2, 1) -> 2 (children 2, 1)
    k = np.arange(T, dtype=np.float32).reshape(1, T, 1, 1) * np.ones((1, 1, 1, 2), np.float32)
    tree = build_tree(k, k[..., :1], config)
    assert config.layer_sizes(T) == (5, 3, 2)
    np.testing.assert_array_equal(np.asarray(tree[1][0])[0, :, 0, 0], [0.5, 2.5, 4.0])
    np.testing.assert_array_equal(np.asarray(tree[2][0])[0, :, 0, 0], [1.5, 4.0])


def test_build_tree_validates_inputs():
    with pytest.raises(ValueError, match="k must have rank 4"):
        build_tree(np.zeros((2, 3, 4), np.float32), np.zeros((2, 3, 4, 1), np.float32))
    with pytest.raises(TypeError, match="k and v must have the same dtype"):
        build_tree(np.zeros((1, 3, 1, 2), np.float32), np.zeros((1, 3, 1, 2), np.float16))
    with pytest.raises(TypeError, match="config must be an HTreeConfig"):
        build_tree(np.zeros((1, 3, 1, 2), np.float32), np.zeros((1, 3, 1, 2), np.float32), {"top_k": 4})


def test_multi_layer_cases_have_three_layers_or_more():
    """The shared cases (`conftest.MULTI_LAYER_CASES`) are what their name says."""
    from tests.conftest import MULTI_LAYER_CASES

    for r, top_k, T in MULTI_LAYER_CASES:
        assert HTreeConfig(compression_rate=r, top_k=top_k, selection_block=1).num_layers(T) >= 3, (r, top_k, T)
