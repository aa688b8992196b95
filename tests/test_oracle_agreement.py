"""The JAX reference equals the float64 NumPy oracle (SPEC sections 1-2).

Selections must be identical. The only exemption is a query the oracle flags as
*fragile*: its top-K boundary sits within 1e-5 relative of a packed-key tie, so float32
and float64 arithmetic may legitimately order it differently. Such queries are rare
(asserted) and are left out of the comparison, selections and outputs alike.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from htree_jax import HTreeConfig, htree_attention
from reference_numpy import htree_attention_numpy
from tests.conftest import MULTI_LAYER_CASES, random_qkv

MAX_FRAGILE_FRACTION = 0.01


def assert_matches_oracle(q, k, v, config, rtol=1e-5, atol=1e-5, backend="reference"):
    o, selected = htree_attention(q, k, v, config, return_selected=True, backend=backend)
    ref, ref_selected, fragile = htree_attention_numpy(
        q, k, v, config, return_selected=True, return_fragile=True
    )
    o = np.asarray(o)
    assert o.dtype == q.dtype and o.shape == ref.shape
    assert len(selected) == len(ref_selected) == config.num_layers(q.shape[1]) - 1
    assert fragile.mean() <= MAX_FRAGILE_FRACTION, f"{fragile.mean():.3%} of queries fragile"
    robust = ~fragile  # [B, T, H_kv]
    for got, want in zip(selected, ref_selected):
        got = np.asarray(got)
        assert got.dtype == np.int32 and got.shape == want.shape
        np.testing.assert_array_equal(got[robust], want[robust])
    G = q.shape[2] // k.shape[2]
    robust_heads = np.repeat(robust, G, axis=2)  # [B, T, H]
    np.testing.assert_allclose(
        o.astype(np.float64)[robust_heads], ref[robust_heads], rtol=rtol, atol=atol
    )
    return fragile


# A few fixed shapes `(B, T, H_kv, G, K, V)` (T = 1, odd sizes, up to 5+ layers at T=300),
# so that examples share compiled programs; configs, modes and data vary freely.
HYPOTHESIS_SHAPES = [(1, 1, 1, 1, 4, 2), (2, 37, 3, 2, 18, 5), (1, 150, 2, 4, 32, 16), (2, 300, 1, 1, 10, 16)]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=st.sampled_from(HYPOTHESIS_SHAPES),
    r=st.sampled_from([2, 4, 8]),
    top_k=st.sampled_from([2, 4, 8]),
    importance=st.sampled_from(["softmax", "shared_max"]),
    strict_causal=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_reference_matches_oracle_hypothesis(shape, r, top_k, importance, strict_causal, seed):
    B, T, H_kv, G, K, V = shape
    config = HTreeConfig(compression_rate=r, top_k=top_k, importance=importance, strict_causal=strict_causal, selection_block=1)
    q, k, v = random_qkv(np.random.default_rng(seed), B, T, G * H_kv, H_kv, K, V)
    assert_matches_oracle(q, k, v, config)


@pytest.mark.parametrize("r, top_k, T", MULTI_LAYER_CASES)
@pytest.mark.parametrize("importance", ["softmax", "shared_max"])
@pytest.mark.parametrize("strict_causal", [True, False])
def test_reference_matches_oracle_multi_layer(rng, r, top_k, T, importance, strict_causal):
    config = HTreeConfig(compression_rate=r, top_k=top_k, importance=importance, strict_causal=strict_causal, selection_block=1)
    assert config.num_layers(T) >= 2
    q, k, v = random_qkv(rng, 2, T, 4, 2, 16, 8)
    assert_matches_oracle(q, k, v, config)


def test_fixed_cases_have_three_or_more_layers():
    assert HTreeConfig(compression_rate=4, top_k=4, selection_block=1).layer_sizes(150) == (150, 38, 10)
    assert HTreeConfig(compression_rate=2, top_k=8, selection_block=1).layer_sizes(300) == (300, 150, 75, 38, 19, 10)


@pytest.mark.parametrize("dtype, tol", [("bfloat16", 1e-2), ("float16", 2e-3)])
def test_low_precision_inputs_match_oracle(rng, dtype, tol):
    """The oracle rounds tree layers to the input dtype too; the only difference left
    is float32 vs float64 arithmetic plus the final cast of the output."""
    import ml_dtypes  # a dependency of jax

    np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    q, k, v = random_qkv(rng, 1, 150, 4, 2, 16, 8, dtype=np_dtype)
    assert_matches_oracle(q, k, v, config, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_selections_exact_at_default_rate(rng, dtype):
    """Regression: inside one jit, XLA may skip the float32 -> bf16 rounding of stored
    tree layers unless it is forced; the selections then drift from the spec. With
    r=16 and 16 of 64 top-layer nodes kept, that showed on ~2% of queries."""
    import ml_dtypes

    np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    config = HTreeConfig(compression_rate=16, top_k=16, selection_block=1)
    q, k, v = random_qkv(rng, 1, 1024, 8, 2, 32, 16, dtype=np_dtype)
    fragile = assert_matches_oracle(q, k, v, config, rtol=2e-2, atol=2e-2)
    assert fragile.mean() < 0.01
