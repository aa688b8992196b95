"""The importance export (SPEC 8, `htree_attention(..., return_importance=True)`): every
backend against the float64 oracle's importance of the nodes it kept (queries whose
selections the oracle flags as near-ties left out), both importance modes, strict or
not, partial RoPE, packed rows (block selection's too, the kernels against the
reference); the output stays differentiable."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from htree_jax import HTreeConfig, htree_attention
from reference_numpy import htree_attention_numpy
from tests.conftest import random_qkv

BACKENDS = ["reference", "pallas_interpret"]


def assert_importance_matches_oracle(q, k, v, config, backend, **kw):
    o, sel, imp = htree_attention(q, k, v, config, backend=backend, return_selected=True, return_importance=True,
                                  **kw)
    assert len(imp) == len(sel) == config.num_layers(q.shape[1]) - 1
    _, ref_sel, ref_imp, fragile = htree_attention_numpy(q, k, v, config, return_selected=True,
                                                         return_importance=True, return_fragile=True)
    robust = ~fragile
    for got, want, s in zip(imp, ref_imp, sel):
        got = np.asarray(got)
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_allclose(got[robust], want[robust], rtol=1e-5, atol=1e-6)
        assert (got[np.asarray(s) < 0] == 0).all()
    return imp


# Both modes and both normalisers, each pair once per backend (the four pairs on both
# backends took 60 s on 2 cores).
@pytest.mark.parametrize("backend, importance, strict_causal", [
    ("reference", "softmax", True), ("reference", "shared_max", False),
    ("pallas_interpret", "softmax", False), ("pallas_interpret", "shared_max", True)])
def test_importance_matches_oracle(rng, backend, importance, strict_causal):
    config = HTreeConfig(compression_rate=4, top_k=4, importance=importance, strict_causal=strict_causal, selection_block=1)
    q, k, v = random_qkv(rng, 2, 150, 8, 2, 32, 32)
    imp = assert_importance_matches_oracle(q, k, v, config, backend)
    assert all(float(jnp.min(x)) >= 0 for x in imp)


@pytest.mark.parametrize("backend", BACKENDS)
def test_importance_with_partial_rope_and_many_layers(rng, backend):
    config = HTreeConfig(compression_rate=2, top_k=4, rope_dim=16)  # 5 layers at T=80
    q, k, v = random_qkv(rng, 1, 80, 4, 1, 32, 48)
    assert config.num_layers(80) == 5
    assert_importance_matches_oracle(q, k, v, config, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_importance_of_packed_rows_per_document(rng, backend):
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    q, k, v = random_qkv(rng, 1, 150, 4, 2, 32, 32)
    lengths = [1, 70, 79]
    seg = np.repeat(np.arange(3), lengths)[None].astype(np.int32)
    _, sel, imp = htree_attention(q, k, v, config, backend=backend, segment_ids=seg, return_selected=True,
                                  return_importance=True)
    start = 0
    for n in lengths:
        doc = slice(start, start + n)
        _, ref_sel, ref_imp, fragile = htree_attention_numpy(q[:, doc], k[:, doc], v[:, doc], config,
                                                             return_selected=True, return_importance=True,
                                                             return_fragile=True)
        for got, want in zip(imp[len(imp) - len(ref_imp):], ref_imp):
            np.testing.assert_allclose(np.asarray(got)[:, doc][~fragile], want[~fragile], rtol=1e-5, atol=1e-6)
        start += n


@pytest.mark.parametrize("source", ["first", "previous"])
def test_importance_of_packed_block_rows_on_the_kernels_equals_the_reference(rng, source):
    """Block selection (SPEC 12) over packed rows (`block/layout.py`'s `PackedLayout`): each token's kept
    nodes' importance, its block's, from the kernels interpreted as from the reference
    (3 layers, documents of 1 to 79 tokens)."""
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=4, block_source=source)
    q, k, v = random_qkv(rng, 2, 150, 4, 2, 32, 32)
    seg = np.stack([np.repeat(np.arange(3), [1, 70, 79]), np.repeat(np.arange(4), [33, 5, 100, 12])]).astype(np.int32)
    outs = {backend: htree_attention(q, k, v, config, backend=backend, segment_ids=seg, max_documents=4,
                                     return_selected=True, return_importance=True)
            for backend in BACKENDS}
    (o, sel, imp), (o_ref, sel_ref, imp_ref) = outs["pallas_interpret"], outs["reference"]
    assert len(imp) == len(imp_ref) == 2 and all(float(np.max(np.asarray(x))) > 0 for x in imp_ref)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), rtol=1e-5, atol=1e-5)
    for s, s_ref, got, want in zip(sel, sel_ref, imp, imp_ref):
        np.testing.assert_array_equal(np.asarray(s), np.asarray(s_ref))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["pallas_interpret"])  # the kernels' custom_vjp; the reference is autodiff
def test_output_stays_differentiable_with_the_export(rng, backend):
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, 1, 150, 4, 2, 32, 32))

    def loss(q, k, v, export):
        out = htree_attention(q, k, v, config, backend=backend, return_importance=export)
        o = out[0] if export else out
        return jnp.sum(o ** 2) + (sum(jnp.sum(x) for x in out[1]) if export else 0.0)

    with_export = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, True)
    without = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, False)
    for a, b in zip(with_export, without):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_return_importance_must_be_a_bool(rng):
    q, k, v = random_qkv(rng, 1, 8, 2, 1, 32, 32)
    with pytest.raises(TypeError, match="return_importance must be a bool"):
        htree_attention(q, k, v, return_importance=1)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
def test_importance_compiled_kernels_match_the_reference(rng):
    """GPU: the compiled kernels' export against the reference's, float32, on the
    queries whose selections agree (4 layers: the top kernel and two lower layers)."""
    config = HTreeConfig(compression_rate=4, top_k=16, selection_block=1)
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, 1, 2048, 8, 2, 64, 64))
    _, sel, imp = htree_attention(q, k, v, config, backend="pallas", return_selected=True, return_importance=True)
    _, sel_r, imp_r = htree_attention(q, k, v, config, backend="reference", return_selected=True,
                                      return_importance=True)
    assert len(imp) == 3  # 2048 -> 512 -> 128 -> 32: the top kernel and two lower layers
    for a, b, sa, sb in zip(imp, imp_r, sel, sel_r):
        same = np.all(np.asarray(sa) == np.asarray(sb), axis=-1)
        assert same.mean() > 0.999
        np.testing.assert_allclose(np.asarray(a)[same], np.asarray(b)[same], rtol=1e-4, atol=1e-6)
