"""`HTreeConfig()` selects by block (SPEC 12, `selection_block = compression_rate`,
`block_source="first"`; the default since 2026-12-02): the function, the kernels and
decoding at the default, as a user who names no selection gets them (the modules'
decoding at the default: `test_module.py`, MHA's conventions)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import htree_jax
from htree_jax import HTreeConfig, htree_attention, init_cache
from reference_numpy import htree_attention_numpy
from tests.conftest import random_qkv

# compression_rate=4, top_k=4: three layers at T=150 (150 -> 38 -> 10).
DEFAULT = HTreeConfig(compression_rate=4, top_k=4)


@pytest.mark.parametrize("backend", ["reference", "pallas_interpret"])
def test_the_default_is_block_selection_on_every_backend(rng, backend):
    """The default's outputs and selections are block selection's ("first"): those of the
    config that names it, the float64 oracle's (near-ties waived), one selection a block
    of 4 queries at every layer; and not per-query selection's."""
    B, T, H, H_kv, K = 1, 150, 4, 2, 32
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, B, T, H, H_kv, K, K))
    named = dataclasses.replace(DEFAULT, selection_block=4, block_source="first")
    assert DEFAULT == named and DEFAULT.num_layers(T) == 3
    o, sel = htree_attention(q, k, v, DEFAULT, backend=backend, return_selected=True)
    o_named, sel_named = htree_attention(q, k, v, named, backend=backend, return_selected=True)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_named))
    want, want_sel, fragile = htree_attention_numpy(np.asarray(q), np.asarray(k), np.asarray(v), DEFAULT,
                                                    return_selected=True, return_fragile=True)
    robust = ~np.asarray(fragile)  # [B, T, H_kv]
    for got, named_sel, oracle in zip(sel, sel_named, want_sel):
        got = np.asarray(got)
        np.testing.assert_array_equal(got, np.asarray(named_sel))
        np.testing.assert_array_equal(got[robust], oracle[robust])
        blocks = got[:, :T // 4 * 4].reshape(B, T // 4, 4, H_kv, DEFAULT.top_k)  # the whole blocks
        assert (blocks == blocks[:, :, :1]).all()  # a block's queries share the selection
    heads = np.repeat(robust, H // H_kv, axis=2)
    np.testing.assert_allclose(np.asarray(o)[heads], want[heads], rtol=2e-5, atol=2e-5)
    per_query = dataclasses.replace(DEFAULT, selection_block=1)
    _, sel_query = htree_attention(q, k, v, per_query, backend=backend, return_selected=True)
    assert any((np.asarray(a) != np.asarray(b)).any() for a, b in zip(sel, sel_query))


def test_a_decode_cache_at_the_default_needs_the_query_heads(rng):
    """Block selection keeps each row's recent queries, so `init_cache` at the default
    asks for `num_heads` by name; with it, a prompt and steps equal the full sequence.
    Latent attention's layout (`rope_dim` set) selects per query and needs none."""
    B, T, H, H_kv, K = 2, 60, 4, 2, 16
    with pytest.raises(ValueError, match="init_cache needs num_heads"):
        init_cache(B, 64, H_kv, K, K, DEFAULT)
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, B, T, H, H_kv, K, K))
    cache = init_cache(B, 64, H_kv, K, K, DEFAULT, num_heads=H)
    o, cache = htree_jax.prefill(q[:, :41], k[:, :41], v[:, :41], cache, DEFAULT)
    got = [o]
    for t in range(41, T):
        o_t, cache = htree_jax.decode_step(q[:, t], k[:, t], v[:, t], cache, DEFAULT)
        got.append(o_t[:, None])
    full = htree_attention(q, k, v, DEFAULT)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(got, axis=1)), np.asarray(full), rtol=1e-5, atol=1e-5)
    latent = HTreeConfig(compression_rate=4, top_k=4, rope_dim=8)
    assert latent.selection_block == 1 and not init_cache(B, 64, H_kv, K, K, latent).queries
