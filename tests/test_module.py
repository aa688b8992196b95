"""The Flax modules and `attention_fn` (issue 5): equal to `htree_attention` on their own
projections, nnx == linen from the same weights, `nnx.MultiHeadAttention` with
`attention_fn` == `HTreeAttention`, jit / nnx.jit / nnx.grad / optax, clear errors."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import htree_jax
from htree_jax import HTreeAttention, HTreeConfig, attention_fn, htree_attention
from htree_jax import linen as htree_linen
from htree_jax import module as htree_module
from htree_jax.backends import choose_backend

# (num_heads, num_kv_heads, in_features, head_dim, config, T): multi-layer trees at small T.
CASES = [
    (4, 2, 32, None, HTreeConfig(compression_rate=4, top_k=4, selection_block=1), 150),  # 3 layers
    (4, 4, 24, 6, HTreeConfig(compression_rate=2, top_k=8, importance="shared_max", selection_block=1), 100),  # 4 layers
    (6, 2, 48, 16, HTreeConfig(compression_rate=8, top_k=2, selection_block=1), 90),  # 2 layers
    (2, 1, 16, None, HTreeConfig(selection_block=1), 33),  # 1 layer: exact attention
]


def _inputs(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def _linen_params(module: HTreeAttention):
    """The nnx module's weights in the linen twin's layout (the same arrays)."""
    state = nnx.state(module, nnx.Param)
    return {"params": {name: {leaf: state[name][leaf][...] for leaf in state[name]}
                       for name in ("query", "key", "value", "out")}}


@pytest.mark.parametrize("H, H_kv, D_in, D, config, T", CASES)
def test_nnx_module_equals_htree_attention_on_its_projections(H, H_kv, D_in, D, config, T):
    assert config.num_layers(T) == {150: 3, 100: 4, 90: 2, 33: 1}[T]
    m = HTreeAttention(H, D_in, num_kv_heads=H_kv, head_dim=D, config=config, use_bias=True,
                       bias_init=nnx.initializers.normal(0.5), rngs=nnx.Rngs(T))
    x = _inputs(T, (2, T, D_in))
    q, k, v = m.query(x), m.key(x), m.value(x)
    assert q.shape == (2, T, H, D or D_in // H) and k.shape == (2, T, H_kv, D or D_in // H)
    want = m.out(htree_attention(q, k, v, config, backend="reference"))
    got = m(x)
    assert got.shape == (2, T, D_in)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("H, H_kv, D_in, D, config, T", CASES[:2])
def test_linen_twin_equals_nnx_from_the_same_weights(H, H_kv, D_in, D, config, T):
    m = HTreeAttention(H, D_in, num_kv_heads=H_kv, head_dim=D, out_features=12, config=config,
                       rngs=nnx.Rngs(1))
    x = _inputs(2, (2, T, D_in))
    twin = htree_linen.HTreeAttention(H, D_in, num_kv_heads=H_kv, head_dim=D, out_features=12, config=config)
    params = twin.init(jax.random.key(0), x)
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, _linen_params(m))
    got = twin.apply(_linen_params(m), x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(m(x)), rtol=1e-6, atol=1e-6)
    # and under jit, with the causal mask passed explicitly
    mask = nn.make_causal_mask(x[..., 0])
    got_jit = jax.jit(lambda p, x: twin.apply(p, x, mask=mask))(_linen_params(m), x)
    np.testing.assert_allclose(np.asarray(got_jit), np.asarray(got), rtol=1e-6, atol=1e-6)


def test_extra_batch_axes_and_bfloat16():
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    m = HTreeAttention(4, 32, num_kv_heads=2, config=config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = _inputs(3, (2, 3, 70, 32), jnp.bfloat16)
    y = m(x)
    assert y.shape == (2, 3, 70, 32) and y.dtype == jnp.bfloat16
    flat = m(x.reshape(6, 70, 32)).reshape(2, 3, 70, 32)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(flat, np.float32))


def test_jit_nnx_jit_grad_and_an_optax_step():
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    m = HTreeAttention(4, 32, num_kv_heads=2, config=config, rngs=nnx.Rngs(0))
    x = _inputs(4, (2, 80, 32))
    target = _inputs(5, (2, 80, 32))
    eager = m(x)
    np.testing.assert_allclose(np.asarray(nnx.jit(lambda m, x: m(x))(m, x)), np.asarray(eager), rtol=1e-5, atol=1e-6)
    graphdef, state = nnx.split(m)
    pure = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))
    np.testing.assert_allclose(np.asarray(pure(state, x)), np.asarray(eager), rtol=1e-5, atol=1e-6)

    def loss_fn(m):
        return jnp.mean((m(x) - target) ** 2)

    grads = nnx.grad(loss_fn)(m)
    for name in ("query", "key", "value", "out"):
        g = np.asarray(grads[name]["kernel"][...])
        assert np.all(np.isfinite(g)) and np.abs(g).max() > 0, name

    optimizer = nnx.Optimizer(m, optax.adam(3e-2), wrt=nnx.Param)

    @nnx.jit
    def train_step(m, optimizer):
        loss, grads = nnx.value_and_grad(loss_fn)(m)
        optimizer.update(m, grads)
        return loss

    losses = [float(train_step(m, optimizer)) for _ in range(8)]
    assert losses[-1] < 0.9 * losses[0], losses


@pytest.mark.parametrize("H, H_kv, D_in, D, config, T", CASES[::2])
def test_nnx_multihead_attention_with_attention_fn_equals_module(H, H_kv, D_in, D, config, T):
    m = HTreeAttention(H, D_in, num_kv_heads=H_kv, head_dim=D, config=config, use_bias=True,
                       bias_init=nnx.initializers.normal(0.5), rngs=nnx.Rngs(2))
    mha = nnx.MultiHeadAttention(H, D_in, qkv_features=H * (D or D_in // H), num_kv_heads=H_kv,
                                 attention_fn=attention_fn(config), decode=False, rngs=nnx.Rngs(3))
    nnx.update(mha, nnx.state(m, nnx.Param))
    x = _inputs(6, (2, T, D_in))
    want = np.asarray(m(x))
    np.testing.assert_array_equal(np.asarray(mha(x, is_causal=True)), want)
    np.testing.assert_array_equal(np.asarray(mha(x, mask=nnx.make_causal_mask(x[..., 0]))), want)
    jitted = nnx.jit(lambda mha, x: mha(x, is_causal=True))
    np.testing.assert_allclose(np.asarray(jitted(mha, x)), want, rtol=1e-5, atol=1e-6)


def test_defaults_match_flax_so_weights_move_between_the_modules():
    """A drop-in module: with both at their defaults (biases included), the weights of an
    `HTreeAttention` load into `nnx.MultiHeadAttention` / `nn.MultiHeadDotProductAttention`
    (and back), and the two compute the same thing."""
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    m = HTreeAttention(4, 32, config=config, bias_init=nnx.initializers.normal(0.5), rngs=nnx.Rngs(2))
    mha = nnx.MultiHeadAttention(4, 32, attention_fn=attention_fn(config), decode=False, rngs=nnx.Rngs(3))
    nnx.update(mha, nnx.state(m, nnx.Param))
    x = _inputs(6, (2, 40, 32))
    np.testing.assert_array_equal(np.asarray(mha(x, is_causal=True)), np.asarray(m(x)))
    nnx.update(m, nnx.state(mha, nnx.Param))  # and back
    twin = htree_linen.HTreeAttention(4, 32, config=config)
    params = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=32).init(jax.random.key(0), x, x)
    assert jax.tree_util.tree_structure(twin.init(jax.random.key(1), x)) == jax.tree_util.tree_structure(params)


def test_linen_multihead_attention_with_attention_fn_equals_linen_module():
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    x = _inputs(7, (2, 150, 32))
    mha = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=32, use_bias=False,
                                          attention_fn=attention_fn(config))
    mask = nn.make_causal_mask(x[..., 0])
    params = mha.init(jax.random.key(0), x, x, mask=mask)
    twin = htree_linen.HTreeAttention(4, 32, config=config, use_bias=False)
    want = twin.apply(params, x)
    got = jax.jit(lambda p, x: mha.apply(p, x, x, mask=nn.make_causal_mask(x[..., 0])))(params, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_pallas_backend_in_the_module_matches_the_reference():
    """The module on the Pallas kernels (interpreted here), forward and gradients."""
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    kw = dict(num_kv_heads=2, head_dim=32, config=config)
    ref = HTreeAttention(4, 32, backend="reference", rngs=nnx.Rngs(0), **kw)
    pal = HTreeAttention(4, 32, backend="pallas_interpret", rngs=nnx.Rngs(0), **kw)
    x = _inputs(8, (1, 40, 32))  # 40 -> 10: two layers
    np.testing.assert_allclose(np.asarray(pal(x)), np.asarray(ref(x)), rtol=2e-5, atol=2e-5)
    loss = lambda m: jnp.sum(jnp.sin(m(x)))
    g_ref, g_pal = nnx.grad(loss)(ref), nnx.grad(loss)(pal)
    for name in ("query", "key", "value", "out"):
        want, got = np.asarray(g_ref[name]["kernel"][...]), np.asarray(g_pal[name]["kernel"][...])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


# ---- errors ---------------------------------------------------------------------------


def _module(**kw):
    args = dict(num_heads=4, in_features=32, num_kv_heads=2, config=HTreeConfig(compression_rate=4, top_k=4, selection_block=1))
    args.update(kw)
    return HTreeAttention(args.pop("num_heads"), args.pop("in_features"), rngs=nnx.Rngs(0), **args)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_kv_heads=3), "num_heads must be a multiple of num_kv_heads"),
    (dict(in_features=30), "in_features must be divisible by num_heads"),
    (dict(head_dim=7), "head_dim must be even"),
    (dict(num_heads=0), "num_heads must be a positive int"),
    (dict(out_features=-1), "out_features must be a positive int"),
    (dict(backend="cuda"), "backend must be one of"),
    (dict(config={"top_k": 4}), "config must be an HTreeConfig"),
])
def test_constructor_errors(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _module(**kwargs)


def test_linen_constructor_errors_at_init():
    x = jnp.zeros((1, 8, 32))
    with pytest.raises(ValueError, match="num_heads must be a multiple of num_kv_heads"):
        htree_linen.HTreeAttention(4, 32, num_kv_heads=3).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="inputs: last axis must be in_features=32"):
        htree_linen.HTreeAttention(4, 32).init(jax.random.key(0), jnp.zeros((1, 8, 16)))


def test_call_errors():
    m = _module()
    x = _inputs(0, (2, 20, 32))
    with pytest.raises(ValueError, match="inputs: last axis must be in_features=32"):
        m(x[..., :16])
    full = jnp.ones((2, 1, 20, 20), bool)
    with pytest.raises(ValueError, match="only the causal mask is supported"):
        m(x, mask=full)
    padding = nnx.make_causal_mask(x[..., 0]) * (jnp.arange(20) < 15)
    with pytest.raises(ValueError, match="only the causal mask is supported"):
        m(x, mask=padding)
    with pytest.raises(ValueError, match=r"mask must broadcast to \[batch..., H, T, T\]"):
        m(x, mask=jnp.ones((3, 1, 20, 20), bool))
    # Under jit a mask has no values before the kernels run: refused while tracing, with
    # the way to ask for causal attention without one (None is causal here).
    with pytest.raises(ValueError, match=r"a mask traced under jit .* mask=None \(HTreeAttention"):
        nnx.jit(lambda m, x, mask: m(x, mask=mask))(m, x, full)
    with pytest.raises(ValueError, match="a mask traced under jit"):
        nnx.jit(lambda m, x: m(x, mask=nnx.make_causal_mask(x[..., 0])))(m, x)


def _mha(**kw):
    return nnx.MultiHeadAttention(4, 32, num_kv_heads=2, decode=False, rngs=nnx.Rngs(0),
                                  attention_fn=attention_fn(HTreeConfig(compression_rate=4, top_k=4, selection_block=1)), **kw)


def test_attention_fn_errors():
    x = _inputs(0, (2, 20, 32))
    with pytest.raises(ValueError, match="Pass is_causal=True"):
        _mha()(x)  # no mask, is_causal=False: bidirectional attention asked
    with pytest.raises(ValueError, match="dropout on htree attention weights is not supported"):
        _mha(dropout_rate=0.1)(x, is_causal=True, deterministic=False)
    with pytest.raises(ValueError, match="nothing to sow"):
        _mha()(x, is_causal=True, sow_weights=True)
    # is_causal=True ANDs the mask with the causal one: a padding mask still changes it
    padding = jnp.broadcast_to(jnp.arange(20) < 15, (2, 1, 20, 20))
    with pytest.raises(ValueError, match="True on and below the diagonal"):
        _mha()(x, is_causal=True, mask=padding)
    # ... while an all-True mask with is_causal=True is causal attention
    np.testing.assert_array_equal(np.asarray(_mha()(x, is_causal=True, mask=jnp.ones((20, 20), bool)[None, None])),
                                  np.asarray(_mha()(x, is_causal=True)))
    with pytest.raises(ValueError, match="check_mask must be True, False or 'device'"):
        attention_fn(check_mask="yes")
    fn = attention_fn(HTreeConfig(compression_rate=4, top_k=4, selection_block=1))
    q = _inputs(1, (2, 20, 4, 8))
    kv = _inputs(2, (2, 20, 2, 8))
    with pytest.raises(ValueError, match=r"same length T.*use htree_jax.HTreeAttention\(\.\.\., decode=True\) "
                                         r"\(or htree_jax.init_cache"):  # a decode step: where htree decodes
        fn(q[:, :1], kv, kv, is_causal=True)
    with pytest.raises(ValueError, match="bias"):
        fn(q, kv, kv, bias=jnp.zeros((20, 20)), is_causal=True)
    with pytest.raises(ValueError, match="must be a positive multiple of H_kv"):
        fn(q[:, :, :3], kv, kv, is_causal=True)
    with pytest.raises(TypeError, match="config must be an HTreeConfig"):
        attention_fn("default")
    with pytest.raises(ValueError, match="backend must be one of"):
        attention_fn(backend="triton")
    assert htree_jax.attention_fn is attention_fn


def test_traced_masks_through_attention_fn():
    """A mask traced under jit: nnx passes `is_causal`, so its caller can ask for causal
    attention without a mask, and a traced mask is a ValueError while tracing (before
    any kernel runs), saying so. Linen's module passes no `is_causal`: a traced mask is
    compared with the causal one on the device. `check_mask="device"` does that for
    nnx too; `check_mask=False` takes the mask unchecked."""
    x = _inputs(0, (2, 20, 32))
    mha = _mha()
    full = jnp.ones((2, 1, 20, 20), bool)
    causal = nnx.make_causal_mask(x[..., 0])
    with pytest.raises(ValueError, match=r"a mask traced under jit .* is_causal=True \(nnx.MultiHeadAttention\)"):
        nnx.jit(lambda mha, x, mask: mha(x, mask=mask))(mha, x, full)
    with pytest.raises(ValueError, match="a mask traced under jit"):
        nnx.jit(lambda mha, x: mha(x, mask=nnx.make_causal_mask(x[..., 0])))(mha, x)
    want = np.asarray(mha(x, is_causal=True))
    on_device = _mha()
    on_device.attention_fn = attention_fn(HTreeConfig(compression_rate=4, top_k=4, selection_block=1), check_mask="device")
    nnx.update(on_device, nnx.state(mha, nnx.Param))
    got = nnx.jit(lambda m, x: m(x, mask=nnx.make_causal_mask(x[..., 0])))(on_device, x)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(jax.errors.JaxRuntimeError, match="the mask passed under jit is not the causal mask"):
        jax.block_until_ready(nnx.jit(lambda m, x, mask: m(x, mask=mask))(on_device, x, full))
    trusting = attention_fn(HTreeConfig(compression_rate=4, top_k=4, selection_block=1), check_mask=False)
    q, kv = _inputs(1, (2, 20, 4, 8)), _inputs(2, (2, 20, 2, 8))
    got = jax.jit(lambda q, kv, mask: trusting(q, kv, kv, mask=mask, is_causal=False))(q, kv, causal)
    np.testing.assert_allclose(np.asarray(got), np.asarray(trusting(q, kv, kv, is_causal=True)), rtol=1e-5, atol=1e-6)
    # linen: no is_causal reaches attention_fn; a wrong traced mask is caught on the device
    lmha = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=32, attention_fn=attention_fn(
        HTreeConfig(compression_rate=4, top_k=4, selection_block=1)))
    params = lmha.init(jax.random.key(0), x, x, mask=causal)
    with pytest.raises(jax.errors.JaxRuntimeError, match="the mask passed under jit is not the causal mask"):
        jax.block_until_ready(jax.jit(lambda p, x, mask: lmha.apply(p, x, x, mask=mask))(params, x, full))


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_module_on_the_gpu_kernels_matches_the_reference(dtype):
    """On a GPU, backend="auto" runs the compiled Pallas kernels (K=64 is in their range).
    Outputs equal the reference's wherever the two chose the same nodes (near-ties of the
    packed importance may flip a few selections: docs/backends.md, README "Hard selection"); the parameter
    gradients, sums over every query, agree to a relative error that leaves room for
    those (and that an all-zero or sign-flipped gradient does not meet)."""
    assert choose_backend("auto", lambda name: None) == "pallas"
    config = HTreeConfig(compression_rate=8, top_k=16, selection_block=1)  # 2048 -> 256 -> 32: 3 layers
    kw = dict(num_kv_heads=2, head_dim=64, config=config, dtype=dtype)
    fast = HTreeAttention(8, 256, backend="auto", rngs=nnx.Rngs(0), **kw)
    ref = HTreeAttention(8, 256, backend="reference", rngs=nnx.Rngs(0), **kw)
    x = _inputs(9, (2, 2048, 256), dtype)
    assert config.num_layers(2048) == 3
    q, k, v = ref.query(x), ref.key(x), ref.value(x)
    o_fast, sel_fast = htree_attention(q, k, v, config, backend="pallas", return_selected=True)
    o_ref, sel_ref = htree_attention(q, k, v, config, backend="reference", return_selected=True)
    same = np.ones(q.shape[:2] + (2,), bool)  # [B, T, H_kv]
    for a, b in zip(sel_fast, sel_ref):
        same &= np.all(np.asarray(a) == np.asarray(b), axis=-1)
    assert same.mean() > 0.99, same.mean()
    rows = np.repeat(same, 4, axis=-1)  # query heads of each kv head
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    y_fast, y_ref = (np.asarray(o, np.float32)[rows] for o in (o_fast, o_ref))
    np.testing.assert_allclose(y_fast, y_ref, atol=tol * np.abs(y_ref).max())

    def grads(module, x):
        loss = lambda m: jnp.sum(jnp.sin(m(x).astype(jnp.float32)))
        g = nnx.jit(lambda m: nnx.grad(loss)(m))(module)
        return {name: np.asarray(g[name]["kernel"][...], np.float32) for name in ("query", "key", "value", "out")}

    relative = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))
    # The truth: the reference in float32 from the same (float32) parameters and inputs.
    truth = grads(HTreeAttention(8, 256, backend="reference", rngs=nnx.Rngs(0), **{**kw, "dtype": jnp.float32}),
                  x.astype(jnp.float32))
    g_fast, g_ref = grads(fast, x), grads(ref, x)
    for name in truth:
        assert np.all(np.isfinite(g_fast[name])), name
        print(f"{name}: Pallas {relative(g_fast[name], truth[name]):.4f}, "
              f"reference {relative(g_ref[name], truth[name]):.4f} (relative to the float32 reference)")
        if dtype == jnp.float32:
            # The kernels' 3xTF32 importance flips a few near-tie selections (H200: 0.0043
            # for the query projection, below 1e-4 where nothing flips).
            assert relative(g_fast[name], truth[name]) < 1e-2, name
        else:
            # bf16 rounds the projections and the attention alike on both backends: the
            # kernels' gradients must be at least as close to the truth as the reference's
            # own bf16 ones (H200: query 0.109 / 0.109, key 0.075 / 0.075, value 0.009 /
            # 0.106, out 0.010 / 0.010), which an all-zero gradient (1.0) is not.
            got, ref_error = relative(g_fast[name], truth[name]), relative(g_ref[name], truth[name])
            assert got <= 1.25 * ref_error + 0.01, (name, got, ref_error)


# ---- decoding ---------------------------------------------------------------------------


def test_nnx_decode_reproduces_the_full_sequence():
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    m = HTreeAttention(4, 32, num_kv_heads=2, config=config, rngs=nnx.Rngs(0))
    x = _inputs(11, (2, 45, 32))
    full = m(x)
    m.init_cache(2, 64)  # 64 -> 16: one layer more than... the same 2 layers as T=45 here
    step = nnx.jit(lambda m, x: m(x, decode=True))
    outs = [m(x[:, :7], decode=True)]  # a prompt
    outs += [step(m, x[:, t:t + 1]) for t in range(7, 45)]
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 1)), np.asarray(full), rtol=1e-5, atol=1e-5)
    assert np.asarray(m.cache.get_value().lengths).tolist() == [45] * m.cache.get_value().batch_size
    with pytest.raises(ValueError, match="cache overflow"):
        m(jnp.zeros((2, 20, 32)), decode=True)
    m2 = HTreeAttention(4, 32, num_kv_heads=2, config=config, decode=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="call init_cache"):
        m2(x[:, :1])
    m2.init_cache(2, 8)
    with pytest.raises(ValueError, match="mask must be None with decode=True"):
        m2(x[:, :1], mask=jnp.ones((1, 1), bool))


def test_nnx_decode_with_the_pallas_backend_interpreted():
    """`backend="pallas_interpret"`: decoding runs the Pallas decode kernels."""
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)  # 20 -> 5: 2 layers
    kw = dict(num_kv_heads=2, head_dim=32, config=config)
    m = HTreeAttention(4, 32, backend="pallas_interpret", rngs=nnx.Rngs(0), **kw)
    ref = HTreeAttention(4, 32, backend="reference", rngs=nnx.Rngs(0), **kw)
    x = _inputs(12, (2, 20, 32))
    full = ref(x)
    m.init_cache(2, 20)
    outs = [m(x[:, :18], decode=True)] + [m(x[:, t:t + 1], decode=True) for t in (18, 19)]
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 1)), np.asarray(full), rtol=1e-5, atol=1e-5)


def test_decode_block_sizes_reach_the_decode_kernels(monkeypatch):
    """`decode_block_sizes` (nnx and linen) is what `prefill` gets; anything but a
    `DecodeBlockSizes` or None is refused at construction (nnx) or first call (linen)."""
    blocks = htree_jax.DecodeBlockSizes(span=32, target_programs=64)
    seen = []
    for module in (htree_module, htree_linen):
        real = module.prefill
        spy = lambda *a, real=real, **kw: seen.append(kw["block_sizes"]) or real(*a, **kw)
        monkeypatch.setattr(module, "prefill", spy)
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    x = _inputs(14, (2, 6, 32))
    m = HTreeAttention(4, 32, num_kv_heads=2, config=config, decode_block_sizes=blocks, rngs=nnx.Rngs(0))
    m.init_cache(2, 8)
    m(x, decode=True)
    model = htree_linen.HTreeAttention(4, 32, num_kv_heads=2, config=config, decode_block_sizes=blocks)
    variables = model.init(jax.random.key(0), x, decode=True)
    model.apply(variables, x, decode=True, mutable=["cache"])
    assert seen and all(b is blocks for b in seen)
    with pytest.raises(TypeError, match="block_sizes must be an htree_jax.DecodeBlockSizes"):
        HTreeAttention(4, 32, decode_block_sizes=htree_jax.BlockSizes(), rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="block_sizes must be an htree_jax.DecodeBlockSizes"):
        htree_linen.HTreeAttention(4, 32, decode_block_sizes=8).init(jax.random.key(0), x)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
def test_module_decode_on_the_gpu_kernels_matches_the_full_sequence():
    """On a GPU, decoding with backend="auto" runs the compiled Pallas decode kernels."""
    config = HTreeConfig(compression_rate=8, top_k=16, selection_block=1)  # 512 -> 64 -> 8: 3 layers
    kw = dict(num_kv_heads=2, head_dim=64, config=config)
    m = HTreeAttention(8, 256, backend="auto", rngs=nnx.Rngs(0), **kw)
    ref = HTreeAttention(8, 256, backend="reference", rngs=nnx.Rngs(0), **kw)
    x = _inputs(13, (2, 512, 256))
    full = np.asarray(ref(x))
    m.init_cache(2, 512)
    step = nnx.jit(lambda m, x: m(x, decode=True))
    outs = [m(x[:, :500], decode=True)] + [step(m, x[:, t:t + 1]) for t in range(500, 512)]
    got = np.asarray(jnp.concatenate(outs, 1))
    np.testing.assert_allclose(got, full, atol=1e-4 * np.abs(full).max())


def test_linen_decode_reproduces_the_full_sequence():
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    model = htree_linen.HTreeAttention(4, 32, num_kv_heads=2, config=config)
    x = _inputs(12, (2, 40, 32))
    params = model.init(jax.random.key(0), x)
    full = model.apply(params, x)
    variables = model.init(jax.random.key(0), jnp.zeros((2, 50, 32)), decode=True)  # cache for 50
    cache = variables["cache"]
    outs = []
    for start, stop in [(0, 1), (1, 9)] + [(t, t + 1) for t in range(9, 40)]:
        o, mutated = model.apply({"params": params["params"], "cache": cache}, x[:, start:stop], decode=True,
                                 mutable=["cache"])
        cache = mutated["cache"]
        outs.append(o)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 1)), np.asarray(full), rtol=1e-5, atol=1e-5)


def _decode_like_mha(attn, x):
    """Token-by-token decoding written for `nnx.MultiHeadAttention` (its docstring's
    form): `init_cache(input_shape)`, then one token a call with `decode=True`."""
    attn.init_cache(x.shape)
    return jnp.concatenate([attn(x[:, t:t + 1], decode=True) for t in range(x.shape[1])], axis=1)


@pytest.mark.parametrize("selection_block", [1, None])  # per query; the default (by block)
def test_init_cache_takes_multihead_attentions_call(selection_block):
    """Code written for MHA's decoding runs with `HTreeAttention` swapped in and gives its
    full-sequence output; the same code runs MHA itself (so it is MHA's convention). At
    the default (block selection) too: the module passes the cache its query heads."""
    x = _inputs(15, (2, 24, 32))
    mha = nnx.MultiHeadAttention(4, 32, num_kv_heads=2, decode=True, rngs=nnx.Rngs(0))
    want_mha = mha(x, mask=nnx.make_causal_mask(x[..., 0]), decode=False)
    np.testing.assert_allclose(np.asarray(_decode_like_mha(mha, x)), np.asarray(want_mha), rtol=1e-5, atol=1e-5)

    config = HTreeConfig(compression_rate=4, top_k=2, selection_block=selection_block)  # 24 -> 6: two layers
    attn = HTreeAttention(4, 32, num_kv_heads=2, config=config, decode=True, rngs=nnx.Rngs(0))
    full = attn(x, decode=False)
    np.testing.assert_allclose(np.asarray(_decode_like_mha(attn, x)), np.asarray(full), rtol=1e-5, atol=1e-5)
    cache = attn.cache.get_value()
    assert cache.batch_size == 2 and cache.dtype == jnp.float32
    attn.init_cache(x.shape, dtype=jnp.bfloat16)  # MHA's dtype keyword
    assert attn.cache.get_value().dtype == jnp.bfloat16
    attn.init_cache(2, 24)  # the batch_size, max_len form still works
    with pytest.raises(ValueError, match=r"input_shape must be \(batch, max_len, in_features=32\)"):
        attn.init_cache((2, 24, 16))
    with pytest.raises(ValueError, match="input_shape must be"):
        attn.init_cache((2, 3, 24, 32))
    with pytest.raises(TypeError, match="takes max_len from input_shape"):
        attn.init_cache((2, 24, 32), 24)
    with pytest.raises(TypeError, match="init_cache needs max_len"):
        attn.init_cache(2)


@pytest.mark.parametrize("selection_block", [1, None])  # per query; the default (by block)
def test_linen_module_takes_multihead_dot_product_attentions_decoding(selection_block):
    """Linen's convention (the module built with `decode=True`, `init` on the whole
    sequence's shape makes the cache, then `apply(..., mutable=["cache"])` a token at a
    time): the same loop runs `nn.MultiHeadDotProductAttention` and the linen
    `HTreeAttention`."""
    x = _inputs(16, (2, 20, 32))

    def decode_like_linen(decoder, params):
        cache = decoder.init(jax.random.key(0), jnp.zeros(x.shape))["cache"]
        outs = []
        for t in range(x.shape[1]):
            o, mutated = decoder.apply({"params": params, "cache": cache}, x[:, t:t + 1], mutable=["cache"])
            cache = mutated["cache"]
            outs.append(o)
        return jnp.concatenate(outs, axis=1)

    mha = nn.MultiHeadDotProductAttention(4, qkv_features=32)
    params = mha.init(jax.random.key(0), x)["params"]
    want = mha.apply({"params": params}, x, mask=nn.make_causal_mask(x[..., 0]))
    got = decode_like_linen(nn.MultiHeadDotProductAttention(4, qkv_features=32, decode=True), params)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)

    # 20 -> 5: two layers
    kw = dict(num_kv_heads=2, config=HTreeConfig(compression_rate=4, top_k=2, selection_block=selection_block))
    model = htree_linen.HTreeAttention(4, 32, **kw)
    params = model.init(jax.random.key(0), x)["params"]
    full = model.apply({"params": params}, x)
    got = decode_like_linen(htree_linen.HTreeAttention(4, 32, decode=True, **kw), params)
    np.testing.assert_allclose(np.asarray(got), np.asarray(full), rtol=1e-5, atol=1e-5)
