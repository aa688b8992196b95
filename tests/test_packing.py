"""Packed sequences (SPEC 6): each document of a row equals htree on that document alone.

One shared check for every backend (`assert_packed_matches_oracle`): the packed call's
outputs and selections against the float64 oracle run on each document by itself
(queries the oracle flags as fragile left out, as in test_oracle_agreement); gradients
against per-document reference gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from htree_jax import HTreeConfig, htree_attention
from htree_jax.core.packing import pack_layout, virtual_length
from reference_numpy import htree_attention_numpy
from tests.conftest import random_qkv

CONFIG = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)  # M = 16; 150 -> 38 -> 10: 3 layers
B, T, H, H_KV, K, V = 2, 150, 4, 2, 32, 32
BACKENDS = ["reference", "pallas_interpret"]


def segments(lengths_per_row):
    """`segment_ids [B, T]` from document lengths per row (each row sums to T)."""
    rows = [np.repeat(np.arange(len(ls)), ls) for ls in lengths_per_row]
    return np.stack(rows).astype(np.int32)


def fill_row(lengths, total=T):
    """Lengths cut to `total` tokens, the rest one last document."""
    out, used = [], 0
    for n in lengths:
        if used + n > total:
            break
        out.append(n)
        used += n
    if used < total:
        out.append(total - used)
    return out


def per_document(lengths):
    """`(start, length)` of each document of a row."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return list(zip(starts.tolist(), lengths))


def assert_packed_matches_oracle(q, k, v, rows, config, backend, rtol=1e-5, atol=1e-5, max_document_len=None):
    o, selected = htree_attention(q, k, v, config, segment_ids=segments(rows), backend=backend,
                                  return_selected=True, max_document_len=max_document_len)
    o = np.asarray(o)
    L = config.num_layers(max_document_len or q.shape[1])
    assert len(selected) == L - 1
    G = q.shape[2] // k.shape[2]
    fragile_total = 0
    for b, lengths in enumerate(rows):
        for s, n in per_document(lengths):
            doc = slice(s, s + n)
            ref, ref_sel, fragile = htree_attention_numpy(q[b:b + 1, doc], k[b:b + 1, doc], v[b:b + 1, doc], config,
                                                          return_selected=True, return_fragile=True)
            robust = ~fragile[0]  # [n, H_kv]
            fragile_total += int(fragile.sum())
            # The document's own layers are the row's lowest ones; above them the row's
            # extra layers keep every candidate (SPEC 6: they change nothing).
            for got, want in zip(selected[L - 1 - len(ref_sel):], ref_sel):
                np.testing.assert_array_equal(np.asarray(got)[b, doc][robust], want[0][robust])
            heads = np.repeat(robust, G, axis=1)
            np.testing.assert_allclose(o[b, doc].astype(np.float64)[heads], ref[0][heads], rtol=rtol, atol=atol)
    assert fragile_total <= 0.01 * q.shape[0] * q.shape[1] * k.shape[2]


# Document lengths that matter: 1 token, exactly M, just over M, long enough for 3 layers
# on their own (> 38 * 4 is not possible at T=150, but > M * r = 64 gives 3), tiny ones.
M = CONFIG.max_candidates
LENGTHS = st.lists(st.sampled_from([1, 2, 3, M - 1, M, M + 1, 40, 70, 100]) | st.integers(1, 150),
                   min_size=1, max_size=12)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(row0=LENGTHS, row1=LENGTHS, importance=st.sampled_from(["softmax", "shared_max"]),
       seed=st.integers(0, 2**31 - 1))
def test_packed_equals_documents_alone_hypothesis(backend, row0, row1, importance, seed):
    config = HTreeConfig(compression_rate=4, top_k=4, importance=importance, selection_block=1)
    q, k, v = random_qkv(np.random.default_rng(seed), B, T, H, H_KV, K, V)
    rows = [fill_row(row0), fill_row(row1)]
    assert_packed_matches_oracle(q, k, v, rows, config, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("importance", ["softmax", "shared_max"])
def test_packed_fixed_layouts(rng, backend, importance):
    """Named layouts: a 1-token document first, exactly M, 3 layers of its own, many tiny."""
    config = HTreeConfig(compression_rate=4, top_k=4, importance=importance, selection_block=1)
    q, k, v = random_qkv(rng, B, T, H, H_KV, K, V)
    rows = [[1, M, 70, M + 1, T - 1 - M - 70 - M - 1], [3, 1, 2, 1, 5, 1, 1, 136]]
    assert_packed_matches_oracle(q, k, v, rows, config, backend)


def test_packed_many_layers(rng):
    """r=2, top_k=2: a 6-layer row, documents with 1 to 5 layers of their own."""
    config = HTreeConfig(compression_rate=2, top_k=2, selection_block=1)
    q, k, v = random_qkv(rng, 1, 100, 2, 1, 32, 32)
    assert_packed_matches_oracle(q, k, v, [[5, 9, 33, 1, 52]], config, "reference")
    assert_packed_matches_oracle(q, k, v, [[5, 9, 33, 1, 52]], config, "pallas_interpret")


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_document_equals_unpacked(rng, backend):
    """A row of one document is the unpacked call (and `segment_ids=None` is the unpacked
    path itself): the same selections; the kernels' outputs bit for bit, the reference's
    (two XLA programs) to float32 rounding: compiled without LLVM's optimisations (the
    test suite's setting, `conftest.py`) they differ by 1.2e-7 on values of ~1."""
    q, k, v = random_qkv(rng, B, T, H, H_KV, K, V)
    o, sel = htree_attention(q, k, v, CONFIG, backend=backend, return_selected=True)
    o1, sel1 = htree_attention(q, k, v, CONFIG, segment_ids=np.zeros((B, T), np.int32), backend=backend,
                               return_selected=True)
    if backend == "reference":
        np.testing.assert_allclose(np.asarray(o1), np.asarray(o), rtol=0, atol=1e-6)
    else:
        np.testing.assert_array_equal(np.asarray(o1), np.asarray(o))
    for a, b in zip(sel1, sel):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("backend", ["pallas_interpret"])  # the kernels' packed backward; the reference is autodiff
def test_packed_gradients_equal_per_document(rng, backend):
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, B, T, H, H_KV, K, V))
    w = jnp.asarray(rng.standard_normal((B, T, H, V)), jnp.float32)
    rows = [[1, 20, 70, 59], [M, 2, 132]]
    seg = segments(rows)

    def packed(q, k, v):
        return jnp.sum(htree_attention(q, k, v, CONFIG, segment_ids=seg, backend=backend) * w)

    assert_gradients_equal_per_document(packed, q, k, v, w, rows, CONFIG)


def assert_gradients_equal_per_document(packed, q, k, v, w, rows, config):
    """`packed(q, k, v)`, a weighted sum `w` of a packed call's outputs: its gradients
    equal those of the reference run on each document of `rows` by itself."""
    def documents(q, k, v):
        total = 0.0
        for b, lengths in enumerate(rows):
            for s, n in per_document(lengths):
                doc = slice(s, s + n)
                o = htree_attention(q[b:b + 1, doc], k[b:b + 1, doc], v[b:b + 1, doc], config, backend="reference")
                total = total + jnp.sum(o * w[b:b + 1, doc])
        return total

    got = jax.grad(packed, argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(documents, argnums=(0, 1, 2))(q, k, v)
    for g, w_ in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w_), rtol=1e-4, atol=1e-5)


def test_packed_under_jit_and_layout(rng):
    """Traced `segment_ids`: one compiled program for any layout; documents start at
    multiples of r^(L-1) in the virtual layout."""
    q, k, v = random_qkv(rng, B, T, H, H_KV, K, V)
    f = jax.jit(lambda q, k, v, s: htree_attention(q, k, v, CONFIG, segment_ids=s, backend="reference"))
    for rows in ([[10, 140], [150]], [[75, 75], [1, 149]]):
        seg = segments(rows)
        np.testing.assert_array_equal(np.asarray(f(q, k, v, seg)),
                                      np.asarray(htree_attention(q, k, v, CONFIG, segment_ids=seg,
                                                                 backend="reference")))
    packing = pack_layout(jnp.asarray(segments([[10, 140], [150]])), CONFIG, virtual_length(CONFIG, T, None))
    A = 16
    assert np.asarray(packing.doc_start)[0, 10] == A and np.asarray(packing.position)[0, 10] == A
    assert np.asarray(packing.position)[0, 149] == A + 139


def test_beyond_the_static_cap(rng):
    q, k, v = random_qkv(rng, B, T, H, H_KV, K, V)
    many = np.tile((np.arange(T) % 2)[None], (B, 1)).astype(np.int32)  # 150 one-token documents
    with pytest.raises(ValueError, match="max_documents"):
        htree_attention(q, k, v, CONFIG, segment_ids=many, max_documents=4, backend="reference")
    # Under jit nothing is checked on the host: the row answers NaN, the others do not.
    seg = np.stack([many[0], np.zeros(T, np.int32)])
    o = jax.jit(lambda s: htree_attention(q, k, v, CONFIG, segment_ids=s, max_documents=4))(seg)
    assert np.isnan(np.asarray(o[0])).all() and np.isfinite(np.asarray(o[1])).all()
    # A cap large enough takes them (one virtual node per token: A = 16 each).
    o = htree_attention(q, k, v, CONFIG, segment_ids=many, max_documents=T, backend="reference")
    np.testing.assert_allclose(np.asarray(o)[:, 0], np.asarray(v)[:, 0].repeat(H // H_KV, axis=1), rtol=1e-6)


@pytest.mark.parametrize("bad, error, match", [
    (np.zeros((B, T - 1), np.int32), ValueError, r"shape \[B, T\]"),
    (np.zeros((T,), np.int32), ValueError, r"shape \[B, T\]"),
    (np.zeros((B, T), np.float32), TypeError, "int32"),
    (np.zeros((B, T), np.int64), TypeError, "int32"),
    ([[0] * T] * B, TypeError, "integer array"),
])
def test_bad_segment_ids(rng, bad, error, match):
    q, k, v = random_qkv(rng, B, T, H, H_KV, K, V)
    with pytest.raises(error, match=match):
        htree_attention(q, k, v, CONFIG, segment_ids=bad)


@pytest.mark.parametrize("max_documents", [0, -1, 2.5, True])
def test_bad_max_documents(rng, max_documents):
    q, k, v = random_qkv(rng, 1, 8, 2, 1, 32, 32)
    with pytest.raises(ValueError, match="max_documents"):
        htree_attention(q, k, v, CONFIG, segment_ids=np.zeros((1, 8), np.int32), max_documents=max_documents)
    with pytest.raises(ValueError, match="need segment_ids"):
        htree_attention(q, k, v, CONFIG, max_documents=4)
    with pytest.raises(ValueError, match="max_document_len"):
        htree_attention(q, k, v, CONFIG, segment_ids=np.zeros((1, 8), np.int32), max_document_len=max_documents)


@pytest.mark.parametrize("backend", BACKENDS)
def test_max_document_len_takes_fewer_layers(rng, backend):
    """Documents of at most 60 tokens: the row walks 2 layers (60 -> 15), not T's 3,
    and still equals each document alone; a longer document is refused (eagerly) or
    answers NaN (under jit)."""
    q, k, v = random_qkv(rng, B, T, H, H_KV, K, V)
    rows = [[1, 60, 16, 17, 56], [60, 60, 30]]
    assert CONFIG.num_layers(60) == 2 and CONFIG.num_layers(T) == 3
    assert_packed_matches_oracle(q, k, v, rows, CONFIG, backend, max_document_len=60)
    with pytest.raises(ValueError, match="longer than max_document_len=59"):
        htree_attention(q, k, v, CONFIG, segment_ids=segments(rows), max_document_len=59, backend=backend)
    o = jax.jit(lambda s: htree_attention(q, k, v, CONFIG, segment_ids=s, max_document_len=59, backend=backend))(
        segments([[1, 60, 16, 17, 56], [50, 50, 50]]))
    assert np.isnan(np.asarray(o[0])).all() and np.isfinite(np.asarray(o[1])).all()


def test_max_document_len_bounds():
    q, k, v = random_qkv(np.random.default_rng(0), 1, 8, 2, 1, 32, 32)
    with pytest.raises(ValueError, match="at most T = 8"):
        htree_attention(q, k, v, CONFIG, segment_ids=np.zeros((1, 8), np.int32), max_document_len=9)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
def test_packed_compiled_equals_per_document_compiled(rng):
    """GPU: the compiled kernels on a packed row against compiled per-document runs,
    selections identical, float32 (exact float32 products on both sides)."""
    config = HTreeConfig(compression_rate=4, top_k=16, selection_block=1)  # M = 64
    T_gpu = 2048
    q, k, v = random_qkv(rng, 2, T_gpu, 8, 2, 64, 64)
    rows = [[1, 64, 300, 17, 1666], [1024, 1024]]
    o, sel = htree_attention(q, k, v, config, segment_ids=segments(rows), backend="pallas", return_selected=True)
    L = len(sel) + 1
    mismatched = 0
    for b, lengths in enumerate(rows):
        for s, n in per_document(lengths):
            doc = slice(s, s + n)
            od, sd = htree_attention(q[b:b + 1, doc], k[b:b + 1, doc], v[b:b + 1, doc], config, backend="pallas",
                                     return_selected=True)
            np.testing.assert_allclose(np.asarray(o)[b, doc], np.asarray(od)[0], rtol=1e-4, atol=1e-4)
            for got, want in zip(sel[L - 1 - len(sd):], sd):
                mismatched += int(np.sum(np.any(np.asarray(got)[b, doc] != np.asarray(want)[0], axis=-1)))
    assert mismatched == 0


def test_modules_take_segment_ids():
    """nnx `HTreeAttention(x, segment_ids=)` equals htree_attention on its projections
    with the same ids; the linen twin equals it from the same weights; a gradient step
    runs; decode refuses them."""
    from flax import nnx

    from htree_jax import HTreeAttention
    from htree_jax import linen as htree_linen

    m = HTreeAttention(4, 32, num_kv_heads=2, config=CONFIG, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, T, 32))
    seg = segments([[1, 20, 70, 59], [M, 2, 132]])
    want = m.out(htree_attention(m.query(x), m.key(x), m.value(x), CONFIG, segment_ids=seg, backend="reference"))
    got = m(x, segment_ids=seg)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.allclose(np.asarray(got), np.asarray(m(x)))  # packing changes the answer

    twin = htree_linen.HTreeAttention(4, 32, num_kv_heads=2, config=CONFIG)
    state = nnx.state(m, nnx.Param)
    params = {"params": {name: {leaf: state[name][leaf][...] for leaf in state[name]}
                         for name in ("query", "key", "value", "out")}}
    np.testing.assert_allclose(np.asarray(twin.apply(params, x, segment_ids=seg)), np.asarray(got), rtol=1e-6,
                               atol=1e-6)

    grads = nnx.grad(lambda m: jnp.mean(m(x, segment_ids=seg) ** 2))(m)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    with pytest.raises(ValueError, match=r"segment_ids must have shape \[batch..., T\]"):
        m(x, segment_ids=seg[:, :-1])
    m.init_cache(2, T)
    with pytest.raises(ValueError, match="not decode=True"):
        m(x, decode=True, segment_ids=seg)


def test_max_documents_sizes_the_layout_not_a_count():
    """docs/packing.md's example: `max_documents=8` at T=1024, `top_k=16` (documents start at
    multiples of 16) is a layout of 1152 tokens. 18 documents that take 1104 fit it; 202
    that take 3248 are refused, the error saying what they take and what it holds."""
    T = 1024
    q, k, v = (jax.random.normal(jax.random.key(i), (1, T, h, 32)) for i, h in enumerate((2, 1, 1)))
    config = HTreeConfig(top_k=16, selection_block=1)
    fits = np.repeat(np.arange(18), [60] * 17 + [4])[None].astype(np.int32)
    o = htree_attention(q, k, v, config, segment_ids=fits, max_documents=8, backend="reference")
    assert np.isfinite(np.asarray(o)).all()
    too_many = np.repeat(np.arange(202), [5] * 201 + [19])[None].astype(np.int32)
    with pytest.raises(ValueError, match=r"row 0's 202 documents, each laid out from a multiple of 16 tokens, "
                                         r"take 3248 tokens of the packed layout, which holds 1152 "
                                         r"\(T plus max_documents=8"):
        htree_attention(q, k, v, config, segment_ids=too_many, max_documents=8, backend="reference")
