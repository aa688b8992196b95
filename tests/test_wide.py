"""The wide-group kernels (`pallas_kernels/wide/kernels.py`, G >= 32 heads per kv head: one
program per query and head block, latent and RoPE parts as two products), interpreted,
against the JAX reference and the virtual-head kernels: both selection rules, both
importance modes, multi-layer trees, B = 2, head blocks of 16 and 32, no unrotated
features, values read from the keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from htree_jax import HTreeConfig, htree_attention
from htree_jax.backends import attend
from htree_jax.core.rope import rope_layout
from htree_jax.reference import htree_attention_reference
from pallas_kernels.shared import shared_memory
from pallas_kernels.shared.common import WideBound, head_block
from pallas_kernels.shared.configs import BlockSizes, KernelConfigs
from pallas_kernels.shared.guarded import KernelCall
from pallas_kernels.shared.top_k import select_top_k_pallas
from pallas_kernels.wide import kernels as wide
from pallas_kernels.wide import forward as wide_forward
from pallas_kernels.wide.forward import FeatureSplit, wide_eligible, wide_forward_pallas
from tests.conftest import random_qkv
from tests.helpers import assert_gradients_close, assert_mostly_agrees


def laid_out(q, k, config):
    R = config.partial_rope(q.shape[-1])
    return rope_layout(jnp.asarray(q), R), rope_layout(jnp.asarray(k), R)


def assert_same(out, ref):
    (o, sel), (o_r, sel_r) = out[:2], ref[:2]
    assert len(sel) == len(sel_r) >= 2
    for a, b in zip(sel, sel_r):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_r), rtol=1e-5, atol=2e-6)


# Each rule and importance mode, partial and full RoPE, G 32 and 48 (four of the six
# combinations that ran before 2026-11-28 (3), for CI's time).
@pytest.mark.parametrize("selection, importance, strict, B, G, K, rope_dim, V", [
    ("mean", "softmax", True, 2, 32, 64, 32, 32), ("bound", "softmax", True, 1, 48, 96, 32, 64),
    ("mean", "shared_max", True, 1, 48, 96, 32, 64), ("bound", "shared_max", False, 1, 32, 64, None, 48)])
def test_wide_forward_equals_the_reference(rng, selection, importance, strict, B, G, K, rope_dim, V):
    """Outputs and every layer's selections (3 layers at T=150, r=4, top_k=4); G=48 runs
    head blocks of 16, `rope_dim=None` has no latent part. Each shape under both rules,
    each rule with both importance modes (paired, not crossed: CI time)."""
    config = HTreeConfig(compression_rate=4, top_k=4, rope_dim=rope_dim, importance=importance, selection=selection,
                         strict_causal=strict, selection_block=1)
    q, k, v = random_qkv(rng, B, 150, G, 1, K, V)
    q, k = laid_out(q, k, config)
    v = jnp.asarray(v)
    assert wide_eligible(G, K, V, KernelConfigs(), None)
    out = wide_forward_pallas(q, k, v, config=config, block_sizes=BlockSizes(), interpret=True, return_lse=True)
    assert_same(out, htree_attention_reference(q, k, v, config))
    assert out[2].shape == (B, 150, G)


def test_short_importance_steps_and_one_stage(rng, monkeypatch):
    """Where the gathered tiles would not fit (`WIDE_STAGED_BYTES`), the importance walks
    steps shorter than the RoPE copies' span (16 of 64 here) and the merges take one
    pipeline stage: the same selections and outputs."""
    monkeypatch.setattr(shared_memory, "WIDE_STAGED_BYTES", 1)
    config = HTreeConfig(compression_rate=4, top_k=16, rope_dim=32, selection="bound")
    q, k, v = random_qkv(rng, 1, 600, 32, 1, 64, 32)  # M = 64: 3 layers
    q, k = laid_out(q, k, config)
    v = jnp.asarray(v)
    plan = wide_forward.prepare_wide(q, k, v, KernelCall(config, KernelConfigs(), interpret=True))
    assert (plan.ws.tile, plan.ws.importance_tile, plan.ws.num_stages) == (64, 16, 1)
    assert_same(wide_forward_pallas(q, k, v, config=config, block_sizes=BlockSizes(), interpret=True),
                htree_attention_reference(q, k, v, config))


def test_the_forward_takes_the_wide_kernels_for_wide_groups(rng):
    """`attend` with G >= 32 (the wide route) equals the virtual-head kernels (`wide_rows=0`),
    two kv heads."""
    config = HTreeConfig(compression_rate=4, top_k=4, rope_dim=32)
    q, k, v = random_qkv(rng, 1, 120, 64, 2, 64, 32)
    q, k = laid_out(q, k, config)
    v = jnp.asarray(v)
    wide = attend(q, k, v, config, "pallas_interpret", block_sizes=BlockSizes(wide_rows=32))
    virtual = attend(q, k, v, config, "pallas_interpret", block_sizes=BlockSizes(wide_rows=0))
    assert_same(wide, virtual)


def test_sixteen_heads_at_wide_head_dims_take_the_wide_kernels(rng):
    """G=16 with K past 256 features (padded) runs the wide kernels (the virtual-head
    ones pad K to the next power of two; in float32 at K=576 their bottom merge overflows
    shared memory): outputs and gradients through `htree_attention` equal the
    reference's, 3 layers at T=100."""
    config = HTreeConfig(compression_rate=4, top_k=4, rope_dim=32)
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, 1, 100, 16, 1, 320, 32))
    assert wide_eligible(16, 320, 32, KernelConfigs.resolve(None, 320, 32), None)
    weights = jnp.asarray(rng.standard_normal((1, 100, 16, 32)).astype(np.float32))
    o = htree_attention(q, k, v, config, backend="pallas_interpret")
    np.testing.assert_allclose(o, htree_attention(q, k, v, config, backend="reference"), atol=2e-5, rtol=2e-5)
    got = _grads(q, k, v, config, "pallas_interpret", weights)
    assert_gradients_close(got, _grads(q, k, v, config, "reference", weights), "qkv")


@pytest.mark.parametrize("V", [64, 48])
def test_values_read_from_the_latent_keys(rng, V):
    """`v=None, value_dim=V`: the values are the first V latent features of k (DeepSeek's
    absorbed form): V = the latent width folds the gathered key tile, V < it reads pieces."""
    config = HTreeConfig(compression_rate=4, top_k=4, rope_dim=32)
    q, k, _ = random_qkv(rng, 2, 150, 32, 1, 96, 8)
    ql, kl = laid_out(q, k, config)
    out = wide_forward_pallas(ql, kl, None, config=config, block_sizes=BlockSizes(), interpret=True, value_dim=V)
    assert_same(out, htree_attention_reference(ql, kl, jnp.asarray(k)[..., :V], config))


def test_value_dim_beyond_the_latent_part_is_refused(rng):
    config = HTreeConfig(compression_rate=4, top_k=4, rope_dim=32)
    q, k, _ = random_qkv(rng, 1, 40, 32, 1, 64, 8)
    with pytest.raises(ValueError, match="value_dim 48 must be at most the latent features"):
        wide_forward_pallas(jnp.asarray(q), jnp.asarray(k), None, config=config, block_sizes=BlockSizes(), interpret=True,
                            value_dim=48)


def test_feature_split_round_trips():
    split = FeatureSplit(12, 4)
    x = jnp.arange(12.0)
    lat, rope = split.latent(x), split.rope(x)
    np.testing.assert_array_equal(np.asarray(lat), [0, 1, 2, 3, 6, 7, 8, 9])  # [lat_lo, lat_hi]
    np.testing.assert_array_equal(np.asarray(rope), [4, 5, 10, 11])  # [rope_lo, rope_hi]
    np.testing.assert_array_equal(np.asarray(split.join(lat, rope)), np.asarray(x))


@pytest.mark.parametrize("G, rows, block", [(128, 64, 64), (48, 64, 16), (96, 64, 32), (32, 64, 32), (64, 16, 16)])
def test_head_block(G, rows, block):
    assert head_block(G, rows) == block


@pytest.mark.parametrize("itemsize, Wv_own, shape", [(2, 512, (64, 64)), (2, 0, (64, 64)), (4, 0, (32, 64)),
                                                    (4, 512, (32, 32))])
def test_program_shape_fits_the_shared_memory(itemsize, Wv_own, shape):
    """Rows, then candidates a step, halved until a program's bytes fit: the MLA shape
    (Wl = 512, RoPE halves of 32) keeps 64 x 64 in bfloat16; float32 takes 32 rows with
    the values read from the keys, 32 x 32 with separate values."""
    assert shared_memory.program_shape(64, 64, 16, 512, 32, Wv_own, itemsize) == shape


def test_wide_eligibility():
    bs = KernelConfigs()
    assert not wide_eligible(16, 128, 128, bs, None)  # GQA's 16 heads stay on the virtual-head kernels
    assert wide_eligible(16, 576, 512, bs, None)  # at head dims past 256 they take the wide ones
    assert not wide_eligible(8, 576, 512, bs, None)
    assert not wide_eligible(32, 64, 64, bs.with_changes({"wide.rows": 0}), None)
    assert not wide_eligible(32, 64, 64, bs, object())  # packed rows: the virtual-head kernels
    assert wide_eligible(32, 64, 64, bs, None) and wide_eligible(128, 64, 64, bs, None)


@pytest.mark.parametrize("from_keys", [False, True])
def test_wide_kernels_at_query_positions_with_the_export(rng, from_keys):
    """Queries at some positions only (a context-parallel shard's: `positions`) with the
    importance export (SPEC 8) on the wide kernels: outputs, selections, the kept nodes'
    importance equal the reference's (3 layers at T=100), the values their own or read
    from the keys (there the gradients of q and k too)."""
    config = HTreeConfig(compression_rate=4, top_k=4, rope_dim=32, importance="shared_max")
    q, k, v = random_qkv(rng, 1, 100, 32, 1, 64, 32)
    q, k = laid_out(q, k, config)
    positions = jnp.arange(37, 100, dtype=jnp.int32)
    q, v = q[:, 37:], (None if from_keys else jnp.asarray(v))
    V = 24 if from_keys else None
    assert wide_eligible(32, 64, V or 32, KernelConfigs(), None)
    run = lambda impl, q, k, v: attend(q, k, v, config, impl, positions=positions, export=True, value_dim=V)
    (o, sel, imp), (o_r, sel_r, imp_r) = run("pallas_interpret", q, k, v), run("reference", q, k, v)
    assert_same((o, sel), (o_r, sel_r))
    assert len(imp) == len(sel)
    for a, b in zip(imp, imp_r):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    if from_keys:  # the gradients (one wide backward for both: the positions are its only change here)
        w = jnp.asarray(rng.standard_normal(o.shape).astype(np.float32))
        loss = lambda impl: lambda q, k: jnp.sum(run(impl, q, k, None)[0] * w)
        assert_gradients_close(jax.grad(loss("pallas_interpret"), argnums=(0, 1))(q, k),
                               jax.grad(loss("reference"), argnums=(0, 1))(q, k), "qk")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("selection, importance", [("bound", "softmax"), ("mean", "shared_max")])
def test_wide_compiled_at_the_mla_shape(rng, selection, importance):
    """GPU: the compiled wide kernels at the MLA shape (bf16, T=8192, top_k=64): selections
    agree with the reference on >= 99% of parent lists, outputs within bf16 tolerance
    where they agree."""
    config = HTreeConfig(top_k=64, rope_dim=64, selection=selection, importance=importance)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in random_qkv(rng, 1, 8192, 128, 1, 576, 512))
    q, k = laid_out(q, k, config)
    o, sel = wide_forward_pallas(q, k, v, config=config, block_sizes=BlockSizes())
    o_r, sel_r = htree_attention_reference(q, k, v, config)
    assert_mostly_agrees(o, sel, o_r, sel_r, 128)


# G=8 on the kernels copies the values out (`backends.latent_values`) as the reference does:
# the kernels' own reading from the keys is G=32 (the reference's: test_latent_shapes'
# decoding with values read from the keys, and the reference compared with here).
@pytest.mark.parametrize("backend, G", [("pallas_interpret", 32)])
def test_htree_attention_with_values_from_the_keys(rng, backend, G):
    """`htree_attention(q, k, None, value_dim=V)` equals the call with `v = k[..., :V]`:
    outputs, selections and the gradients of q and k (the values' gradient folded into
    the keys'). G=32 on the kernels reads them from the keys (the wide kernels), G=8
    copies them out."""
    config = HTreeConfig(compression_rate=4, top_k=4, rope_dim=32)
    q, k, _ = (jnp.asarray(x) for x in random_qkv(rng, 1, 90, G, 1, 96, 8))
    V = 48
    o, sel = htree_attention(q, k, None, config, backend=backend, value_dim=V, return_selected=True)
    o_r, sel_r = htree_attention(q, k, k[..., :V], config, backend=backend, return_selected=True)
    assert_same((o, sel), (o_r, sel_r))
    w = jnp.asarray(rng.standard_normal(o.shape), jnp.float32)
    latent = jax.grad(lambda q, k: jnp.sum(htree_attention(q, k, None, config, backend=backend, value_dim=V) * w),
                      argnums=(0, 1))(q, k)
    sliced = jax.grad(lambda q, k: jnp.sum(htree_attention(q, k, k[..., :V], config, backend=backend) * w),
                      argnums=(0, 1))(q, k)
    for a, b in zip(latent, sliced):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("value_dim, rope_dim, match", [
    (None, 32, "value_dim must be a positive int"), (0, 32, "value_dim must be a positive int"),
    (80, 32, "value_dim must be at most the unrotated features of k, K - rope_dim = 64"),
    (16, None, "K - rope_dim = 0")])
def test_values_from_the_keys_refused(rng, value_dim, rope_dim, match):
    config = HTreeConfig(compression_rate=4, top_k=4, rope_dim=rope_dim, selection_block=1)
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, 1, 20, 32, 1, 96, 16))
    with pytest.raises(ValueError, match=match):
        htree_attention(q, k, None, config, backend="reference", value_dim=value_dim)
    with pytest.raises(ValueError, match="value_dim is for v=None"):
        htree_attention(q, k, v, config, backend="reference", value_dim=16)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
def test_values_from_the_keys_compiled_at_the_mla_shape(rng):
    """GPU: `v=None, value_dim=512` at the MLA shape (bf16, T=2048, top_k=32: 3 layers)
    equals the call with `v = k[..., :512]`: outputs (the same selections: the same
    importance kernels) and the gradients of q and k."""
    config = HTreeConfig(top_k=32, rope_dim=64)
    q, k, _ = (jnp.asarray(x, jnp.bfloat16) for x in random_qkv(rng, 1, 2048, 128, 1, 576, 8))
    o = htree_attention(q, k, None, config, backend="pallas", value_dim=512)
    o_r = htree_attention(q, k, k[..., :512], config, backend="pallas")
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_r, np.float32), rtol=2e-2, atol=2e-2)
    w = jnp.asarray(rng.standard_normal(o.shape), jnp.float32)
    grads = [jax.jit(jax.grad(lambda q, k, f=f: jnp.sum(f(q, k).astype(jnp.float32) * w), argnums=(0, 1)))(q, k)
             for f in (lambda q, k: htree_attention(q, k, None, config, backend="pallas", value_dim=512),
                       lambda q, k: htree_attention(q, k, k[..., :512], config, backend="pallas"))]
    for a, b in zip(*grads):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2


def _grads(q, k, v, config, backend, weights, block_sizes=None, value_dim=None):
    def loss(q, k, v):
        o = htree_attention(q, k, v, config, backend=backend, block_sizes=block_sizes, value_dim=value_dim)
        return jnp.sum(o.astype(jnp.float32) * weights)

    return jax.jit(jax.grad(loss, argnums=(0, 1) if v is None else (0, 1, 2)))(q, k, v)


@pytest.mark.parametrize("selection, importance, block_sizes, B, G, K, rope_dim, V", [
    ("bound", "shared_max", BlockSizes(save_selections=False, wide_backward_rows=16), 1, 48, 96, 32, 48),
    ("mean", "shared_max", BlockSizes(node_entries=3, chunk_budget_bytes=1 << 20), 1, 32, 64, 32, 48)])
def test_wide_backward_equals_the_reference_gradients(rng, selection, importance, block_sizes, B, G, K, rope_dim, V):
    """`dq, dk, dv` of the wide kernels (`wide_backward.py`) against autodiff of the JAX
    reference, 3 layers at T=100 (r=4, top_k=4): the forward's selections saved or
    recomputed, head blocks of 16 and 32, spilled node lists (3 entries a program) over
    several chunks of queries, values of other widths than the latent pieces."""
    config = HTreeConfig(compression_rate=4, top_k=4, rope_dim=rope_dim, importance=importance, selection=selection, selection_block=1)
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, B, 100, G, 1, K, V))
    assert wide_eligible(G, K, V, KernelConfigs.resolve(block_sizes, K, V), None)
    weights = jnp.asarray(rng.standard_normal((B, 100, G, V)).astype(np.float32))
    got = _grads(q, k, v, config, "pallas_interpret", weights, block_sizes)
    assert_gradients_close(got, _grads(q, k, v, config, "reference", weights), "qkv")


def test_wide_backward_with_values_from_the_keys(rng):
    """`v=None, value_dim=V`: the gradients of q and k equal the reference's with `v =
    k[..., :V]` (whose value gradient lands in the keys'), two kv heads too."""
    config = HTreeConfig(compression_rate=4, top_k=4, rope_dim=32)
    G, H_kv = 32, 2
    q, k, _ = (jnp.asarray(x) for x in random_qkv(rng, 1, 100, G * H_kv, H_kv, 96, 8))
    V = 48
    weights = jnp.asarray(rng.standard_normal((1, 100, G * H_kv, V)).astype(np.float32))
    got = _grads(q, k, None, config, "pallas_interpret", weights, value_dim=V)
    want = jax.grad(lambda q, k: jnp.sum(htree_attention(q, k, k[..., :V], config, backend="reference") * weights),
                    argnums=(0, 1))(q, k)
    assert_gradients_close(got, want, "qk")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, G, T", [(jnp.bfloat16, 128, 2048), (jnp.float32, 64, 1024)])
def test_wide_backward_compiled_at_the_mla_shape(rng, dtype, G, T):
    """GPU: the wide backward at the MLA shape (K = 576, rope_dim=64, V = 512, top_k=32)
    compiles for both dtypes. bfloat16: its gradients equal the virtual-head kernels'
    (`wide_rows=0`) to 1e-2 in relative norm (each is 0.035 from the float32 reference's
    there, H100: bfloat16 inputs); float32: the reference's (exact float32 dots) to 1e-3."""
    config = HTreeConfig(top_k=32, rope_dim=64)
    q, k, v = (jnp.asarray(x, dtype) for x in random_qkv(rng, 1, T, G, 1, 576, 512))
    weights = jnp.asarray(rng.standard_normal((1, T, G, 512)).astype(np.float32))
    got = _grads(q, k, v, config, "pallas", weights)
    if dtype == jnp.bfloat16:
        block_sizes = BlockSizes(wide_rows=0)
        want, tolerance = _grads(q, k, v, config, "pallas", weights, block_sizes), 1e-2
    else:
        with jax.default_matmul_precision("highest"):
            want, tolerance = _grads(q, k, v, config, "reference", weights), 1e-3
    for name, a, b in zip("qkv", got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < tolerance, name


def _large_values_outside_loops(jaxpr, limit: int, found: list) -> list:
    """`(primitive, shape)` of every value of at least `limit` bytes that `jaxpr` makes
    outside loop bodies and kernels (what a call holds for its whole length)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("scan", "while", "pallas_call", "cond"):
            continue
        inner = [p for p in eqn.params.values() if hasattr(p, "eqns") or hasattr(getattr(p, "jaxpr", None), "eqns")]
        for p in inner:
            _large_values_outside_loops(p if hasattr(p, "eqns") else p.jaxpr, limit, found)
        for var in eqn.outvars:
            aval = var.aval
            if hasattr(aval, "shape") and np.prod(aval.shape, dtype=np.int64) * aval.dtype.itemsize >= limit:
                found.append((eqn.primitive.name, tuple(aval.shape)))
    return found


@pytest.mark.parametrize("values", ["own", "keys"])
def test_the_wide_forward_stages_the_queries_per_chunk(values):
    """Latent attention at T=128K on an 80 GB GPU (issue 53): outside its loop over chunks
    the wide forward makes nothing the size of q (no permuted copy, no latent or RoPE
    parts, no norms of every query; each chunk makes its own), for both value forms."""
    config = HTreeConfig(compression_rate=4, top_k=4, rope_dim=32)
    B, T, G, K, V = 1, 256, 32, 192, 32  # o is 1/6 of q: every q-sized value is found, no o-sized one
    q = jax.ShapeDtypeStruct((B, T, G, K), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((B, T, 1, K), jnp.bfloat16)
    v = None if values == "keys" else jax.ShapeDtypeStruct((B, T, 1, V), jnp.bfloat16)
    f = lambda q, k, v: htree_attention(q, k, v, config, backend="pallas_interpret",
                                        value_dim=V if v is None else None)
    jaxpr = jax.make_jaxpr(f)(q, k, v).jaxpr
    assert _large_values_outside_loops(jaxpr, q.size * 2 // 3, []) == []
    # The check finds such a copy where one is made: the queries permuted before the call.
    permuted = jax.make_jaxpr(lambda q, k, v: f(rope_layout(q, 32), k, v))(q, k, v).jaxpr
    assert ("concatenate", (B, T, G, K)) in _large_values_outside_loops(permuted, q.size * 2 // 3, [])


# The wide kernels, which read q as given (G=4 permutes q before its kernels: the order
# makes no difference there by construction; 56 s on 2 cores, cut 2026-11-28 (3)).
@pytest.mark.parametrize("G", [32])
def test_queries_in_the_given_order_equal_the_permuted_ones(rng, G):
    """`attend(..., q_layout="given")`: the wide kernels read q in the caller's feature
    order, other calls permute it first; outputs, selections and gradients equal those
    of q permuted by the caller (3 layers at T=100, values read from the keys where the
    wide kernels take the call)."""
    config = HTreeConfig(compression_rate=4, top_k=4, rope_dim=32)
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, 1, 100, G, 1, 64, 24))
    V = 24 if G == 32 else None
    v = None if G == 32 else v
    R = config.partial_rope(64)
    run = lambda q, k, layout: attend(q, rope_layout(k, R), v, config, "pallas_interpret", value_dim=V,
                                      q_layout=layout)
    given, permuted = run(q, k, "given"), run(rope_layout(q, R), k, "rope_layout")
    assert_same(given, permuted)
    loss = lambda layout, prep: lambda q, k: jnp.sum(run(prep(q), k, layout)[0] ** 2)
    grads = jax.grad(loss("given", lambda q: q), argnums=(0, 1))(q, k)
    want = jax.grad(loss("rope_layout", lambda q: rope_layout(q, R)), argnums=(0, 1))(q, k)
    for a, b in zip(grads, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="q_layout 'rows'"):
        attend(q, k, v, config, "pallas_interpret", value_dim=V, q_layout="rows")


@pytest.mark.parametrize("selection", ["mean", "bound"])
def test_the_merge_reads_the_stored_scores_as_it_would_score_them(rng, selection):
    """A layer above the bottom merges from the scores its importance stored
    (`wide_merge_pallas(scores=...)`): the same state as the merge that scores its
    candidates again; with the bound the importance ranks by `b` and stores the plain
    scores beside it (`b >= s` where valid, and larger somewhere)."""
    config = HTreeConfig(compression_rate=4, top_k=4, rope_dim=32, selection=selection)
    q, k, v = random_qkv(rng, 1, 150, 32, 1, 64, 32)
    q, k = laid_out(q, k, config)
    plan = wide_forward.prepare_wide(q, k, jnp.asarray(v), KernelCall(config, KernelConfigs(), interpret=True))
    queries, norms, t, parents, state = wide_forward.chunk_start(plan, 0)
    layer = plan.layers[-1]
    n = wide_forward.valid_count(plan, parents, t, plan.num_layers - 1)
    bound = None if norms is None else WideBound(*norms, *layer["radii"])
    ranked, shift, scores = wide.wide_importance_pallas(queries, parents, n, layer["lat"], layer["rope_imp"],
                                                        plan.tables, plan.ws, True, bound=bound)
    keys = wide.combine_importance(ranked, shift, n, plan.st_select)
    _, tau = select_top_k_pallas(keys, parents, n, plan.st_select, True)
    inputs = lambda rope: wide.WideLayer(parents, n, keys, tau, layer["lat"], rope, layer["values"], plan.tables)
    scored = wide.wide_merge_pallas(queries, inputs(layer["rope_merge"]), state, plan.ws, True)
    stored = wide.wide_merge_pallas(queries, inputs(()), state, plan.ws, True, scores=scores)
    for a, b in zip(stored, scored):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    valid = (np.arange(ranked.shape[-1]) < np.asarray(n))[..., None, :]
    gap = np.where(valid, np.asarray(ranked) - np.asarray(scores), 0.0)
    assert gap.min() >= -1e-5
    assert (gap.max() > 0) == (selection == "bound")


def test_chunks_sized_with_the_stored_scores_only_where_they_are_stored(rng):
    """The forward's chunks hold the importance's stored scores (the bound's two kinds);
    a backward with saved selections stores none and keeps chunks as large as before."""
    q, k, v = random_qkv(rng, 1, 600, 32, 1, 64, 32)
    tuning = KernelConfigs(chunk_budget_bytes=4 << 20)
    chunks = {}
    for selection in ("mean", "bound"):
        config = HTreeConfig(compression_rate=4, top_k=16, rope_dim=32, selection=selection)
        ql, kl = laid_out(q, k, config)
        for stored in (True, False):
            chunks[selection, stored] = wide_forward.prepare_wide(ql, kl, jnp.asarray(v),
                                                                  KernelCall(config, tuning, interpret=True),
                                                                  score_chunks=stored).chunk
    assert chunks["bound", True] < chunks["mean", True] < chunks["mean", False] == chunks["bound", False]
