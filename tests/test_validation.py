"""Bad input raises a clear error naming the argument, before any heavy work."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from htree_jax import HTreeConfig, htree_attention
import htree_jax.reference as reference
from pallas_kernels.shared.configs import KernelConfigs

f32 = np.float32


def arrays(B=1, T=8, H=4, H_kv=2, K=8, V=4, dtype=f32, Tk=None, Kk=None):
    q = np.ones((B, T, H, K), dtype)
    k = np.ones((B, Tk or T, H_kv, Kk or K), dtype)
    v = np.ones((B, Tk or T, H_kv, V), dtype)
    return q, k, v


CASES = [
    ("q rank", lambda: (np.ones((8, 4, 8), f32),) + arrays()[1:], ValueError, "q must have rank 4"),
    ("k rank", lambda: (arrays()[0], np.ones((1, 8, 2, 8, 1), f32), arrays()[2]), ValueError, "k must have rank 4"),
    ("k rank 3", lambda: (arrays()[0], np.ones((8, 2, 8), f32), arrays()[2]), ValueError, "k must have rank 4"),
    ("v rank", lambda: arrays()[:2] + (np.ones((1, 8, 2), f32),), ValueError, "v must have rank 4"),
    ("batch mismatch", lambda: (np.ones((2, 8, 4, 8), f32),) + arrays()[1:], ValueError,
     "q must have the batch size B \\(axis 0\\) of k and v: q has 2, k has 1, v has 1"),
    ("T mismatch", lambda: (arrays()[0],) + arrays(Tk=9)[1:], ValueError,
     "q must have the sequence length T \\(axis 1\\) of k and v: q has 8, k has 9, v has 9"),
    ("k's T alone", lambda: (arrays()[0], arrays(Tk=9)[1], arrays()[2]), ValueError,
     "k must have the sequence length T \\(axis 1\\) of q and v"),
    ("v's T alone", lambda: arrays()[:2] + (arrays(Tk=9)[2],), ValueError,
     "v must have the sequence length T \\(axis 1\\) of q and k"),
    ("v vs k heads", lambda: arrays()[:2] + (np.ones((1, 8, 3, 4), f32),), ValueError, "v must have shape"),
    ("H % H_kv", lambda: arrays(H=3, H_kv=2), ValueError, "multiple of H_kv"),
    ("odd K", lambda: arrays(K=7), ValueError, "must be even"),
    ("K mismatch", lambda: (arrays(K=8)[0],) + arrays(Kk=6)[1:], ValueError, "same head dim K"),
    ("T = 0", lambda: arrays(T=0), ValueError, "T = 0"),
    ("int dtype", lambda: arrays(dtype=np.int32), TypeError, "q must have a floating dtype"),
    ("mixed dtype", lambda: (arrays()[0].astype(np.float16),) + arrays()[1:], TypeError, "same dtype"),
    ("not an array", lambda: ([[1.0]],) + arrays()[1:], TypeError, "q must be an array"),
]


@pytest.mark.parametrize("name, make, exc, match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_before_work(monkeypatch, name, make, exc, match):
    def must_not_run(*a, **k):
        raise AssertionError("validation let bad input reach the computation")

    monkeypatch.setattr(reference, "reference_forward", must_not_run)
    with pytest.raises(exc, match=match):
        htree_attention(*make(), HTreeConfig(compression_rate=2, top_k=2, selection_block=1))


def test_bad_config_backend_and_flags():
    q, k, v = arrays()
    with pytest.raises(TypeError, match="config must be an HTreeConfig"):
        htree_attention(q, k, v, {"top_k": 4})
    with pytest.raises(ValueError, match="backend must be one of"):
        htree_attention(q, k, v, backend="cuda")
    with pytest.raises(ValueError, match="backend='pallas_interpret'"):
        htree_attention(q, k, v, backend="interpret")
    with pytest.raises(TypeError, match="block_sizes must be an htree_jax.BlockSizes"):
        htree_attention(q, k, v, block_sizes={"tile": 64})
    with pytest.raises(TypeError, match="return_selected must be a bool"):
        htree_attention(q, k, v, return_selected="yes")
    with pytest.raises(ValueError, match="query_chunk must be a positive int"):
        reference.htree_attention_reference(q, k, v, HTreeConfig(selection_block=1), query_chunk=0)


def test_float64_inputs_are_taken_as_jax_takes_them():
    """NumPy float64 inputs with JAX's 64-bit types off (its default) are float32, as
    `jnp.asarray` makes them: the same output as the float32 call, in float32."""
    q, k, v = arrays(T=40)
    config = HTreeConfig(compression_rate=2, top_k=2, selection_block=1)
    o64 = htree_attention(*(x.astype(np.float64) for x in (q, k, v)), config)
    assert o64.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(o64), np.asarray(htree_attention(q, k, v, config)))


def test_float64_with_64_bit_types_on_is_refused_with_what_to_pass():
    q, k, v = (jax.numpy.asarray(x) for x in arrays(T=16))
    with jax.enable_x64(True):
        q64 = jax.numpy.asarray(np.asarray(q, np.float64))
        with pytest.raises(TypeError, match=r"q must have a floating dtype .* got float64 \(cast it: q.astype"):
            htree_attention(q64, k, v, HTreeConfig(compression_rate=2, top_k=2, selection_block=1))


def test_nan_input_does_not_crash():
    q, k, v = arrays(T=40)
    q = q.copy()
    q[0, 3] = np.nan
    o = np.asarray(htree_attention(q, k, v, HTreeConfig(compression_rate=2, top_k=2, selection_block=1)))
    assert o.shape == (1, 40, 4, 4)
    # Queries that did not read the NaN stay finite.
    assert np.all(np.isfinite(o[0, :3]))


def test_auto_backend_choice(monkeypatch):
    import htree_jax.backends as backends
    from htree_jax.core.validation import check_qkv

    q, k, v = arrays(K=64, V=64)
    dims = check_qkv(q, k, v)
    monkeypatch.setattr(backends.jax, "default_backend", lambda: "cpu")
    assert backends.full_sequence_backend("auto", dims) == "reference"
    with pytest.raises(ValueError, match="use backend='pallas_interpret'"):
        backends.full_sequence_backend("pallas", dims)
    monkeypatch.setattr(backends.jax, "default_backend", lambda: "gpu")
    assert backends.full_sequence_backend("auto", dims) == "pallas"
    # Shapes the kernels do not support fall back to the reference rather than failing...
    small = check_qkv(*arrays(K=8, V=4))
    assert backends.full_sequence_backend("auto", small) == "reference"
    # ... and are refused when the kernels are asked for by name.
    for name in ("pallas", "pallas_interpret"):
        with pytest.raises(ValueError, match="head dim K in"):
            backends.full_sequence_backend(name, small)
    # The interpreted kernels on every platform; the same rule for decoding.
    assert backends.full_sequence_backend("pallas_interpret", dims) == "pallas_interpret"
    assert backends.decode_backend("auto", 64, 64, 2) == "pallas"
    assert backends.decode_backend("auto", 8, 4, 2) == "reference"


def test_pallas_interpret_runs_the_interpreted_kernels(monkeypatch):
    """`backend="pallas_interpret"` runs the Pallas kernels interpreted (not the
    reference, and not compiled kernels on a GPU), with the block sizes asked for."""
    import pallas_kernels.gqa.attention as gqa
    from htree_jax import BlockSizes

    calls = []
    real = gqa.htree_forward_pallas
    monkeypatch.setattr(gqa, "htree_forward_pallas", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    q, k, v = arrays(K=32, V=32)
    sizes = BlockSizes(tile=32, span=32)
    htree_attention(q, k, v, HTreeConfig(compression_rate=2, top_k=2, selection_block=1), backend="pallas_interpret", block_sizes=sizes)
    assert calls and calls[0]["interpret"] is True
    assert calls[0]["block_sizes"] == KernelConfigs.resolve(None, 32, 32).with_changes({"layer.tile": 32, "layer.span": 32})


@pytest.mark.parametrize("backend", ["pallas_interpret"])
def test_kernel_limits_name_the_backend_asked_for(backend):
    """A head dim past the kernels' limit is refused naming the backend the caller asked
    for (`pallas_interpret` runs the same kernels, and is what a CPU user passes)."""
    q, k, v = (np.ones((1, 8, h, 1024), np.float32) for h in (2, 1, 1))
    with pytest.raises(ValueError, match=f"backend '{backend}' supports head dim K in"):
        htree_attention(q, k, v, HTreeConfig(compression_rate=2, top_k=2, selection_block=1), backend=backend)
