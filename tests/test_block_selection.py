"""Block selection (SPEC 12, `selection_block = compression_rate`): the JAX reference
against the float64 oracle on multi-layer trees, the selection shared by each bottom
node's queries, causality by perturbation, gradients against finite differences, packed
documents, decoding (the cache keeps the recent queries that rank) against the full
sequence, and the clear errors where it is not built (the kernels' limits, decoding on
the kernels). The kernels against the reference: `test_block_kernels.py`."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import htree_jax
from htree_jax import HTreeConfig, htree_attention
from pallas_kernels.shared.configs import KernelConfigs
from reference_numpy import htree_attention_numpy
from tests.conftest import random_qkv
from tests.test_packing import assert_gradients_equal_per_document, assert_packed_matches_oracle, segments

SOURCES = ["first", "previous"]
# (compression_rate, top_k, T, H, H_kv, importance): 3+ layers at small T.
SHAPES = [(4, 4, 150, 4, 2, "softmax"), (2, 8, 100, 4, 4, "shared_max"), (8, 2, 200, 6, 2, "softmax")]


def block_config(r, top_k, source, selection="bound", importance="softmax", **kw):
    return HTreeConfig(compression_rate=r, top_k=top_k, selection=selection, importance=importance,
                       selection_block=r, block_source=source, **kw)


# Each source with each rule, over the three shapes.
@pytest.mark.parametrize("source, selection, r, top_k, T, H, H_kv, importance",
                         [("first", "bound", *SHAPES[0]), ("previous", "mean", *SHAPES[0]),
                          ("first", "mean", *SHAPES[1]), ("previous", "bound", *SHAPES[2])])
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
    _, own = htree_attention(q, k, v, HTreeConfig(compression_rate=r, top_k=4, selection_block=1), backend="reference",
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
        for S in (37, 101):
            part = np.asarray(htree_attention(q[:, :S], k[:, :S], v[:, :S], config, backend="reference"))
            np.testing.assert_allclose(part, full[:, :S], rtol=1e-6, atol=1e-6)


def test_one_layer_is_dense_attention_whatever_the_source(rng):
    """Nothing is selected in a one-layer tree: block selection changes nothing there."""
    q, k, v = random_qkv(rng, 1, 60, 4, 2, 8, 8)
    plain = np.asarray(htree_attention(q, k, v, HTreeConfig(compression_rate=4, top_k=16, selection_block=1), backend="reference"))
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


@pytest.mark.parametrize("backend", ["reference", "pallas_interpret"])
@pytest.mark.parametrize("source", SOURCES)
def test_packed_documents_are_blocked_inside_each_document(rng, source, backend):
    """Each document alone (the oracle on its own tokens): blocks start at each document's
    first token, so none spans two; the kernels (`pallas_kernels/block/layout.py`'s `PackedLayout`, the
    queries laid out as the tree) as the reference."""
    config = block_config(4, 4, source)
    q, k, v = random_qkv(rng, 2, 150, 4, 2, 32, 32)
    assert_packed_matches_oracle(q, k, v, [[5, 9, 33, 1, 102], [70, 3, 77]], config, backend)


@pytest.mark.parametrize("source, G", [("first", 2), ("previous", 4)])
def test_packed_gradients_on_the_kernels_equal_each_document_alone(rng, source, G):
    """The packed block kernels' backward (the tree's transpose by XLA, the layers' by
    the kernel) against the reference run on each document by itself."""
    config = block_config(4, 4, source)
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, 2, 150, 2 * G, 2, 32, 32))
    w = jnp.asarray(rng.standard_normal((2, 150, 2 * G, 32)), jnp.float32)
    rows = [[1, 20, 70, 59], [16, 2, 132]]
    seg = segments(rows)
    packed = lambda q, k, v: jnp.sum(htree_attention(q, k, v, config, segment_ids=seg, max_documents=4,
                                                     backend="pallas_interpret") * w)
    assert_gradients_equal_per_document(packed, q, k, v, w, rows, config)


@pytest.mark.parametrize("source", SOURCES)
def test_packed_blocks_walk_the_top_layer_from_their_documents_tile(rng, source):
    """Ten documents of at most 40 tokens (a two-layer tree, documents every 4 virtual
    positions): the top layer spans four of the kernels' 16-node tiles, so most blocks
    start their top-layer walk past tile 0 (`merge.walk_tiles`). Outputs and
    gradients of the kernels interpreted against the reference's."""
    config = block_config(4, 4, source)
    rows = [[9, 40, 3, 33, 12, 1, 25, 40, 7, 30], [40, 2, 38, 40, 17, 23, 4, 36]]
    seg = jnp.asarray(segments(rows))
    tuning = KernelConfigs.resolve(None, 32, 32).with_changes({"block.merge_tile": 16, "block.backward_tile": 16})
    T_v = htree_jax.core.packing.virtual_length(config, 200, 10, 40)
    assert T_v // config.compression_rate >= 3 * 16  # the top layer's nodes: several tiles
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, 2, 200, 4, 2, 32, 32))
    w = jnp.asarray(rng.standard_normal((2, 200, 4, 32)), jnp.float32)

    def loss(q, k, v, backend):
        o = htree_attention(q, k, v, config, segment_ids=seg, max_documents=10, max_document_len=40,
                            backend=backend, block_sizes=tuning)
        return jnp.sum(o * w), o

    (_, o), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v, "pallas_interpret")
    (_, o_ref), grads_ref = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v, "reference")
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), rtol=1e-5, atol=1e-5)
    for name, g, g_ref in zip("qkv", grads, grads_ref):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-4, atol=1e-5, err_msg=f"d{name}")


def test_where_it_is_not_built_the_errors_say_so(rng):
    config = block_config(4, 4, "first")
    q, k, v = random_qkv(rng, 1, 40, 4, 2, 32, 32)
    with pytest.raises(ValueError, match="backend 'pallas' needs a CUDA GPU"):
        htree_attention(q, k, v, config, backend="pallas")
    positions = jnp.arange(20, 40, dtype=jnp.int32)
    with pytest.raises(ValueError, match="a context shard of whole blocks: its 18 queries must be a multiple of "
                                         "selection_block = 4"):
        htree_jax.backends.attend(q[:, 22:], k, v, config, "pallas_interpret", positions=positions[2:])
    with pytest.raises(ValueError, match="block_source='previous' in a context shard needs its ranking rows"):
        htree_jax.backends.attend(q[:, 20:], k, v, block_config(4, 4, "previous"), "pallas_interpret",
                                  positions=positions)
    wide_q, wide_k, wide_v = random_qkv(rng, 1, 40, 4, 2, 288, 32)
    with pytest.raises(ValueError, match="block selection's kernels take K and V up to 256, got K = 288"):
        htree_attention(wide_q, wide_k, wide_v, config, backend="pallas_interpret")
    many_q, many_k, many_v = random_qkv(rng, 1, 40, 128, 2, 32, 32)
    with pytest.raises(ValueError, match="block_source='previous' ranks with .* 256 rows a kv head, at most 128"):
        htree_attention(many_q, many_k, many_v, block_config(4, 4, "previous"), backend="pallas_interpret")
    o = htree_attention(q, k, v, config)  # "auto" off a GPU: the reference
    np.testing.assert_array_equal(np.asarray(o), np.asarray(htree_attention(q, k, v, config, backend="reference")))
    with pytest.raises(ValueError, match=r"init_cache needs num_heads \(the query heads\) with config.selection_block=4"):
        htree_jax.init_cache(1, 64, 2, 32, 32, config, jnp.float32)
    with pytest.raises(ValueError, match="num_heads must be a multiple of num_kv_heads = 2"):
        htree_jax.init_cache(1, 64, 2, 32, 32, config, jnp.float32, num_heads=3)
    cache = htree_jax.init_cache(1, 64, 2, 32, 32, config, jnp.float32, num_heads=4)
    with pytest.raises(ValueError, match="q must have the 4 heads of the cache"):
        htree_jax.prefill(q[:, :8, :2], k[:, :8], v[:, :8], cache, config)
    wide = htree_jax.init_cache(1, 64, 2, 32, 32, block_config(4, 4, "previous"), jnp.float32, num_heads=96)
    wq, wk, wv = random_qkv(rng, 1, 8, 96, 2, 32, 32)
    with pytest.raises(ValueError, match="'previous' ranks with selection_block \\* H / H_kv = 192 rows a kv head"):
        htree_jax.prefill(wq, wk, wv, wide, block_config(4, 4, "previous"), backend="pallas_interpret")
    with pytest.raises(ValueError, match="made for another selection_block"):
        htree_jax.prefill(q[:, :8], k[:, :8], v[:, :8], cache, HTreeConfig(compression_rate=4, top_k=4, selection_block=1))
    with pytest.raises(ValueError, match="selection_block must be 1 or compression_rate"):
        HTreeConfig(compression_rate=4, selection_block=2)
    with pytest.raises(ValueError, match="selection_block must be 1 or compression_rate"):
        HTreeConfig(compression_rate=4, selection_block=True)
    with pytest.raises(ValueError, match="block_source must be one of"):
        HTreeConfig(compression_rate=4, selection_block=4, block_source="last")


@pytest.mark.parametrize("source, selection, backend", [("first", "bound", "reference"),
                                                        ("previous", "mean", "reference"),
                                                        ("first", "bound", "pallas_interpret"),
                                                        ("previous", "mean", "pallas_interpret")])
def test_decoding_equals_the_full_sequence(rng, source, selection, backend):
    """Prompts of different lengths (one empty), a second prefill of a few tokens and
    single steps, across blocks' edges: every output equals the full sequence's (the
    cache keeps the last 2b queries, which rank for the blocks the new tokens are in),
    and a row reset mid-way starts its sequence again. Per-query selection differs
    on the same inputs, so the comparison sees the blocks. On the decode kernels a
    step walks the ranking rows only where some row starts a block (the rows here sit
    at different offsets: some steps walk, some keep `cache.selections`)."""
    config = block_config(4, 4, source, selection)
    B, T, H, H_kv, K = 3, 150, 4, 2, 32
    q, k, v = random_qkv(rng, B, T, H, H_kv, K, K)
    full = np.asarray(htree_attention(q, k, v, config, backend="reference"))
    own = np.asarray(htree_attention(q, k, v, HTreeConfig(compression_rate=4, top_k=4, selection=selection, selection_block=1),
                                     backend="reference"))
    assert not np.allclose(own, full, atol=1e-3)
    cache = htree_jax.init_cache(B, T, H_kv, K, K, config, num_heads=H)
    lengths = np.array([37, 0, 50])
    o, cache = htree_jax.prefill(q[:, :50], k[:, :50], v[:, :50], cache, config, lengths=lengths, backend=backend)
    for b in range(B):
        np.testing.assert_allclose(np.asarray(o)[b, :lengths[b]], full[b, :lengths[b]], rtol=1e-5, atol=1e-5)
    rows = np.arange(B)
    o, cache = htree_jax.prefill(*(np.stack([x[b, n:n + 7] for b, n in enumerate(lengths)]) for x in (q, k, v)),
                                 cache, config, backend=backend)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(o)[b], full[b, n:n + 7], rtol=1e-5, atol=1e-5)
    step = jax.jit(lambda q, k, v, c: htree_jax.decode_step(q, k, v, c, config, backend=backend))
    position = lengths + 7
    for i in range(12):
        if i == 6:  # row 1 starts its sequence again
            cache = htree_jax.reset_rows(cache, np.array([False, True, False]))
            position[1] = 0
        o_t, cache = step(q[rows, position], k[rows, position], v[rows, position], cache)
        np.testing.assert_allclose(np.asarray(o_t), full[rows, position], rtol=1e-5, atol=1e-5)
        position += 1


def test_the_module_decodes_its_full_sequence(rng):
    """`HTreeAttention(..., config=block selection)`: a prompt then single tokens through
    `decode=True` give the full sequence's outputs."""
    from flax import nnx

    config = block_config(4, 4, "previous")
    layer = htree_jax.HTreeAttention(4, 16, num_kv_heads=2, config=config, rngs=nnx.Rngs(0))
    x = jnp.asarray(rng.standard_normal((2, 70, 16)), jnp.float32)
    full = layer(x, decode=False)
    layer.init_cache(x.shape)
    got = [layer(x[:, :61], decode=True)] + [layer(x[:, t:t + 1], decode=True) for t in range(61, 70)]
    np.testing.assert_allclose(np.asarray(jnp.concatenate(got, axis=1)), np.asarray(full), rtol=1e-5, atol=1e-5)


def test_the_decode_kernels_keep_the_blocks_selection(rng):
    """One token a row on the decode kernels: the cache holds the block's selection of
    every layer above 0 (the full sequence's at the block's tokens), a step inside a
    block keeps it without walking (a cache given another block's selection answers
    otherwise) and a step that starts a block walks anew."""
    config = block_config(4, 4, "first", "mean")
    B, T, H, H_kv, K = 2, 150, 4, 2, 32
    q, k, v = random_qkv(rng, B, T, H, H_kv, K, K)
    full, selections = htree_attention(q, k, v, config, backend="reference", return_selected=True)
    full = np.asarray(full)
    cache = htree_jax.init_cache(B, T, H_kv, K, K, config, num_heads=H)
    _, cache = htree_jax.prefill(q[:, :120], k[:, :120], v[:, :120], cache, config, backend="pallas_interpret")
    step = jax.jit(lambda q, k, v, c: htree_jax.decode_step(q, k, v, c, config, backend="pallas_interpret"))
    for t in range(120, 126):
        kept = [np.asarray(x) for x in cache.selections]
        o_t, cache = step(q[:, t], k[:, t], v[:, t], cache)
        np.testing.assert_allclose(np.asarray(o_t), full[:, t], rtol=1e-5, atol=1e-5)
        for got, want in zip(cache.selections, selections):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want)[:, t])
        if t % 4 == 3:  # inside a block: a cache with another block's selection answers otherwise
            other = dataclasses.replace(cache, selections=tuple(jnp.asarray(np.asarray(x)[:, 40]) for x in selections))
            other = dataclasses.replace(other, lengths=cache.lengths - 1)
            o_other, _ = htree_jax.decode_step(q[:, t], k[:, t], v[:, t], jax.tree.map(jnp.copy, other), config,
                                              backend="pallas_interpret")
            assert not np.allclose(np.asarray(o_other), full[:, t], atol=1e-3)
        assert all(np.array_equal(np.asarray(x), y) for x, y in zip(cache.selections, kept)) == (t % 4 != 0)


def test_latent_fp8_decoding_on_the_kernels_matches_the_reference(rng):
    """Block selection decoding with the values read from FP8 keys (latent attention's
    cache, 32 heads over one kv head; `"previous"` at b = 2: 64 ranking rows a kv head, the
    wide walk's virtual heads): the decode kernels' outputs and selections against the
    reference's on the same cache."""
    config = HTreeConfig(compression_rate=2, top_k=8, rope_dim=32, selection_block=2, block_source="previous")
    B, T, H, K, V = 1, 48, 32, 96, 32
    q, k, _ = random_qkv(rng, B, T, H, 1, K, V)
    q, k = (jnp.asarray(x, jnp.bfloat16) for x in (q, k))
    outs = {}
    for backend in ("reference", "pallas_interpret"):
        cache = htree_jax.init_cache(B, T, 1, K, V, config, jnp.bfloat16, values_from_keys=True,
                                     token_dtype=jnp.float8_e4m3fn, num_heads=H)
        o, cache, sel = htree_jax.prefill(q[:, :44], k[:, :44], None, cache, config, backend=backend,
                                          return_selected=True)
        steps = [o]
        for t in range(44, 48):
            o_t, cache = htree_jax.decode_step(q[:, t], k[:, t], None, cache, config, backend=backend)
            steps.append(o_t[:, None])
        outs[backend] = (np.asarray(jnp.concatenate(steps, axis=1), np.float32), sel, cache.selections)
    (o_ref, sel_ref, kept_ref), (o_ker, sel_ker, kept_ker) = outs["reference"], outs["pallas_interpret"]
    for a, b in zip(sel_ker, sel_ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(kept_ker, kept_ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(o_ker, o_ref, rtol=2e-2, atol=2e-2)
