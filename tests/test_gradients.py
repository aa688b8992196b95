"""Gradients of the JAX reference (plain autodiff, selection constant; SPEC 5) against
central finite differences of the float64 NumPy oracle, on multi-layer trees."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from htree_jax import HTreeConfig, htree_attention
from reference_numpy import htree_attention_numpy
from tests.conftest import random_qkv

EPS = 1e-4


def _oracle_loss(q, k, v, w, config):
    o, sel = htree_attention_numpy(q, k, v, config, return_selected=True)
    return float(np.sum(o * w)), sel


# (2, 2, 20, "softmax", None) ran too until 2026-11-28 (3): the 40-token trees have 3
# layers as well, and the block-selection and bound tests take finite differences too.
@pytest.mark.parametrize("r, top_k, T, importance, rope_dim", [(4, 2, 40, "shared_max", None),
                                                                (4, 2, 40, "softmax", 4)])  # SPEC 7: K=8, 4 rotated
def test_reference_gradients_match_oracle_finite_differences(rng, r, top_k, T, importance, rope_dim):
    config = HTreeConfig(compression_rate=r, top_k=top_k, importance=importance, rope_dim=rope_dim, selection_block=1)
    assert config.num_layers(T) >= 3
    q, k, v = random_qkv(rng, 1, T, 4, 2, 8, 4, dtype=np.float64)
    w = rng.standard_normal((1, T, 4, 4))  # a random linear read-out of the output
    base, base_sel = _oracle_loss(q, k, v, w, config)

    def loss(q, k, v):
        return jnp.sum(htree_attention(q, k, v, config, backend="reference") * w)

    grads = jax.grad(loss, argnums=(0, 1, 2))(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)))
    checked = 0
    for name, x, g in zip("qkv", (q, k, v), grads):
        g = np.asarray(g, np.float64)
        for flat in rng.choice(x.size, size=12, replace=False):
            idx = np.unravel_index(flat, x.shape)
            values = []
            for sign in (1, -1):
                x2 = x.copy()
                x2[idx] += sign * EPS
                args = {"q": q, "k": k, "v": v, name: x2}
                val, sel = _oracle_loss(args["q"], args["k"], args["v"], w, config)
                if any(np.any(a != b) for a, b in zip(sel, base_sel)):
                    break  # the perturbation moved a selection: not a point of the smooth piece
                values.append(val)
            if len(values) < 2:
                continue
            fd = (values[0] - values[1]) / (2 * EPS)
            np.testing.assert_allclose(g[idx], fd, rtol=2e-3, atol=2e-4, err_msg=f"d loss / d {name}{idx}")
            checked += 1
    assert checked >= 30  # most coordinates sit away from selection ties


def test_reference_gradient_is_finite_for_t1_and_jits(rng):
    config = HTreeConfig(compression_rate=2, top_k=2, selection_block=1)
    for T in (1, 37):
        q, k, v = (jnp.asarray(x) for x in random_qkv(rng, 1, T, 2, 1, 8, 4))
        g = jax.jit(jax.grad(lambda q, k, v: htree_attention(q, k, v, config).sum() ** 2, argnums=(0, 1, 2)))(q, k, v)
        assert all(bool(jnp.all(jnp.isfinite(x))) for x in g)
