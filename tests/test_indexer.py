"""SPEC 13, selection by a learned indexer: the JAX reference against the float64 oracle
(selections exactly, outputs and the loss to float32's rounding), the loss's gradient
(the indexer's inputs only) against finite differences, the keys' order, the module's
projections and loss, and every call the indexer does not take refused by name."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from htree_jax import HTreeAttention, HTreeConfig, Index, IndexerConfig, IndexLoss, htree_attention
from htree_jax.core.indexer import pack_index_scores
from htree_jax.reference import htree_attention_reference
from reference_numpy.htree_numpy import htree_attention_numpy
from reference_numpy.htree_numpy import pack_index_scores as pack_index_scores_numpy

# What the clean code measures against the oracle (float32 arithmetic inside): outputs
# up to 6e-7, the loss up to 1.5e-6 (T=150, r=4, top_k=4: three layers).
O_TOL, LOSS_TOL = 2e-6, 5e-6


def inputs(seed, B, T, H, H_kv, K, H_I, H_ik, D_I, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    return (f(B, T, H, K), f(B, T, H_kv, K), f(B, T, H_kv, K)), Index(f(B, T, H_I, D_I), f(B, T, H_ik, D_I),
                                                                     f(B, T, H_I))


CASES = [  # (selection_block, H, H_kv, H_I, H_ik, dtype)
    (1, 4, 2, 4, 1, jnp.float32),
    (1, 4, 2, 4, 2, jnp.float32),
    (4, 4, 2, 4, 1, jnp.float32),
    (4, 2, 2, 2, 2, jnp.float32),
    (4, 8, 2, 6, 2, jnp.bfloat16),
    (1, 4, 1, 3, 1, jnp.bfloat16),
]


@pytest.mark.parametrize("block, H, H_kv, H_I, H_ik, dtype", CASES)
def test_the_reference_equals_the_oracle(block, H, H_kv, H_I, H_ik, dtype):
    """Selections exactly (where the oracle flags no near-tie), outputs and the loss to
    float32 rounding; a three-layer tree, every kv-head mapping of the index keys."""
    config = HTreeConfig(compression_rate=4, top_k=4, selection="indexer", selection_block=block)
    (q, k, v), index = inputs(block + H_I, 2, 150, H, H_kv, 16, H_I, H_ik, 8, dtype)
    o, selected, loss = htree_attention_reference(q, k, v, config, index=index)
    want, want_sel, fragile, want_loss = htree_attention_numpy(
        q, k, v, config, return_selected=True, return_fragile=True, index=(index.q, index.k, index.w),
        return_index_loss=True)
    assert len(selected) == len(want_sel) == 2
    for got, expected in zip(selected, want_sel):
        np.testing.assert_array_equal(np.asarray(got)[~fragile], expected[~fragile])
    assert fragile.mean() < 0.05
    steady = ~fragile.any(axis=-1)  # a query's rows where no kv head's selection is near a tie
    # bf16: the output stored in bf16 and the scores from bf16 inputs (measured up to 7.4e-3;
    # the oracle agreement tests' 1e-2).
    tol = 1e-2 if dtype == jnp.bfloat16 else O_TOL
    np.testing.assert_allclose(np.asarray(o, np.float64)[steady], want[steady], rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(loss)[~fragile], want_loss[~fragile], atol=LOSS_TOL, rtol=LOSS_TOL)
    assert want_loss.max() > 0.1  # the loss is not trivially zero


def test_the_index_ranks_and_not_the_keys():
    """The indexer's selection differs from the bound's on the same q, k, v, and a second
    indexer (another seed) selects differently: the index is what ranks."""
    config = HTreeConfig(compression_rate=4, top_k=4, selection="indexer")
    (q, k, v), index = inputs(0, 1, 150, 4, 2, 16, 4, 1, 8)
    _, other = inputs(1, 1, 150, 4, 2, 16, 4, 1, 8)
    _, mine, _ = htree_attention_reference(q, k, v, config, index=index)
    _, theirs, _ = htree_attention_reference(q, k, v, config, index=other)
    _, bound = htree_attention_reference(q, k, v, HTreeConfig(compression_rate=4, top_k=4))
    assert any((a != b).any() for a, b in zip(mine, theirs))
    assert any((a != b).any() for a, b in zip(mine, bound))


def test_the_loss_trains_the_indexer_alone_and_the_output_the_model_alone():
    config = HTreeConfig(compression_rate=4, top_k=4, selection="indexer", selection_block=4)
    (q, k, v), index = inputs(3, 1, 100, 4, 2, 16, 4, 2, 8)

    def parts(q, k, v, iq, ik, iw):
        o, _, loss = htree_attention_reference(q, k, v, config, index=Index(iq, ik, iw))
        return jnp.sum(o * 0.3), jnp.sum(loss)

    args = (q, k, v, index.q, index.k, index.w)
    from_loss = jax.grad(lambda *a: parts(*a)[1], argnums=range(6))(*args)
    from_output = jax.grad(lambda *a: parts(*a)[0], argnums=range(6))(*args)
    assert all(float(jnp.abs(g).max()) == 0 for g in from_loss[:3])
    assert all(float(jnp.abs(g).max()) > 0 for g in from_loss[3:])
    assert all(float(jnp.abs(g).max()) > 0 for g in from_output[:3])
    assert all(float(jnp.abs(g).max()) == 0 for g in from_output[3:])
    # The loss's gradient against central differences along a random direction, for the
    # index queries and the weights (the scores are linear in the weights). Measured
    # within 0.3% at these steps; the keys' differences cross ReLU's kinks and flip
    # near-tied selections at any step float32 resolves, so they are not checked so.
    rng = np.random.default_rng(4)
    loss_of = jax.jit(lambda *a: parts(*a)[1])
    for i, step in ((3, 1e-3), (5, 3e-4)):
        d = jnp.asarray(rng.standard_normal(args[i].shape), jnp.float32)
        plus = list(args); plus[i] = args[i] + step * d
        minus = list(args); minus[i] = args[i] - step * d
        numeric = (loss_of(*plus) - loss_of(*minus)) / (2 * step)
        analytic = jnp.sum(from_loss[i] * d)
        np.testing.assert_allclose(float(numeric), float(analytic), rtol=5e-3)


@pytest.mark.parametrize("block", [1, 4])
def test_no_output_or_loss_depends_on_a_later_token(block):
    """Causality (SPEC 3 with SPEC 13): changing every input after position p (q, k, v and
    the index's q, k, w) changes no output and no loss at or before p."""
    config = HTreeConfig(compression_rate=4, top_k=4, selection="indexer", selection_block=block)
    (q, k, v), index = inputs(8, 1, 150, 4, 2, 16, 4, 1, 8)
    (q2, k2, v2), other = inputs(9, 1, 150, 4, 2, 16, 4, 1, 8)
    p = 97
    later = lambda a, b: jnp.concatenate([a[:, :p + 1], b[:, p + 1:]], axis=1)
    o, _, loss = htree_attention_reference(q, k, v, config, index=index)
    o2, _, loss2 = htree_attention_reference(later(q, q2), later(k, k2), later(v, v2), config,
                                             index=Index(*(later(a, b) for a, b in
                                                           ((index.q, other.q), (index.k, other.k),
                                                            (index.w, other.w)))))
    np.testing.assert_array_equal(np.asarray(o[:, :p + 1]), np.asarray(o2[:, :p + 1]))
    np.testing.assert_array_equal(np.asarray(loss[:, :p + 1]), np.asarray(loss2[:, :p + 1]))
    assert float(jnp.abs(o[:, p + 1:] - o2[:, p + 1:]).max()) > 0


def test_the_keys_order_as_the_scores_and_tie_to_the_smaller_position():
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.standard_normal(200) * 10.0 ** rng.integers(-30, 30, 200), [0.0, -0.0, np.inf, -np.inf]])
    x = x.astype(np.float32)
    positions = rng.permutation(len(x)).astype(np.int32)
    log_n = 9
    keys = np.asarray(pack_index_scores(jnp.asarray(x), jnp.asarray(positions), log_n))
    np.testing.assert_array_equal(keys, pack_index_scores_numpy(x, positions, log_n))
    assert (keys >= 0).all()
    # Larger scores give larger keys wherever the kept high bits differ.
    order = np.argsort(x, kind="stable")
    high = keys[order] >> log_n
    assert (np.diff(high) >= 0).all()
    tied = np.asarray(pack_index_scores(jnp.zeros(4) + 2.5, jnp.arange(4, dtype=jnp.int32), log_n))
    assert list(np.argsort(-tied)) == [0, 1, 2, 3]
    assert int(pack_index_scores(jnp.asarray([np.nan], jnp.float32), jnp.asarray([3]), log_n)[0]) == (1 << log_n) - 4


def test_the_api_returns_the_loss_last_under_jit_and_zero_for_one_layer():
    config = HTreeConfig(compression_rate=4, top_k=4, selection="indexer")
    (q, k, v), index = inputs(6, 1, 100, 4, 2, 16, 4, 1, 8)
    o, selected, loss = htree_attention(q, k, v, config, index=index, return_selected=True)
    o2, loss2 = jax.jit(lambda q, k, v, index: htree_attention(q, k, v, config, index=index))(q, k, v, index)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o2))
    np.testing.assert_array_equal(np.asarray(loss), np.asarray(loss2))
    assert loss.shape == (1, 100, 2) and len(selected) == 2
    short = HTreeConfig(compression_rate=4, top_k=32, selection="indexer")  # 100 <= 128: one layer
    _, loss = htree_attention(q, k, v, short, index=index)
    assert loss.shape == (1, 100, 2) and float(jnp.abs(loss).max()) == 0


def test_what_the_indexer_does_not_take_is_refused_by_name():
    config = HTreeConfig(compression_rate=4, top_k=4, selection="indexer")
    (q, k, v), index = inputs(7, 1, 64, 4, 2, 16, 4, 1, 8)
    with pytest.raises(ValueError, match="selection='indexer'.*index None"):
        htree_attention(q, k, v, config)
    with pytest.raises(ValueError, match="selection='bound', index given"):
        htree_attention(q, k, v, HTreeConfig(compression_rate=4, top_k=4), index=index)
    with pytest.raises(ValueError, match="runs on backend='reference' only"):
        htree_attention(q, k, v, config, index=index, backend="pallas_interpret")
    with pytest.raises(ValueError, match="segment_ids"):
        htree_attention(q, k, v, config, index=index, segment_ids=jnp.zeros((1, 64), jnp.int32))
    with pytest.raises(ValueError, match="return_importance"):
        htree_attention(q, k, v, config, index=index, return_importance=True)
    with pytest.raises(ValueError, match=r"index.q's heads \(3\) must be a multiple of index.k's \(2\)"):
        htree_attention(q, k, v, config, index=Index(index.q[:, :, :3], jnp.concatenate([index.k] * 2, 2),
                                                     index.w[:, :, :3]))
    with pytest.raises(ValueError, match="index.k's heads must be 1 .shared. or H_kv = 2"):
        htree_attention(q, k, v, config, index=Index(index.q, jnp.concatenate([index.k] * 4, 2), index.w))
    with pytest.raises(ValueError, match=r"index.w must be \[B, T, H_I\]"):
        htree_attention(q, k, v, config, index=Index(index.q, index.k, index.w[:, :, :2]))
    with pytest.raises(ValueError, match="block_source must be 'first'"):
        HTreeConfig(compression_rate=4, top_k=4, selection="indexer", block_source="previous")
    with pytest.raises(ValueError, match="does not decode yet"):
        htree_jax_init_cache(config)
    from htree_jax import attention_fn
    with pytest.raises(ValueError, match="attention_fn does not take selection='indexer'"):
        attention_fn(config)
    from htree_jax.linen import HTreeAttention as LinenAttention
    with pytest.raises(ValueError, match="linen HTreeAttention does not take selection='indexer'"):
        LinenAttention(num_heads=4, in_features=16, num_kv_heads=2, config=config).init(
            jax.random.key(0), jnp.zeros((1, 64, 16)))


def htree_jax_init_cache(config):
    from htree_jax import init_cache
    return init_cache(1, 64, 2, 16, 16, config)


def test_the_module_trains_its_indexer_from_its_loss_alone():
    """`HTreeAttention(..., indexer=...)`: the index loss's gradient reaches the index
    projections only; a few Adam steps on it lower it."""
    import optax

    config = HTreeConfig(compression_rate=4, top_k=4, selection="indexer")
    model = HTreeAttention(4, 32, num_kv_heads=2, config=config, indexer=IndexerConfig(heads=4, head_dim=8),
                           rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 120, 32))

    def index_loss(model, x):
        model(x)
        return sum(jax.tree.leaves(nnx.state(model, IndexLoss)))

    grads = nnx.state(nnx.grad(index_loss)(model, x), nnx.Param)
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        name = jax.tree_util.keystr(path)
        assert (float(jnp.abs(g).max()) > 0) == ("index_" in name), name
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
        loss, g = nnx.value_and_grad(index_loss)(model, x)
        optimizer.update(model, g)
        return loss

    first = float(step(model, optimizer, x))
    for _ in range(20):
        last = float(step(model, optimizer, x))
    assert last < 0.8 * first
    with pytest.raises(ValueError, match="indexer is for HTreeConfig.selection='indexer'"):
        HTreeAttention(4, 32, num_kv_heads=2, indexer=IndexerConfig(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"IndexerConfig.heads \(3\) must be a multiple"):
        HTreeAttention(4, 32, num_kv_heads=2, config=config, indexer=IndexerConfig(heads=3, shared_key=False),
                       rngs=nnx.Rngs(0))


def test_the_warm_up_trains_the_indexer_and_holds_the_model(tmp_path):
    """`train_tiny_lm --index-warmup-steps`: the indexer's projections move; every other
    parameter stays as it was."""
    from tests.test_examples import load_example, write_corpus

    example = load_example()
    corpus = tmp_path / "corpus"
    write_corpus(corpus, example)
    args = example.parse_args(["--data", str(corpus), "--seq-len", "64", "--steps", "1", "--batch", "2",
                               "--d-model", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
                               "--compression-rate", "4", "--top-k", "2", "--selection", "indexer",
                               "--index-warmup-steps", "8", "--log-every", "100"])
    model = example.build_model(args)
    before = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    example.warm_up_indexer(model, example.task_of(args), args)
    after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    moved = {"/".join(map(str, p)): bool(np.any(np.asarray(a) != np.asarray(b)))
             for (p, a), (_, b) in zip(jax.tree_util.tree_flatten_with_path(before)[0],
                                       jax.tree_util.tree_flatten_with_path(after)[0])}
    assert moved and all(changed == ("index_" in name) for name, changed in moved.items()), moved
