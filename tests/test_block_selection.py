"""Block selection (SPEC 12, `selection_block = compression_rate`): the JAX reference
against the float64 oracle on multi-layer trees, the selection shared by each bottom
node's queries, causality by perturbation, gradients against finite differences, packed
documents, and the clear errors where it is not built (kernels, decoding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import htree_jax
from htree_jax import HTreeConfig, htree_attention
from reference_numpy import htree_attention_numpy
from tests.conftest import random_qkv
from tests.test_packing import assert_packed_matches_oracle

SOURCES = ["first", "previous"]
# (compression_rate, top_k, T, H, H_kv, importance): 3+ layers at small T.
SHAPES = [(4, 4, 150, 4, 2, "softmax"), (2, 8, 100, 4, 4, "shared_max"), (8, 2, 200, 6, 2, "softmax")]


def block_config(r, top_k, source, selection="bound", importance="softmax", **kw):
    return HTreeConfig(compression_rate=r, top_k=top_k, selection=selection, importance=importance,
                       selection_block=r, block_source=source, **kw)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("selection, r, top_k, T, H, H_kv, importance",
                         [("bound", *SHAPES[0]), ("mean", *SHAPES[0]), ("mean", *SHAPES[1]), ("bound", *SHAPES[2])])
def test_reference_matches_the_oracle(rng, source, selection, r, top_k, T, H, H_kv, importance):
    config = block_config(r, top_k, source, selection, importance)
    assert config.num_layers(T) >= 3
    q, k, v = random_qkv(rng, 2, T, H, H_kv, 8, 8)
    o, selected = htree_attention(q, k, v, config, backend="reference", return_selected=True)
    want, want_sel, fragile = htree_attention_numpy(q, k, v, config, return_selected=True, return_fragile=True)
    robust = ~fragile
    assert fragile.mean() < 0.02
    for got, ref in zip(selected, want_sel):
        np.testing.assert_array_equal(np.asarray(got)[robust], ref[robust])
    heads = np.repeat(robust, H // H_kv, axis=2)
    np.testing.assert_allclose(np.asarray(o, np.float64)[heads], want[heads], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("source", SOURCES)
def test_a_bottom_nodes_queries_share_every_selection(rng, source):
    r, T = 4, 150
    q, k, v = random_qkv(rng, 1, T, 4, 2, 8, 8)
    _, selected = htree_attention(q, k, v, block_config(r, 4, source), backend="reference", return_selected=True)
    full = T // r * r
    for layer in selected:
        blocks = np.asarray(layer)[:, :full].reshape(1, T // r, r, 2, -1)
        assert (blocks == blocks[:, :, :1]).all()
    # per-query selection (the default) does not share them on the same inputs
    _, own = htree_attention(q, k, v, HTreeConfig(compression_rate=r, top_k=4), backend="reference",
                             return_selected=True)
    blocks = np.asarray(own[-1])[:, :full].reshape(1, T // r, r, 2, -1)
    assert not (blocks == blocks[:, :, :1]).all()


@pytest.mark.parametrize("source", SOURCES)
def test_no_output_depends_on_a_later_token(rng, source):
    """Perturbing q, k and v at every position after `t` leaves `o[:t + 1]` as it was,
    for `t` at a block's start, inside it and at its end."""
    config = block_config(4, 4, source)
    q, k, v = random_qkv(rng, 1, 150, 4, 2, 8, 8)
    base = np.asarray(htree_attention(q, k, v, config, backend="reference"))
    for t in (60, 62, 63, 97):
        noisy = [x.copy() for x in (q, k, v)]
        for x in noisy:
            x[:, t + 1:] += 3.0 * rng.standard_normal(x[:, t + 1:].shape).astype(x.dtype)
        o = np.asarray(htree_attention(*noisy, config, backend="reference"))
        np.testing.assert_array_equal(o[:, :t + 1], base[:, :t + 1])
        assert not np.allclose(o[:, t + 1:], base[:, t + 1:])


def test_a_prefix_gives_the_prefix_of_the_outputs(rng):
    for source in SOURCES:
        config = block_config(4, 4, source)
        q, k, v = random_qkv(rng, 1, 150, 4, 2, 8, 8)
        full = np.asarray(htree_attention(q, k, v, config, backend="reference"))
        for S in (37, 64, 101):
            part = np.asarray(htree_attention(q[:, :S], k[:, :S], v[:, :S], config, backend="reference"))
            np.testing.assert_allclose(part, full[:, :S], rtol=1e-6, atol=1e-6)


def test_one_layer_is_dense_attention_whatever_the_source(rng):
    """Nothing is selected in a one-layer tree: block selection changes nothing there."""
    q, k, v = random_qkv(rng, 1, 60, 4, 2, 8, 8)
    plain = np.asarray(htree_attention(q, k, v, HTreeConfig(compression_rate=4, top_k=16), backend="reference"))
    for source in SOURCES:
        o = np.asarray(htree_attention(q, k, v, block_config(4, 16, source), backend="reference"))
        np.testing.assert_allclose(o, plain, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("source", SOURCES)
def test_gradients_match_oracle_finite_differences(rng, source):
    config = block_config(4, 2, source)  # 40 -> 10 -> 3: three layers
    T = 40
    assert config.num_layers(T) >= 3
    q, k, v = random_qkv(rng, 1, T, 4, 2, 8, 4, dtype=np.float64)
    w = rng.standard_normal((1, T, 4, 4))

    def oracle(q, k, v):
        o, sel = htree_attention_numpy(q, k, v, config, return_selected=True)
        return float(np.sum(o * w)), sel

    base, base_sel = oracle(q, k, v)
    grads = jax.grad(lambda q, k, v: jnp.sum(htree_attention(q, k, v, config, backend="reference") * w),
                     argnums=(0, 1, 2))(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)))
    checked, eps = 0, 1e-4
    for name, x, g in zip("qkv", (q, k, v), grads):
        for flat in rng.choice(x.size, size=10, replace=False):
            idx = np.unravel_index(flat, x.shape)
            values = []
            for sign in (1, -1):
                args = {"q": q, "k": k, "v": v}
                args[name] = x.copy()
                args[name][idx] += sign * eps
                val, sel = oracle(args["q"], args["k"], args["v"])
                if any(np.any(a != b) for a, b in zip(sel, base_sel)):
                    break  # a selection moved: not the smooth piece
                values.append(val)
            if len(values) == 2:
                fd = (values[0] - values[1]) / (2 * eps)
                np.testing.assert_allclose(np.asarray(g, np.float64)[idx], fd, rtol=2e-3, atol=2e-4,
                                           err_msg=f"d loss / d {name}{idx}")
                checked += 1
    assert checked >= 20


@pytest.mark.parametrize("source", SOURCES)
def test_packed_documents_are_blocked_inside_each_document(rng, source):
    """Each document alone (the oracle on its own tokens): blocks start at each document's
    first token, so none spans two."""
    config = block_config(4, 4, source)
    q, k, v = random_qkv(rng, 2, 150, 4, 2, 32, 32)
    assert_packed_matches_oracle(q, k, v, [[5, 9, 33, 1, 102], [70, 3, 77]], config, "reference")


def test_where_it_is_not_built_the_errors_say_so(rng):
    config = block_config(4, 4, "first")
    q, k, v = random_qkv(rng, 1, 40, 4, 2, 32, 32)
    for backend in ("pallas", "pallas_interpret"):
        with pytest.raises(ValueError, match="selection_block=4 .* JAX reference only"):
            htree_attention(q, k, v, config, backend=backend)
    o = htree_attention(q, k, v, config)  # "auto": the reference
    np.testing.assert_array_equal(np.asarray(o), np.asarray(htree_attention(q, k, v, config, backend="reference")))
    with pytest.raises(ValueError, match="block selection .* not in the decode cache"):
        htree_jax.init_cache(1, 64, 2, 32, 32, config, jnp.float32)
    with pytest.raises(ValueError, match="selection_block must be 1 or compression_rate"):
        HTreeConfig(compression_rate=4, selection_block=2)
    with pytest.raises(ValueError, match="selection_block must be 1 or compression_rate"):
        HTreeConfig(compression_rate=4, selection_block=True)
    with pytest.raises(ValueError, match="block_source must be one of"):
        HTreeConfig(compression_rate=4, selection_block=4, block_source="last")
