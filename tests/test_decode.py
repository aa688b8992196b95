"""Incremental decoding (issue 6): the cache's tree equals `build_tree` of the prefix at
every step, and prefill + token-by-token decoding reproduces the full-sequence output
and selections at every position (strict causality, SPEC 3)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from htree_jax import HTreeConfig, build_tree, htree_attention
from htree_jax.backends import attend_cache
from htree_jax.cache import HTreeCache, append_to_cache, init_cache, reset_rows
from htree_jax.decode import decode_step, prefill
from pallas_kernels.decode.append import append_token_pallas
from pallas_kernels.decode.walk import attend_cache_pallas, query_chunk
from pallas_kernels.shared.configs import DecodeBlockSizes
from tests.conftest import random_qkv
from tests.test_block_kernels import hopper

# (compression_rate, top_k, importance, T, max_len, prompt): the sequence's tree and the
# cache's (sized for max_len) have 2-4 layers, not always as many.
# Kept to two for CI's time (2026-11-28 (3)): a cache with more layers than the sequence
# and an empty prompt; 4-5 layers with a prompt. The ragged, FP8, bound and block tests
# decode other shapes.
CASES = [
    (4, 4, "shared_max", 70, 300, 0),  # T: 70 -> 18 -> 5; cache: 300 -> 75 -> 19 -> 5
    (2, 2, "softmax", 30, 64, 4),  # T: 30 -> 15 -> 8 -> 4; cache: 64 -> 32 -> 16 -> 8 -> 4
]


@pytest.mark.parametrize("r, top_k, importance, T, max_len, prompt", CASES)
def test_decoding_reproduces_the_full_sequence(r, top_k, importance, T, max_len, prompt, rng):
    config = HTreeConfig(compression_rate=r, top_k=top_k, importance=importance, selection_block=1)
    assert 2 <= config.num_layers(T) <= 4 and config.num_layers(max_len) <= 5
    B, H, H_kv, K, V = 2, 4, 2, 8, 6
    # NumPy slices: eager jnp indexing would compile a new slice for every t
    q, k, v = random_qkv(rng, B, T, H, H_kv, K, V)
    full, full_sel = htree_attention(q, k, v, config, backend="reference", return_selected=True)
    cache = init_cache(B, max_len, H_kv, K, V, config)
    outputs, selections, positions = [], [], []
    if prompt:
        o, cache, sel = prefill(q[:, :prompt], k[:, :prompt], v[:, :prompt], cache, config, return_selected=True)
        outputs.append(o)
        selections.append(sel)
        positions += list(range(prompt))
    for t in range(prompt, T):
        if t % 2:  # decode_step (no selections returned)
            o, cache = decode_step(q[:, t], k[:, t], v[:, t], cache, config)
            outputs.append(o[:, None])
        else:  # the same walk through prefill of one token, with its selections
            o, cache, sel = prefill(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], cache, config, return_selected=True)
            outputs.append(o)
            selections.append(sel)
            positions.append(t)
        assert np.asarray(cache.lengths).tolist() == [t + 1] * B
        assert_tree_is_build_tree(cache, k[:, :t + 1], v[:, :t + 1], config)
    got = jnp.concatenate(outputs, axis=1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(full), rtol=1e-5, atol=1e-5)
    # The cache's tree may have more layers than T's: those above select every candidate,
    # so the lowest L(T) - 1 selections must be the full run's, exactly.
    num = len(full_sel)
    for depth in range(num):
        step_sel = jnp.concatenate([s[len(s) - num + depth] for s in selections], axis=1)
        np.testing.assert_array_equal(np.asarray(step_sel), np.asarray(full_sel[depth])[:, positions])


def numpy_tree(x, num_layers: int, r: int):
    """The tree of SPEC 1 in NumPy, float32 sums child by child (the order `build_tree`
    uses), each layer rounded to the stored dtype: `num_layers` layers, bottom first."""
    layers = [np.asarray(x)]
    for _ in range(1, num_layers):
        below = layers[-1].astype(np.float32)
        N = below.shape[1]
        P = -(-N // r)
        padded = np.zeros((below.shape[0], P * r) + below.shape[2:], np.float32)
        padded[:, :N] = below
        children = padded.reshape((below.shape[0], P, r) + below.shape[2:])
        sums = children[:, :, 0]
        for c in range(1, r):
            sums = sums + children[:, :, c]
        counts = np.minimum(N - np.arange(P) * r, r)
        reciprocal = (1.0 / counts).astype(np.float32)  # as build_tree: sum * (1/count)
        layers.append((sums * reciprocal[None, :, None, None]).astype(layers[0].dtype))
    return layers


def assert_tree_is_build_tree(cache, k, v, config):
    """Every layer of the cache equals the prefix's tree (NumPy, and `build_tree` for the
    layers it has), bit for bit: nodes up to the rightmost; the rest still zero."""
    n, r, L = k.shape[1], config.compression_rate, len(cache.keys)
    for name, x, stored in (("keys", k, cache.keys), ("values", v, cache.values)):
        want = numpy_tree(x, L, r)
        for l in range(L):
            N = want[l].shape[1]
            got = np.asarray(stored[l])
            np.testing.assert_array_equal(got[:, :N], want[l], err_msg=f"{name} layer {l}, n={n}")
            assert not np.any(got[:, N:]), f"{name} layer {l}: nodes past the prefix must be zero"


def test_numpy_tree_is_build_tree(rng):
    for dtype in (np.float32, jnp.bfloat16):
        k = jnp.asarray(rng.standard_normal((2, 75, 2, 8)), dtype)
        config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
        for l, (kl, _) in enumerate(build_tree(k, k, config)):
            np.testing.assert_array_equal(np.asarray(kl), numpy_tree(k, config.num_layers(75), 4)[l])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_narrow_dtypes_tree_and_output(dtype, rng):
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    B, T, H, H_kv, K, V = 1, 50, 4, 2, 8, 8
    q, k, v = (jnp.asarray(x, dtype) for x in random_qkv(rng, B, T, H, H_kv, K, V))
    full = htree_attention(q, k, v, config, backend="reference")
    cache = init_cache(B, 64, H_kv, K, V, config, dtype)
    o1, cache = prefill(q[:, :20], k[:, :20], v[:, :20], cache, config)
    o2, cache = prefill(q[:, 20:], k[:, 20:], v[:, 20:], cache, config)  # a second chunk
    assert o1.dtype == dtype
    assert_tree_is_build_tree(cache, k, v, config)
    got = jnp.concatenate([o1, o2], axis=1).astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(full, np.float32), rtol=1e-2, atol=1e-2)


def test_decode_step_under_jit_with_a_donated_cache(rng):
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    B, T, H, H_kv, K, V = 2, 40, 2, 1, 8, 8
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, B, T, H, H_kv, K, V))
    full = htree_attention(q, k, v, config, backend="reference")
    step = jax.jit(lambda q, k, v, c: decode_step(q, k, v, c, config), donate_argnums=3)
    cache = init_cache(B, T, H_kv, K, V, config)
    outs = []
    for t in range(T):
        o, cache = step(q[:, t], k[:, t], v[:, t], cache)
        outs.append(o)
    np.testing.assert_allclose(np.asarray(jnp.stack(outs, 1)), np.asarray(full), rtol=1e-5, atol=1e-5)


def test_reusing_a_donated_cache_says_so(rng):
    """prefill/decode_step update the cache in place (it is donated): passing the old one
    again is refused with an error that names the donation and the fix."""
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, 1, 8, 2, 1, 8, 8))
    cache = init_cache(1, 16, 1, 8, 8, config)
    _, new_cache = prefill(q, k, v, cache, config, backend="reference")
    assert any(x.is_deleted() for x in jax.tree_util.tree_leaves(cache))  # donated
    with pytest.raises(ValueError, match="donated to an earlier prefill/decode_step.*pass the cache that call returned"):
        decode_step(q[:, 0], k[:, 0], v[:, 0], cache, config, backend="reference")
    with pytest.raises(ValueError, match="donated"):
        prefill(q, k, v, cache, config, backend="reference")
    o, _ = decode_step(q[:, 0], k[:, 0], v[:, 0], new_cache, config, backend="reference")
    assert np.all(np.isfinite(np.asarray(o)))


def test_errors(rng):
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    B, H, H_kv, K, V = 1, 2, 1, 8, 8
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, B, 6, H, H_kv, K, V))
    cache = init_cache(B, 5, H_kv, K, V, config)
    with pytest.raises(ValueError, match="cache overflow: appending 6 token"):
        prefill(q, k, v, cache, config)
    o, cache = prefill(q[:, :5], k[:, :5], v[:, :5], cache, config)
    with pytest.raises(ValueError, match="cache overflow: appending 1 token.*holding 5 of max_len=5"):
        decode_step(q[:, 5], k[:, 5], v[:, 5], cache, config)
    # Under jit: no error, no callback; the row that would overflow answers NaN and its
    # cache rows stay as they were (SPEC 9).
    traced = jax.jit(lambda c: decode_step(q[:, 5], k[:, 5], v[:, 5], c, config))
    o_over, after = traced(cache)
    assert np.all(np.isnan(np.asarray(o_over)))
    for a, b in zip(jax.tree_util.tree_leaves(after), jax.tree_util.tree_leaves(cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    cache = init_cache(B, 16, H_kv, K, V, config)
    with pytest.raises(ValueError, match=r"k must have shape \[B, S, H_kv, K\] = \[1, S, 1, 8\]"):
        prefill(q, jnp.concatenate([k, k], 2), v, cache, config)
    with pytest.raises(ValueError, match="q must have shape"):
        decode_step(q, k[:, 0], v[:, 0], cache, config)
    with pytest.raises(ValueError, match="v must have shape"):
        decode_step(q[:, 0], k[:, 0], v[:, 0, :, :4], cache, config)
    with pytest.raises(ValueError, match="multiple of H_kv"):
        prefill(jnp.zeros((1, 6, 0, K)), k, v, cache, config)
    with pytest.raises(TypeError, match="must have the cache's dtype float32"):
        prefill(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), cache, config)
    with pytest.raises(ValueError, match="at least one token"):
        prefill(q[:, :0], k[:, :0], v[:, :0], cache, config)
    with pytest.raises(ValueError, match="use the config the cache was made with"):
        prefill(q, k, v, cache, HTreeConfig(compression_rate=2, top_k=2, selection_block=1))
    with pytest.raises(ValueError, match="strict_causal must be True for decoding"):
        init_cache(B, 16, H_kv, K, V, HTreeConfig(strict_causal=False, selection_block=1))
    with pytest.raises(ValueError, match="backend must be one of"):
        prefill(q, k, v, cache, config, backend="cuda")
    with pytest.raises(ValueError, match="Pallas decoding supports head dim K in"):
        prefill(q, k, v, cache, config, backend="pallas_interpret")  # K = 8
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="backend 'pallas' needs a CUDA GPU"):
            prefill(q, k, v, cache, config, backend="pallas")
    with pytest.raises(ValueError, match="max_len must be a positive int"):
        init_cache(B, 0, H_kv, K, V, config)
    with pytest.raises(ValueError, match="k_dim must be even"):
        init_cache(B, 8, H_kv, 7, V, config)
    with pytest.raises(TypeError, match="cache must be an HTreeCache"):
        prefill(q, k, v, {"keys": ()}, config)


# (compression_rate, top_k, importance, T, max_len, prompt): 2-4 layers in the cache.
PALLAS_CASES = [
    (4, 4, "softmax", 40, 150, 33),  # T: 40 -> 10; cache: 150 -> 38 -> 10
]


@pytest.mark.parametrize("r, top_k, importance, T, max_len, prompt", PALLAS_CASES)
def test_pallas_decoding_reproduces_the_full_sequence(r, top_k, importance, T, max_len, prompt, rng):
    """The Pallas decode kernels (interpreted): a prompt, then token by token, give the
    full-sequence output and selections of the reference at every position."""
    config = HTreeConfig(compression_rate=r, top_k=top_k, importance=importance, selection_block=1)
    B, H, H_kv, K, V = 2, 4, 2, 32, 32
    q, k, v = random_qkv(rng, B, T, H, H_kv, K, V)
    full, full_sel = htree_attention(q, k, v, config, backend="reference", return_selected=True)
    cache = init_cache(B, max_len, H_kv, K, V, config)
    outputs, selections, positions = [], [], []
    start = max(prompt, 1)
    o, cache, sel = prefill(q[:, :start], k[:, :start], v[:, :start], cache, config, backend="pallas_interpret",
                            return_selected=True)
    outputs.append(o)
    selections.append(sel)
    positions += list(range(start))
    for t in range(start, T):
        if t % 3:
            o, cache = decode_step(q[:, t], k[:, t], v[:, t], cache, config, backend="pallas_interpret")
            outputs.append(o[:, None])
        else:
            o, cache, sel = prefill(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], cache, config,
                                    backend="pallas_interpret", return_selected=True)
            outputs.append(o)
            selections.append(sel)
            positions.append(t)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outputs, axis=1)), np.asarray(full), rtol=1e-5, atol=1e-5)
    num = len(full_sel)
    assert num >= 1
    for depth in range(num):
        step_sel = jnp.concatenate([s[len(s) - num + depth] for s in selections], axis=1)
        np.testing.assert_array_equal(np.asarray(step_sel), np.asarray(full_sel[depth])[:, positions])


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_decode_compiled_matches_reference_on_gpu(dtype, rng):
    """Compiled kernels: a 3-layer cache (2048 -> 128 -> 8), a prompt and 6 steps, the
    Pallas decode against the reference walk on the same cache."""
    config = HTreeConfig(compression_rate=16, top_k=8, selection_block=1)
    B, T, H, H_kv, K, V, prompt = 2, 2048, 8, 2, 64, 128, 2040
    q, k, v = (jnp.asarray(x, dtype) for x in random_qkv(rng, B, T, H, H_kv, K, V))
    results = {}
    for backend in ("pallas", "reference"):
        cache = init_cache(B, T, H_kv, K, V, config, dtype)
        o, cache, sel = prefill(q[:, :prompt], k[:, :prompt], v[:, :prompt], cache, config, backend=backend,
                                return_selected=True)
        outs, sels = [o], [sel]
        for t in range(prompt, T - 1):  # one token at a time, with its selections
            o, cache, sel = prefill(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], cache, config, backend=backend,
                                    return_selected=True)
            outs.append(o)
            sels.append(sel)
        o_t, cache = decode_step(q[:, -1], k[:, -1], v[:, -1], cache, config, backend=backend)
        outs.append(o_t[:, None])
        sels = [jnp.concatenate([s[depth] for s in sels], axis=1) for depth in range(len(sel))]
        results[backend] = (jnp.concatenate(outs, axis=1).astype(jnp.float32), sels)
    (o_p, sel_p), (o_r, sel_r) = results["pallas"], results["reference"]
    same = jnp.ones((B, T - 1, H_kv), bool)
    for a, b in zip(sel_p, sel_r):
        assert float(jnp.mean(a == b)) >= 0.99
        same &= jnp.all(a == b, axis=-1)
    # Where a selection differs (a near tie decided by the last bits of a score) the
    # outputs differ; compare the queries whose selections all agree, and the last step.
    same = np.concatenate([np.repeat(np.asarray(same), H // H_kv, axis=2), np.ones((B, 1, H), bool)], axis=1)
    assert same.mean() >= 0.99
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(o_p)[same], np.asarray(o_r)[same], rtol=tol, atol=tol)


def test_pallas_attend_cache_in_chunks_equals_the_reference_walk(rng):
    """`attend_cache_pallas` against its twin, the reference walk over the same cache,
    with the queries in several chunks (the last one padded), as a long prefill runs."""

    config = HTreeConfig(compression_rate=4, top_k=4, importance="shared_max", selection_block=1)
    B, S, H, H_kv, K, V = 2, 40, 4, 1, 32, 64  # G = 4
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, B, S, H, H_kv, K, V))
    cache = init_cache(B, 100, H_kv, K, V, config)  # 100 -> 25 -> 7: 3 layers
    _, cache = prefill(q, k, v, cache, config, backend="reference")
    positions = jnp.arange(S, dtype=jnp.int32)
    per_query = B * H_kv * 16 * (4 * 16 + 12)  # Mp = 16 candidates, 16 rows
    blocks = DecodeBlockSizes(chunk_budget_bytes=7 * per_query)
    assert query_chunk(config, B, S, H_kv, 16, 16, blocks) == 7  # 6 chunks, the last padded
    o, sel = attend_cache_pallas(q, cache.tree, positions, config, block_sizes=blocks, interpret=True)
    o_ref, sel_ref = attend_cache(q, cache.tree, jnp.broadcast_to(positions, (B, S)), config, "reference")
    assert len(sel) == len(sel_ref) == 2
    for a, b in zip(sel, sel_ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), rtol=1e-5, atol=1e-5)


# ---- per-row lengths (SPEC 9) -------------------------------------------------------------


def _own_sequence(q, k, v, config, b, tokens):
    """Row `b`'s full-sequence output `[T, H, V]` and selections over `tokens` (indices)."""
    o, sel = htree_attention(q[b:b + 1, tokens], k[b:b + 1, tokens], v[b:b + 1, tokens], config,
                             backend="reference", return_selected=True)
    return np.asarray(o[0]), [np.asarray(s[0]) for s in sel]


ON_GPU = [pytest.param("pallas", selection, marks=[pytest.mark.gpu, pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="needs a CUDA GPU")]) for selection in ("mean", "bound")]


# The kernels with each rule (the reference's ragged rows: `test_block_selection`'s and
# `test_fp8_cache`'s decoding, and the reference runs every full-sequence comparison).
@pytest.mark.parametrize("backend, selection", [*ON_GPU, ("pallas_interpret", "mean"), ("pallas_interpret", "bound")])
def test_ragged_rows_equal_their_own_full_sequences(rng, backend, selection):
    """Prompts of 0, 17 and 40 tokens (right-padded to 40), then 10 steps per row: every
    row equals, position by position, its own full-sequence output, with identical
    selections (a 3-layer tree). Compiled (`pallas` on a GPU): float32 at 1e-4. With
    `selection="bound"` the cache keeps the radii as tokens arrive (SPEC 11)."""
    config = HTreeConfig(compression_rate=4, top_k=4, selection=selection, selection_block=1)
    tol = 1e-4 if backend == "pallas" else 1e-5
    B, H, H_kv, K, V = 3, 4, 2, 32, 32
    prompts, steps, S = np.array([0, 17, 40]), 10, 40
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, B, S + steps, H, H_kv, K, V))
    # Row b's sequence: its prompt, then the step tokens (positions S.. of the inputs).
    want = [_own_sequence(q, k, v, config, b, np.r_[np.arange(prompts[b]), np.arange(S, S + steps)])
            for b in range(B)]
    cache = init_cache(B, 128, H_kv, K, V, config)
    assert config.num_layers(128) >= 3
    o, cache, sel = prefill(q[:, :S], k[:, :S], v[:, :S], cache, config, lengths=jnp.asarray(prompts),
                            backend=backend, return_selected=True)
    for b in range(B):
        n = prompts[b]
        np.testing.assert_allclose(np.asarray(o[b, :n]), want[b][0][:n], rtol=tol, atol=tol)
        assert np.all(np.asarray(o[b, n:]) == 0)  # padding positions
        # The cache's tree may have more layers than the row's: the lowest ones must match.
        for got, ref in zip(sel[len(sel) - len(want[b][1]):], want[b][1]):
            np.testing.assert_array_equal(np.asarray(got[b, :n]), ref[:n])
        assert all(np.all(np.asarray(got[b, n:]) == -1) for got in sel)
    step = jax.jit(lambda q, k, v, c: decode_step(q, k, v, c, config, backend=backend), donate_argnums=3)
    for i in range(steps):
        o_t, cache = step(q[:, S + i], k[:, S + i], v[:, S + i], cache)
        for b in range(B):
            np.testing.assert_allclose(np.asarray(o_t[b]), want[b][0][prompts[b] + i], rtol=tol, atol=tol)
    assert np.asarray(cache.lengths).tolist() == (prompts + steps).tolist()


def test_reset_row_restarts_while_its_neighbours_continue(rng):
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    B, H, H_kv, K, V = 2, 2, 1, 8, 8
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, B, 90, H, H_kv, K, V))
    cache = init_cache(B, 96, H_kv, K, V, config)
    _, cache = prefill(q[:, :20], k[:, :20], v[:, :20], cache, config)
    cache = jax.jit(reset_rows)(cache, jnp.asarray([True, False]))
    assert np.asarray(cache.lengths).tolist() == [0, 20]
    o, cache = prefill(q[:, 20:90], k[:, 20:90], v[:, 20:90], cache, config)
    # Row 0 is a new sequence of the 70 tokens 20..89 (a tree of 3 layers, selecting at
    # two); row 1 goes on to 90 tokens.
    assert config.num_layers(70) == 3
    new, selected = htree_attention(q[:1, 20:90], k[:1, 20:90], v[:1, 20:90], config, backend="reference",
                                    return_selected=True)
    assert np.any(np.asarray(selected[0]) >= 0) and np.any(np.asarray(selected[1]) >= 0)
    old = htree_attention(q[1:, :90], k[1:, :90], v[1:, :90], config, backend="reference")
    np.testing.assert_allclose(np.asarray(o[0]), np.asarray(new[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(o[1]), np.asarray(old[0, 20:90]), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"rows must be a bool array of shape \[B\] = \[2\]"):
        reset_rows(cache, jnp.asarray([1, 0]))


def test_overflow_of_one_row_under_jit_is_nan_for_that_row_only(rng):
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    B, H, H_kv, K, V = 2, 2, 1, 8, 8
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, B, 9, H, H_kv, K, V))
    cache = init_cache(B, 8, H_kv, K, V, config)
    _, cache = prefill(q[:, :8], k[:, :8], v[:, :8], cache, config, lengths=jnp.asarray([8, 5]))
    with pytest.raises(ValueError, match="cache overflow: appending 1 token.*row 0 holding 8 of max_len=8"):
        decode_step(q[:, 8], k[:, 8], v[:, 8], cache, config)
    o, after = jax.jit(lambda c: decode_step(q[:, 8], k[:, 8], v[:, 8], c, config))(cache)
    assert np.all(np.isnan(np.asarray(o[0]))) and np.all(np.isfinite(np.asarray(o[1])))
    assert np.asarray(after.lengths).tolist() == [8, 6]
    np.testing.assert_array_equal(np.asarray(after.keys[0][0]), np.asarray(cache.keys[0][0]))


@pytest.mark.parametrize("backend", ["reference", "pallas_interpret"])
def test_block_selection_overflow_of_one_row_under_jit_leaves_that_row_alone(rng, backend):
    """Block selection (SPEC 12) past `max_len`: eagerly refused; under `jit` the full
    row answers NaN and keeps its tokens, recent queries and block selections, while
    the other row steps on and equals its full sequence (3 layers)."""
    config = HTreeConfig(compression_rate=4, top_k=2)
    assert config.selects_by_block and config.num_layers(40) == 3
    B, H, H_kv, K, V = 2, 2, 1, 32, 32
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, B, 41, H, H_kv, K, V))
    cache = init_cache(B, 40, H_kv, K, V, config, num_heads=H)
    _, cache = prefill(q[:, :40], k[:, :40], v[:, :40], cache, config, lengths=jnp.asarray([40, 21]), backend=backend)
    with pytest.raises(ValueError, match="cache overflow: appending 1 token.*row 0 holding 40 of max_len=40"):
        decode_step(q[:, 40], k[:, 40], v[:, 40], cache, config, backend=backend)
    kept = jax.tree.map(np.asarray, (cache.keys, cache.values, cache.queries, cache.selections))
    o, after = jax.jit(lambda c: decode_step(q[:, 21], k[:, 21], v[:, 21], c, config, backend=backend))(cache)
    assert np.all(np.isnan(np.asarray(o[0]))) and np.asarray(after.lengths).tolist() == [40, 22]
    for got, was in zip(jax.tree.leaves((after.keys, after.values, after.queries, after.selections)),
                        jax.tree.leaves(kept)):
        np.testing.assert_array_equal(np.asarray(got[0]), was[0])
    full = htree_attention(q[1:, :22], k[1:, :22], v[1:, :22], config, backend="reference")
    np.testing.assert_allclose(np.asarray(o[1]), np.asarray(full[0, 21]), rtol=2e-5, atol=2e-5)


def test_jitted_default_step_has_no_callback(rng):
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, 2, 3, 2, 1, 32, 32))
    cache = init_cache(2, 16, 1, 32, 32, config)
    for backend in ("reference", "pallas_interpret"):
        step = jaxpr_text(lambda c: decode_step(q[:, 0], k[:, 0], v[:, 0], c, config, backend=backend), cache)
        fill = jaxpr_text(lambda c: prefill(q, k, v, c, config, lengths=jnp.asarray([3, 1]), backend=backend), cache)
        for text in (step, fill):
            assert not re.findall(r"\w*callback\w*|debug_print", text)


def jaxpr_text(fn, *args):
    return str(jax.make_jaxpr(jax.jit(fn))(*args))


def test_bad_lengths_are_refused(rng):
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, 2, 6, 2, 1, 8, 8))
    cache = init_cache(2, 16, 1, 8, 8, config)
    with pytest.raises(ValueError, match=r"lengths must be an int array of shape \[B\] = \[2\]"):
        prefill(q, k, v, cache, config, lengths=jnp.asarray([3]))
    with pytest.raises(ValueError, match=r"lengths must be an int array"):
        prefill(q, k, v, cache, config, lengths=jnp.asarray([3.0, 1.0]))
    with pytest.raises(ValueError, match=r"lengths must be in \[0, S\] = \[0, 6\]"):
        prefill(q, k, v, cache, config, lengths=jnp.asarray([-1, 2]))
    with pytest.raises(ValueError, match=r"lengths must be in \[0, S\] = \[0, 6\]"):
        prefill(q, k, v, cache, config, lengths=jnp.asarray([7, 2]))
    small = init_cache(2, 4, 1, 8, 8, config)
    with pytest.raises(ValueError, match="cache overflow: appending 5 token.*row 0"):
        prefill(q, k, v, small, config, lengths=jnp.asarray([5, 2]))
    with pytest.raises(ValueError, match=r"cache.lengths must be int32 \[B\] = \[2\]"):
        prefill(q, k, v, HTreeCache(cache.keys, cache.values, jnp.zeros((), jnp.int32)), config)


# ---- the append in one kernel (issue 52) -------------------------------------------------

# (r, selection, dtype, K, V, max_len, values from the keys)
APPEND_CASES = [
    (4, "mean", jnp.float32, 32, 32, 150, False),  # 150 -> 38 -> 10: 3 layers
    (16, "bound", jnp.bfloat16, 96, 64, 300, False),  # K = 64 + 32: two pieces
    (4, "mean", jnp.bfloat16, 64, 32, 150, True),  # keys only
    (8, "mean", jnp.float16, 32, 48, 20, False),  # V = 32 + 16; 20 -> 3
]


@pytest.mark.parametrize("r, selection, dtype, K, V, max_len, from_keys", APPEND_CASES)
def test_append_kernel_equals_the_xla_append_bit_for_bit(r, selection, dtype, K, V, max_len, from_keys, rng):
    """`append_token_pallas` (interpreted) through `append_to_cache(tree_writer=)`: one
    token a row at ragged lengths (a row at the end of a node, one at `max_len - 1`, a
    row that appends nothing), every layer, the radii, the lengths: the XLA append's
    arrays, bit for bit; and the tree `build_tree` makes of each row's tokens."""
    config = HTreeConfig(compression_rate=r, top_k=4, selection=selection, rope_dim=16 if from_keys else None, selection_block=1)
    B, H_kv = 4, 2
    _, k, v = (jnp.asarray(x, dtype) for x in random_qkv(rng, B, max_len, H_kv, H_kv, K, V))
    lengths = jnp.asarray([r - 1, max_len - 1, max_len // 3, 5], jnp.int32)
    cache = init_cache(B, max_len, H_kv, K, V, config, dtype, values_from_keys=from_keys)
    _, cache = prefill(jnp.zeros((B, max_len, H_kv, K), dtype), k, None if from_keys else v, cache, config,
                       lengths=lengths, backend="reference")
    counts = jnp.asarray([1, 1, 1, 0], jnp.int32)
    token_k, token_v = k[jnp.arange(B), lengths][:, None], v[jnp.arange(B), lengths][:, None]
    token_v = None if from_keys else token_v
    xla = append_to_cache(cache, token_k, token_v, config, counts)
    writer = functools.partial(append_token_pallas, r=r, interpret=True)
    fresh = jax.tree.map(jnp.copy, cache)  # the kernel writes in place
    kernel = append_to_cache(fresh, token_k, token_v, config, counts, writer)
    for a, b in zip(jax.tree.leaves(kernel), jax.tree.leaves(xla)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    assert np.array_equal(np.asarray(kernel.lengths), np.asarray(lengths + counts))
    row = 1  # the row filled to max_len: the whole tree of its tokens as stored (keys in `rope_layout`)
    tokens = kernel.keys[0][row:row + 1]
    whole = build_tree(tokens, tokens if from_keys else kernel.values[0][row:row + 1], config)
    for l, (kl, vl) in enumerate(whole):
        np.testing.assert_array_equal(np.asarray(kernel.keys[l][row:row + 1]).view(np.uint8),
                                      np.asarray(kl).view(np.uint8))
        if not from_keys:
            np.testing.assert_array_equal(np.asarray(kernel.values[l][row:row + 1]).view(np.uint8),
                                          np.asarray(vl).view(np.uint8))


def test_append_writer_is_refused_where_it_does_not_apply(rng):
    """`append_to_cache(tree_writer=)` takes one token a row and no FP8 tokens, saying so."""
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    cache = init_cache(2, 32, 1, 16, 16, config, jnp.bfloat16, token_dtype=jnp.float8_e4m3fn)
    k = jnp.zeros((2, 1, 1, 16), jnp.bfloat16)
    writer = functools.partial(append_token_pallas, r=4, interpret=True)
    with pytest.raises(ValueError, match="one token a row to a cache without FP8 tokens"):
        append_to_cache(cache, k, k, config, None, writer)
    plain = init_cache(2, 32, 1, 16, 16, config, jnp.bfloat16)
    with pytest.raises(ValueError, match="one token a row"):
        append_to_cache(plain, jnp.concatenate([k, k], 1), jnp.concatenate([k, k], 1), config, None, writer)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("selection, K", [("mean", 128), ("bound", 128), ("bound", 576)])
def test_append_kernel_compiled_equals_the_xla_append_on_gpu(selection, K, rng):
    """Compiled, bf16, r = 16, a 3-layer cache (8192 -> 512 -> 32), ragged rows: the
    kernel's tree and radii equal the XLA append's bit for bit."""
    config = HTreeConfig(compression_rate=16, top_k=16, selection=selection, selection_block=1)
    B, H_kv, V, max_len = 4, 2, 128, 8192
    _, k, v = (jnp.asarray(x, jnp.bfloat16) for x in random_qkv(rng, B, max_len, H_kv, H_kv, K, V))
    lengths = jnp.asarray([255, max_len - 1, 4100, 17], jnp.int32)
    cache = init_cache(B, max_len, H_kv, K, V, config, jnp.bfloat16)
    _, cache = prefill(jnp.zeros((B, max_len, H_kv, K), jnp.bfloat16), k, v, cache, config, lengths=lengths,
                       backend="reference")
    counts = jnp.asarray([1, 1, 1, 0], jnp.int32)
    token_k, token_v = k[jnp.arange(B), lengths][:, None], v[jnp.arange(B), lengths][:, None]
    xla = jax.jit(lambda c: append_to_cache(c, token_k, token_v, config, counts))(cache)
    writer = functools.partial(append_token_pallas, r=16)
    kernel = jax.jit(lambda c: append_to_cache(c, token_k, token_v, config, counts, writer))(cache)
    for a, b in zip(jax.tree.leaves(kernel), jax.tree.leaves(xla)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


# Groups of 16 * n heads for n not a power of two run as n virtual kv heads of 16; the
# importance keys take the whole group's rows again (`decode_keys_pallas`), padded to a
# power of two for Triton (a gate case at G=48 found the unpadded launch did not lower).
ODD_GROUPS = [48, 112]


@pytest.mark.parametrize("selection_block", [1, 4])
def test_decoding_a_group_of_48_heads_reproduces_the_full_sequence(selection_block, rng):
    """Interpreted decode kernels at G=48 (three virtual kv heads of 16, their rows padded
    to 64 where the keys are packed): prefill then steps equal the reference's full
    sequence, per query and by block, with `shared_max` (the heads' shifts shared)."""
    config = HTreeConfig(compression_rate=4, top_k=4, importance="shared_max", selection_block=selection_block)
    B, T, H_kv, G, K = 1, 40, 1, 48, 32
    q, k, v = random_qkv(rng, B, T, G * H_kv, H_kv, K, K)
    full = htree_attention(q, k, v, config, backend="reference")
    cache = init_cache(B, T, H_kv, K, K, config, num_heads=G * H_kv)
    prompt = T - 6
    o, cache = prefill(q[:, :prompt], k[:, :prompt], v[:, :prompt], cache, config, backend="pallas_interpret")
    outputs = [o]
    for t in range(prompt, T):
        o, cache = decode_step(q[:, t], k[:, t], v[:, t], cache, config, backend="pallas_interpret")
        outputs.append(o[:, None])
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outputs, axis=1)), np.asarray(full), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("selection_block", [1, 16])
@pytest.mark.parametrize("G", ODD_GROUPS)
def test_decoding_groups_of_16_times_an_odd_count_lowers_to_triton(G, selection_block, monkeypatch):
    """A decode step at G = 48 and 112 (the API's multiples of 16 that are not powers of
    two) lowered to Triton for a Hopper GPU on the CPU, each selection: interpret mode
    cannot see the power-of-two rule that the unpadded keys launch broke."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # backend="pallas" asks for a GPU
    config, T, K = HTreeConfig(top_k=8, selection_block=selection_block), 600, 64
    cache = jax.eval_shape(lambda: init_cache(1, T, 1, K, K, config, jnp.bfloat16, num_heads=G))
    q, kv = jax.ShapeDtypeStruct((1, G, K), jnp.bfloat16), jax.ShapeDtypeStruct((1, 1, K), jnp.bfloat16)
    step = jax.jit(lambda q, k, v, c: decode_step(q, k, v, c, config, backend="pallas"))
    with hopper():
        text = step.trace(q, kv, kv, cache).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text
