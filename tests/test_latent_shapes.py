"""Latent-attention shapes in the Pallas kernels (issue 20): GQA groups above 16 heads
(they run as virtual kv heads of 16, `pallas_kernels.gqa.plan.split_heads`, whose selection
is made once from the whole group's importance), K != V, head dims that are not powers
of two (padded inside), up to K = 576, V = 512, with partial RoPE. CI runs the kernels
interpreted against the JAX reference and the float64 oracle; the gpu-marked tests run
the compiled kernels at the MLA shape (H = 128 over one kv head, K = 576, rope_dim = 64,
V = 512)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from htree_jax import HTreeConfig, decode_step, htree_attention, init_cache, prefill
from htree_jax.backends import attend_cache
from htree_jax.decode import rotation_layout
from pallas_kernels.decode.merge import cache_value_pieces, values_in_key_tiles
from pallas_kernels.decode.scores import decode_keys_pallas, half_pieces
from pallas_kernels.decode.walk import attend_cache_pallas, pipelined
from pallas_kernels.shared import shared_memory
from pallas_kernels.shared.common import LayerStatic
from pallas_kernels.shared.configs import DecodeBlockSizes
from pallas_kernels.shared.importance import group_keys_from_scores
from tests.conftest import random_qkv
from tests.helpers import assert_gradients_close, assert_mostly_agrees
from tests.test_oracle_agreement import assert_matches_oracle

gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")


@pytest.mark.parametrize("G, K, V, importance", [(32, 64, 32, "softmax"), (64, 96, 48, "shared_max")])
def test_large_groups_match_the_oracle(rng, G, K, V, importance):
    """Outputs and selections of the Pallas kernels equal the oracle's (3 layers)."""
    config = HTreeConfig(compression_rate=4, top_k=4, importance=importance, rope_dim=32)
    q, k, v = random_qkv(rng, 1, 70, G, 1, K, V)
    assert_matches_oracle(q, k, v, config, backend="pallas_interpret")


@pytest.mark.parametrize("G, H_kv, K, V, importance", [(32, 2, 64, 32, "shared_max"), (64, 1, 96, 48, "softmax")])
def test_large_groups_equal_the_reference(rng, G, H_kv, K, V, importance):
    """Pallas (interpreted) vs the reference: outputs, selections, the importance export
    (SPEC 8) and the gradients, 3 layers (G >= 32: the wide kernels)."""
    config = HTreeConfig(compression_rate=4, top_k=4, importance=importance, rope_dim=32)
    T = 100
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, 1, T, G * H_kv, H_kv, K, V))
    outs = [htree_attention(q, k, v, config, backend=b, return_selected=True, return_importance=True)
            for b in ("reference", "pallas_interpret")]
    (o_r, sel_r, imp_r), (o_p, sel_p, imp_p) = outs
    assert len(sel_r) == 2
    np.testing.assert_allclose(np.asarray(o_p), np.asarray(o_r), rtol=1e-5, atol=1e-5)
    for a, b in zip(sel_r, sel_p):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    for a, b in zip(imp_r, imp_p):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
    w = jnp.asarray(rng.standard_normal(o_r.shape), jnp.float32)
    grads = [jax.grad(lambda q, k, v, b=b: jnp.sum(htree_attention(q, k, v, config, backend=b) * w),
                      argnums=(0, 1, 2))(q, k, v) for b in ("reference", "pallas_interpret")]
    for a, b in zip(*grads):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5)


def test_mla_dims_equal_the_reference(rng):
    """K = 576 (padded to 1024 inside), rope_dim = 64, V = 512, 128 heads over one kv
    head: forward, selections and gradients, interpreted, 2 layers."""
    config = HTreeConfig(compression_rate=4, top_k=4, rope_dim=64)
    T = 40
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, 1, T, 128, 1, 576, 512))
    (o_r, sel_r), (o_p, sel_p) = (htree_attention(q, k, v, config, backend=b, return_selected=True)
                                  for b in ("reference", "pallas_interpret"))
    np.testing.assert_allclose(np.asarray(o_p), np.asarray(o_r), rtol=1e-5, atol=1e-5)
    for a, b in zip(sel_r, sel_p):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    w = jnp.asarray(rng.standard_normal(o_r.shape), jnp.float32)
    want, got = [jax.grad(lambda q, k, v, b=b: jnp.sum(htree_attention(q, k, v, config, backend=b) * w),
                          argnums=(0, 1, 2))(q, k, v) for b in ("reference", "pallas_interpret")]
    # dk sums 128 heads' terms: float32 sums in another order (the wide backward's head
    # blocks) differ by a share of its scale (1.5e-5 on one element of 23040, jax 0.12).
    assert_gradients_close(got, want, "qkv", rtol=1e-4, atol_share=1e-5)


def decode_against_full(rng, G, K, V, config, T, prefix, backend, dtype=jnp.float32, tol=1e-5):
    q, k, v = (jnp.asarray(x, dtype) for x in random_qkv(rng, 1, T, G, 1, K, V))
    full = np.asarray(htree_attention(q, k, v, config, backend=backend), np.float32)
    cache = init_cache(1, T, 1, K, V, config, dtype)
    o, cache = prefill(q[:, :prefix], k[:, :prefix], v[:, :prefix], cache, config, backend=backend)
    got = [np.asarray(o, np.float32)]
    for t in range(prefix, T):
        o_t, cache = decode_step(q[:, t], k[:, t], v[:, t], cache, config, backend=backend)
        got.append(np.asarray(o_t, np.float32)[:, None])
    np.testing.assert_allclose(np.concatenate(got, axis=1), full, rtol=tol, atol=tol)


@pytest.mark.parametrize("G, K, V, importance", [(32, 96, 48, "shared_max"), (128, 576, 512, "softmax")])
def test_decoding_large_groups_equals_the_full_sequence(rng, G, K, V, importance):
    """The decode kernels (interpreted): split heads read the cache in place, keys in
    power-of-two feature pieces (288 = 256 + 32), values in pieces."""
    config = HTreeConfig(compression_rate=4, top_k=4, rope_dim=32, importance=importance)
    decode_against_full(rng, G, K, V, config, 60, 40, "pallas_interpret")


@pytest.mark.parametrize("backend, G, K, rope_dim, V", [
    ("pallas_interpret", 32, 96, 32, 48),  # values past the first latent run (32): read from both halves
    ("pallas_interpret", 32, 96, 32, 64),  # every latent feature: the bottom's key tiles are the value tiles
    ("reference", 32, 96, 32, 48)])
def test_decoding_with_values_read_from_the_keys(rng, backend, G, K, rope_dim, V):
    """A cache made with `values_from_keys=True` stores no values (DeepSeek's absorbed
    form): prefill then decode steps equal the full-sequence `htree_attention(q, k,
    None, value_dim=V)`, and a cache that stores `v = k[..., :V]` step for step."""
    config = HTreeConfig(compression_rate=4, top_k=4, rope_dim=rope_dim, selection_block=1)
    T, prefix = 60, 40
    q, k, _ = (jnp.asarray(x) for x in random_qkv(rng, 2, T, G, 1, K, V))
    full = np.asarray(htree_attention(q, k, None, config, backend=backend, value_dim=V))
    latent = init_cache(2, T, 1, K, V, config, jnp.float32, values_from_keys=True)
    stored = init_cache(2, T, 1, K, V, config, jnp.float32)
    assert latent.values == () and latent.v_dim == V
    o, latent = prefill(q[:, :prefix], k[:, :prefix], None, latent, config, backend=backend)
    o_s, stored = prefill(q[:, :prefix], k[:, :prefix], k[:, :prefix, :, :V], stored, config, backend=backend)
    got, want = [np.asarray(o)], [np.asarray(o_s)]
    for t in range(prefix, T):
        o_t, latent = decode_step(q[:, t], k[:, t], None, latent, config, backend=backend)
        o_s, stored = decode_step(q[:, t], k[:, t], k[:, t, :, :V], stored, config, backend=backend)
        got.append(np.asarray(o_t)[:, None])
        want.append(np.asarray(o_s)[:, None])
    got = np.concatenate(got, axis=1)
    np.testing.assert_array_equal(got, np.concatenate(want, axis=1))
    np.testing.assert_allclose(got, full, rtol=1e-5, atol=1e-5)
    for a, b in zip(latent.keys, stored.keys):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_values_from_the_keys_cache_refusals():
    config = HTreeConfig(compression_rate=4, top_k=4, rope_dim=32)
    with pytest.raises(ValueError, match="value_dim must be at most the unrotated features of k, K - rope_dim = 64"):
        init_cache(1, 32, 1, 96, 80, config, values_from_keys=True)
    with pytest.raises(ValueError, match="K - rope_dim = 0"):
        init_cache(1, 32, 1, 96, 16, HTreeConfig(compression_rate=4, top_k=4, selection_block=1), values_from_keys=True)
    latent = init_cache(1, 32, 1, 96, 48, config, values_from_keys=True)
    stored = init_cache(1, 32, 1, 96, 48, config)
    q, k, v = jnp.zeros((1, 2, 96)), jnp.zeros((1, 1, 96)), jnp.zeros((1, 1, 48))
    with pytest.raises(ValueError, match="v must be None: this cache reads the values from the keys"):
        decode_step(q, k, v, latent, config)
    with pytest.raises(ValueError, match="v=None needs a cache that reads the values from the keys"):
        decode_step(q, k, None, stored, config)
    with pytest.raises(ValueError, match=r"\(K - rope_dim\) / 2 must be a multiple of 16"):
        # 40 latent features: runs of 20, values past the first need it a multiple of 16
        decode_step(jnp.zeros((1, 16, 64)), jnp.zeros((1, 1, 64)), None,
                    init_cache(1, 32, 1, 64, 32, HTreeConfig(compression_rate=4, top_k=4, rope_dim=24),
                               values_from_keys=True),
                    HTreeConfig(compression_rate=4, top_k=4, rope_dim=24), backend="pallas_interpret")


@pytest.mark.parametrize("half, latent, pieces", [
    (288, 256, ((0, 256, False), (256, 32, True))),  # the MLA shape: 512 latent, 64 RoPE features
    (48, 32, ((0, 32, False), (32, 16, True))),
    (48, 0, ((0, 32, True), (32, 16, True))),  # every feature rotates
    (32, 20, ((0, 32, True),)),  # parts a dot cannot take: every piece rotated (angle 0: identity)
    (32, 32, ((0, 32, True),))])
def test_half_pieces(half, latent, pieces):
    assert half_pieces(half, latent) == pieces


def test_values_in_key_tiles():
    """The bottom merge folds its key tiles as values only where every value piece is
    one of them (a whole run, or both), not a part of a run."""
    assert values_in_key_tiles(cache_value_pieces(512, 576, 256), 576, 256)  # the MLA shape
    assert values_in_key_tiles(cache_value_pieces(64, 96, 32), 96, 32)
    assert not values_in_key_tiles(cache_value_pieces(48, 96, 32), 96, 32)  # 16 of the second run
    assert values_in_key_tiles(cache_value_pieces(256, 576, 256), 576, 256)  # the first run: one tile
    assert not values_in_key_tiles(cache_value_pieces(128, 576, 256), 576, 256)  # half of a tile
    assert not values_in_key_tiles(cache_value_pieces(64), 96, 0)  # no latent part: a value layer


def test_pipeline_stages_of_the_decode():
    """Two stages where two steps' gathered tiles take at most WIDE_STAGED_BYTES (16-bit):
    G > 16 every kernel, the bottom merge's span halved for a value layer; G <= 16 the
    merges at their span, the scores at one; float32 one stage."""
    st = LayerStatic(r=16, tile=1024, group=64, alpha=1.0, importance="softmax", strict_causal=True, log_n=10,
                     top_k=64, precision=None, span=64, num_stages=1, latent_half=256)
    own, keys = pipelined(st, 576, 512, 2, False), pipelined(st, 576, 512, 2, True)
    assert (own.scores.num_stages, own.scores.span, own.merge.num_stages) == (2, 64, 2)
    assert (own.bottom.num_stages, own.bottom.span) == (2, 32)  # 2 * 64 * 1088 * 2 B > WIDE_STAGED_BYTES
    assert (keys.bottom.num_stages, keys.bottom.span) == (2, 64)
    assert 2 * 64 * 1088 * 2 > shared_memory.WIDE_STAGED_BYTES >= 2 * 64 * 576 * 2
    x = pipelined(st, 576, 512, 4, True)  # float32
    assert x.scores == x.merge == x.bottom == st
    gqa = dataclasses.replace(st, group=16)
    x = pipelined(gqa, 128, 128, 2, False)
    assert (x.scores, x.merge.num_stages, x.bottom.num_stages, x.bottom.span) == (gqa, 2, 2, 64)
    x = pipelined(gqa, 576, 512, 2, False)  # the bottom's keys and values do not fit twice: one stage
    assert (x.scores, x.merge.num_stages, x.bottom) == (gqa, 2, gqa)


@pytest.mark.parametrize("split, importance", [(1, "softmax"), (4, "shared_max"), (3, "softmax"), (3, "shared_max")])
def test_decode_keys_kernel_equals_the_xla_keys(rng, split, importance):
    """`decode_keys_pallas` (interpreted) packs the keys `group_keys_from_scores` does,
    with garbage (NaN) where no score was stored: padding rows, positions >= n. Three
    virtual heads (G=48) take the whole group's rows padded to 64 for Triton, which the
    kernel must leave out of every sum."""
    B, Q, H, gp, Mp, G = 2, 2, 2 * split, 16, 128, 12 if split == 1 else 16
    st = LayerStatic(r=4, tile=Mp, group=G, alpha=1.0, importance=importance, strict_causal=True, log_n=7,
                     top_k=8, precision=None)
    n = jnp.asarray(rng.integers(0, Mp + 1, (B, Q, H // split, 1)), jnp.int32)
    n = jnp.repeat(n.at[0, 0].set(1), split, axis=2)  # one query with R empty (n = 1)
    scores = rng.standard_normal((B, Q, H, gp, Mp)).astype(np.float32) * 3
    scores[..., G:, :] = np.nan
    scores = jnp.where(jnp.arange(Mp) < n[..., None], jnp.asarray(scores), jnp.nan)
    shift = jnp.asarray(rng.standard_normal((B, Q, H, gp)), jnp.float32)
    want = np.asarray(group_keys_from_scores(scores, shift, n, st, split))
    got = np.asarray(decode_keys_pallas(scores, shift, n, st, split, interpret=True))
    np.testing.assert_array_equal(got == -1, want == -1)
    # the same importance up to float32 sums in another order: the packed float bits
    # (positions in the low log_n bits) within a few steps of 2**log_n
    assert np.max(np.abs(got.astype(np.int64) - want)) <= 4 << st.log_n
    assert np.mean(got == want) > 0.95


@pytest.mark.parametrize("r, top_k, span, T, K, rope_dim, V", [
    (4, 4, 64, 40, 96, 32, 64),
    (4, 8, 16, 60, 96, 32, 64),  # 2 splits a query: partial states folded in XLA
    (16, 4, 64, 300, 576, 64, 512)])
def test_two_stage_decode_kernels_equal_the_reference_walk(rng, r, top_k, span, T, K, rope_dim, V):
    """bfloat16 at G = 32 (two stages: the scores' held query rows, the selecting merges,
    the bottom merge with its key tiles as values or, at K = 576, V = 512, gathering a
    value layer at half the span; one split: the state carried through the merges),
    interpreted, against the reference walk of the same cache."""
    config = HTreeConfig(compression_rate=r, top_k=top_k, rope_dim=rope_dim, selection_block=1)
    G = 32
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in random_qkv(rng, 1, T, G, 1, K, V))
    for values_from_keys in (False, True):
        cache = init_cache(1, T, 1, K, V, config, jnp.bfloat16, values_from_keys=values_from_keys)
        _, cache = prefill(q, k, None if values_from_keys else v, cache, config, backend="reference")
        qr, _ = rotation_layout(q, k, config)
        positions = jnp.arange(T - 8, T, dtype=jnp.int32)[None]
        want, sel_want = attend_cache(qr[:, -8:], cache.tree, positions, config, "reference")
        got, sel = attend_cache_pallas(qr[:, -8:], cache.tree, positions, config,
                                       block_sizes=DecodeBlockSizes(span=span), interpret=True)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)
        for a, b in zip(sel, sel_want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_decode_block_sizes_refused():
    for rows in (0, 8, 48, 64.0):
        with pytest.raises(ValueError, match="wide_rows must be a power of two >= 16"):
            DecodeBlockSizes(wide_rows=rows)
    for name in ("target_programs", "wide_target_programs"):
        with pytest.raises(ValueError, match=f"{name} must be a positive int"):
            DecodeBlockSizes(**{name: 0})
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    cache = init_cache(1, 32, 1, 32, 32, config, jnp.float32)
    with pytest.raises(TypeError, match="block_sizes must be an htree_jax.DecodeBlockSizes or None"):
        decode_step(jnp.zeros((1, 2, 32)), jnp.zeros((1, 1, 32)), jnp.zeros((1, 1, 32)), cache, config,
                    block_sizes=object())


@pytest.mark.parametrize("G, K, rope_dim, wide_rows", [(128, 576, 64, 16), (32, 64, 24, 64), (48, 64, 32, 64)])
def test_decode_programs_and_feature_pieces(rng, G, K, rope_dim, wide_rows):
    """The decode kernels (interpreted) at 16-head virtual groups (`wide_rows=16`), at a
    RoPE part whose halves (12 features) no dot takes (every piece rotated), and at a
    group (48) whose programs hold 16 heads, equal the reference walk."""
    config = HTreeConfig(compression_rate=4, top_k=4, rope_dim=rope_dim, selection_block=1)
    T, V = 40, 32
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, 1, T, G, 1, K, V))
    _, cache = prefill(q, k, v, init_cache(1, T, 1, K, V, config, jnp.float32), config, backend="reference")
    q, _ = rotation_layout(q, k, config)
    positions = jnp.arange(T - 8, T, dtype=jnp.int32)[None]
    want, sel_want = attend_cache(q[:, -8:], cache.tree, positions, config, "reference")
    got, sel = attend_cache_pallas(q[:, -8:], cache.tree, positions, config,
                                   block_sizes=DecodeBlockSizes(wide_rows=wide_rows), interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    for a, b in zip(sel, sel_want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("G, K, V, match", [(24, 64, 64, "multiple of 16"), (256, 64, 64, "multiple of 16"),
                                            (8, 640, 64, "head dim K"), (8, 64, 1024, "value dim V")])
def test_pallas_refuses_unsupported_shapes(rng, G, K, V, match):
    q, k, v = random_qkv(rng, 1, 16, G, 1, K, V)
    with pytest.raises(ValueError, match=match):
        htree_attention(q, k, v, HTreeConfig(compression_rate=4, top_k=4, selection_block=1), backend="pallas_interpret")


@pytest.mark.parametrize("K, V, match", [(80, 64, "multiple of 32"), (64, 40, "multiple of 16")])
def test_pallas_decoding_refuses_unsupported_dims(K, V, match):
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    cache = init_cache(1, 32, 1, K, V, config, jnp.float32)
    q = jnp.zeros((1, 2, K), jnp.float32)
    with pytest.raises(ValueError, match=match):
        decode_step(q, jnp.zeros((1, 1, K)), jnp.zeros((1, 1, V)), cache, config, backend="pallas_interpret")


MLA = dict(G=128, K=576, V=512)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", [4096, 32768])
def test_mla_shape_compiled_matches_the_reference(rng, T):
    """GPU: the MLA shape, bfloat16, the default top_k: selections agree with the
    reference on >= 99% of parent lists (near-ties of bfloat16-grade scores may flip),
    outputs to bfloat16 tolerance where they agree."""
    config = HTreeConfig(top_k=512 if T > 8192 else 64, rope_dim=64)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in random_qkv(rng, 1, T, MLA["G"], 1, MLA["K"], MLA["V"]))
    o, sel = htree_attention(q, k, v, config, backend="pallas", return_selected=True)
    o_r, sel_r = htree_attention(q, k, v, config, backend="reference", return_selected=True)
    assert len(sel) >= 1
    assert_mostly_agrees(o, sel, o_r, sel_r, MLA["G"])


@pytest.mark.gpu
@gpu
def test_mla_shape_compiled_decoding_equals_the_full_sequence(rng):
    """GPU: prefill and decode steps at the MLA shape equal the full-sequence kernels (float32)."""
    config = HTreeConfig(compression_rate=4, top_k=8, rope_dim=64)  # 1100 -> 275 -> 69 -> 18: 4 layers
    decode_against_full(rng, MLA["G"], MLA["K"], MLA["V"], config, 1100, 1090, "pallas", tol=2e-4)
