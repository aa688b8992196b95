"""SPEC 10: a NaN or infinity at position `p` of `k` or `v` changes no output at `t < p`,
on every backend and through the decode cache. From `p` on, that kv head's group reads
NaN (as in dense causal attention); other kv heads and batch rows are untouched."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from htree_jax import HTreeConfig, decode_step, htree_attention, init_cache, prefill
from tests.conftest import random_qkv

# (compression_rate, top_k, T): 1, 2 and 3 layers; top_k=1 keeps only the rightmost
# node, so a NaN importance outranking it (the fault this guards) would show at once.
CASES = [(16, 4, 30), (16, 1, 40), (4, 4, 150)]
BAD = [("v", np.nan), ("k", np.nan), ("v", np.inf), ("k", -np.inf)]


def _with_bad_token(k, v, which, value, p, kv_head):
    k, v = np.array(k), np.array(v)
    (k if which == "k" else v)[:, p, kv_head, 1] = value
    return k, v


def assert_causal_under_non_finite(o_clean, o_bad, p, kv_head, G):
    """Rows before `p` bitwise as without the bad token; the bad head group NaN from `p`
    on; the other kv heads bitwise untouched."""
    o_clean, o_bad = np.asarray(o_clean, np.float32), np.asarray(o_bad, np.float32)
    group = slice(kv_head * G, (kv_head + 1) * G)
    np.testing.assert_array_equal(o_bad[:, :p], o_clean[:, :p])
    assert np.all(np.isnan(o_bad[:, p:, group]))
    others = np.ones(o_bad.shape[2], bool)
    others[group] = False
    np.testing.assert_array_equal(o_bad[:, :, others], o_clean[:, :, others])
    assert np.all(np.isfinite(o_clean))


@pytest.mark.parametrize("backend", ["reference", "pallas_interpret"])
@pytest.mark.parametrize("r, top_k, T", CASES)
def test_non_finite_k_or_v_leaves_earlier_outputs_alone(rng, backend, r, top_k, T):
    config = HTreeConfig(compression_rate=r, top_k=top_k, selection_block=1)
    G, H_kv = 2, 2
    q, k, v = random_qkv(rng, 1, T, G * H_kv, H_kv, 32, 32)
    o_clean = htree_attention(q, k, v, config, backend=backend)
    for i, (which, value) in enumerate(BAD):
        p = int(rng.integers(1, T))
        k_bad, v_bad = _with_bad_token(k, v, which, value, p, kv_head=i % H_kv)
        o_bad = htree_attention(q, k_bad, v_bad, config, backend=backend)
        assert_causal_under_non_finite(o_clean, o_bad, p, i % H_kv, G)


@pytest.mark.parametrize("backend", ["reference", "pallas_interpret"])
def test_gradients_of_earlier_outputs_ignore_a_non_finite_token(rng, backend):
    """A loss over the outputs before `p` has the same gradients (bitwise) with a NaN or
    infinity at `p` as without: finite, and zero for the bad entries themselves."""
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    T, p = 150, 97
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, 1, T, 4, 2, 32, 32))
    w = jnp.asarray(rng.standard_normal((1, p, 4, 32)).astype(np.float32))
    loss = lambda q, k, v: jnp.sum(htree_attention(q, k, v, config, backend=backend)[:, :p] * w)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    clean = grads(q, k, v)
    bad = grads(q, k.at[0, p, 1, 5].set(jnp.nan), v.at[0, p, 0, 2].set(jnp.inf))
    for name, got, want in zip("qkv", bad, clean):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
    assert np.all(np.isfinite(np.asarray(bad[0]))) and float(jnp.max(jnp.abs(bad[1]))) > 0


@pytest.mark.parametrize("backend", ["reference", "pallas_interpret"])
def test_non_finite_through_the_decode_cache(rng, backend):
    """A prompt with a NaN in row 0's values at `p`: row 0 equals its clean outputs before
    `p`, NaN in that value feature from `p` on, also for every token decoded after it;
    row 1 is untouched.
    (`p` is the last child of a layer-1 node, which is the rightmost candidate, kept and
    never merged, of the queries just before `p`: a weight of 0 times NaN broke them.)"""
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    B, S, H, H_kv, K = 2, 40, 4, 2, 32
    q, k, v = random_qkv(rng, B, S + 3, H, H_kv, K, K)
    p = 23
    v_bad = np.array(v)
    v_bad[0, p, 1, 3] = np.nan

    def run(v):
        cache = init_cache(B, 64, H_kv, K, K, config)
        o, cache = prefill(q[:, :S], k[:, :S], v[:, :S], cache, config, backend=backend)
        steps = []
        for s in range(S, S + 3):
            o_t, cache = decode_step(q[:, s], k[:, s], v[:, s], cache, config, backend=backend)
            steps.append(o_t)
        return np.concatenate([np.asarray(o), np.stack(steps, axis=1)], axis=1)

    clean, bad = run(v), run(v_bad)
    np.testing.assert_array_equal(bad[0, :p], clean[0, :p])
    # From p on the NaN reaches that feature of the group's outputs, as in dense attention.
    assert np.all(np.isnan(bad[0, p:, 2:4, 3])) and np.all(np.isfinite(bad[0, :, :2]))
    np.testing.assert_array_equal(bad[1], clean[1])


def test_nan_importance_never_outranks_the_rightmost_node():
    """SPEC 2.3/10: a NaN importance packs as 0, in the reference and the oracle, so the
    forced rightmost node is always kept."""
    from htree_jax.core.config import FORCED_IMPORTANCE
    from htree_jax.core.indexing import pack_importance
    from reference_numpy.htree_numpy import pack_importance as pack_importance_numpy

    imp = np.array([np.nan, 0.0, 0.5, FORCED_IMPORTANCE], np.float32)
    positions = np.arange(4)
    got = np.asarray(pack_importance(jnp.asarray(imp), jnp.asarray(positions), 4))
    oracle = pack_importance_numpy(imp, positions, 4)
    np.testing.assert_array_equal(got, oracle)
    assert got[3] == got.max() and got[0] > got[1]  # NaN ranks as 0 (ties go to the smaller position)
    assert (got[0] >> 4) == (got[1] >> 4)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_non_finite_on_gpu_compiled(rng, dtype):
    """The compiled kernels (forward and decode) under the same rule."""
    config = HTreeConfig(compression_rate=16, top_k=16, selection_block=1)
    G, H_kv, T = 4, 2, 4096
    q, k, v = (np.asarray(x) for x in random_qkv(rng, 1, T, G * H_kv, H_kv, 64, 64))
    cast = lambda *xs: [jnp.asarray(x, dtype) for x in xs]
    o_clean = htree_attention(*cast(q, k, v), config, backend="pallas")
    for i, (which, value) in enumerate(BAD):
        p = int(rng.integers(1, T))
        k_bad, v_bad = _with_bad_token(k, v, which, value, p, kv_head=i % H_kv)
        o_bad = htree_attention(*cast(q, k_bad, v_bad), config, backend="pallas")
        assert_causal_under_non_finite(o_clean, o_bad, p, i % H_kv, G)
    k_bad, v_bad = _with_bad_token(k, v, "v", np.nan, 3000, kv_head=0)
    clean, bad = (np.asarray(prefill(*cast(q, kk, vv), init_cache(1, T, H_kv, 64, 64, config, dtype), config,
                                     backend="pallas")[0], np.float32) for kk, vv in ((k, v), (k_bad, v_bad)))
    np.testing.assert_array_equal(bad[:, :3000], clean[:, :3000])
    assert np.all(np.isnan(bad[:, 3000:, :G, 1])) and np.all(np.isfinite(bad[:, :, G:]))
