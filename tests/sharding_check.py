"""Run in its own process by tests/test_sharding.py: 8 simulated CPU devices (XLA_FLAGS
set before JAX starts). Prints one line per check; exits non-zero on a failure."""

from __future__ import annotations

import dataclasses
import os
import re
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from htree_jax import HTreeConfig, htree_attention, memory_plan  # noqa: E402
from htree_jax.backends import attend  # noqa: E402
from htree_jax.memory import resident_bytes  # noqa: E402
from pallas_kernels.shared.kernels import BlockKernels  # noqa: E402
from tools import gpu_gate  # noqa: E402

# 3 layers at T=152; the mean named, as the bound (the default) has runs of its own below.
CONFIG = HTreeConfig(compression_rate=4, top_k=4, selection="mean", selection_block=1)
B, T, H, H_KV, K, V = 4, 152, 8, 4, 32, 32


def memory_plans() -> int:
    """`memory_plan` of a call sharded along T over 1, 2 and 8 devices: each device
    holds its share of q, k, v (its inputs, the arguments less the constants the program
    takes, exactly 1/n of the whole), and the peak of the
    forward and of the forward+backward falls with the device count."""
    T_plan = 1024
    shapes = [(1, T_plan, 8, 32), (1, T_plan, 2, 32), (1, T_plan, 2, 32)]
    peaks = {}
    counts = (1, 2, 8)
    for n in counts:
        mesh = jax.make_mesh((n,), ("seq",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])
        sharding = NamedSharding(mesh, P(None, "seq", None, None))
        args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding) for s in shapes]
        for gradients in (False, True):
            plan = memory_plan(*args, CONFIG, gradients=gradients, backend="reference")
            whole = sum(np.prod(s) for s in shapes) * 4 + (np.prod(shapes[0]) * 4 if gradients else 0)
            if plan.inputs * n != whole:
                print(f"FAIL memory plan over {n}: inputs {plan.inputs} B (arguments {plan.arguments} B less "
                      f"constants {plan.constants} B), the whole {whole} B")
                return 1
            peaks[n, gradients] = plan.peak
    for gradients in (False, True):
        row = [peaks[n, gradients] for n in counts]
        if any(b >= a for a, b in zip(row, row[1:])):
            print(f"FAIL memory plan peaks along T ({'fwd+bwd' if gradients else 'forward'}): {row}")
            return 1
    # What `compile_checked` takes off each device's need: its shard of a T-sharded array,
    # the whole of a replicated one (each array once).
    mesh = jax.make_mesh((8,), ("seq",), axis_types=(AxisType.Auto,))
    along_t = jax.device_put(jnp.zeros(shapes[0], jnp.float32), NamedSharding(mesh, P(None, "seq", None, None)))
    everywhere = jax.device_put(jnp.zeros(shapes[1], jnp.float32), NamedSharding(mesh, P()))
    held = resident_bytes((along_t, everywhere, along_t, jax.ShapeDtypeStruct(shapes[2], jnp.float32)))
    share = along_t.nbytes // 8 + everywhere.nbytes
    if held != {d: share for d in jax.devices()}:
        print(f"FAIL resident bytes over 8: {held}, each device should hold {share}")
        return 1
    print("ok memory plan: each device's share falls with the device count along T, "
          f"forward {[peaks[n, False] for n in counts]}, fwd+bwd {[peaks[n, True] for n in counts]}")
    # Block selection's kernels on context shards (interpreted): the plan is theirs.
    block = HTreeConfig(compression_rate=4, top_k=4, selection_block=4)
    block_peaks = []
    for n in (1, 8):
        mesh = jax.make_mesh((n,), ("seq",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])
        sharding = NamedSharding(mesh, P(None, "seq", None, None))
        args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding) for s in shapes]
        block_peaks.append(memory_plan(*args, block, gradients=True, backend="pallas_interpret").peak)
    if block_peaks[1] >= block_peaks[0]:
        print(f"FAIL memory plan of block selection's kernels along T (fwd+bwd over 1, 8): {block_peaks}")
        return 1
    print(f"ok memory plan: block selection's kernels along T, fwd+bwd over 1, 8: {block_peaks}")
    return 0


def module_step() -> int:
    """docs/sharding.md, "Batch and heads": an nnx model whose projection kernels carry
    `nnx.with_partitioning` annotations, sharded on a (data, model) mesh, one optax step
    under `nnx.jit`, against the same step unsharded."""
    import optax
    from flax import nnx

    from htree_jax import HTreeAttention
    from tests.helpers import run_readme_snippet

    scope = run_readme_snippet("## Batch and heads", "docs/sharding.md")
    sharded_loss, model = scope["loss"], scope["model"]
    kernel = model.query.kernel[...]
    assert "model" in str(kernel.sharding.spec), kernel.sharding
    # The same step on one device's worth of unsharded copies.
    plain = HTreeAttention(8, 256, num_kv_heads=4, config=scope["config"], rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(plain, optax.adam(1e-3), wrt=nnx.Param)
    x = np.asarray(scope["x"])

    def loss_fn(m):
        return jnp.mean(m(x) ** 2)
    want, grads = nnx.value_and_grad(loss_fn)(plain)
    opt.update(plain, grads)
    np.testing.assert_allclose(float(sharded_loss), float(want), rtol=1e-5)
    # One Adam step from the same gradients up to summation order: where a gradient is
    # near 0, m / sqrt(v) amplifies that order's rounding, so atol is 1% of the step (lr).
    np.testing.assert_allclose(np.asarray(model.out.kernel[...]), np.asarray(plain.out.kernel[...]), rtol=1e-4,
                               atol=1e-5)
    print("ok module step: sharded nnx model, optax step equals the unsharded one", flush=True)
    return 0


def packed_check(backends) -> None:
    """Packed rows (segment_ids) sharded along the batch and the kv heads equal the
    unsharded packed call, forward and gradients, no all-gather."""
    from htree_jax.attention import packing_of

    rng = np.random.default_rng(2)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    q = rng.standard_normal((B, T, H, K)).astype(np.float32)
    k = rng.standard_normal((B, T, H_KV, K)).astype(np.float32)
    v = rng.standard_normal((B, T, H_KV, V)).astype(np.float32)
    w = rng.standard_normal((B, T, H, V)).astype(np.float32)
    rows = [[1, 70, 81], [152], [40, 40, 72], [16, 16, 16, 104]]
    seg = np.stack([np.repeat(np.arange(len(r)), r) for r in rows]).astype(np.int32)
    sh = NamedSharding(mesh, P("data", None, "model", None))
    args = [jax.device_put(x, sh) for x in (q, k, v)] + [jax.device_put(seg, NamedSharding(mesh, P("data", None)))]
    for impl in backends:
        packing, _ = packing_of(jnp.asarray(seg), 8, CONFIG, B, T, None)
        want_o, want_sel = attend(*(jnp.asarray(x) for x in (q, k, v)), CONFIG, impl, packing)
        f = jax.jit(lambda q, k, v, s, impl=impl: htree_attention(q, k, v, CONFIG, backend=impl, segment_ids=s,
                                                                  max_documents=8, return_selected=True))
        f = f.lower(*args).compile()
        o, sel = f(*args)
        np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), rtol=1e-5, atol=1e-5)
        for a, b in zip(sel, want_sel):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert "all-gather" not in f.as_text(), f"{impl}: the packed forward gathers"

        def loss(q, k, v, s, impl=impl):
            return jnp.sum(htree_attention(q, k, v, CONFIG, backend=impl, segment_ids=s, max_documents=8) * w)
        want_g = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v, CONFIG, impl, packing)[0] * w),
                          argnums=(0, 1, 2))(*(jnp.asarray(x) for x in (q, k, v)))
        g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        for a, b in zip(g(*args), want_g):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
        print(f"ok {impl} packed: sharded rows equal the unsharded packed call, forward and gradients", flush=True)


def decode_check(backends) -> None:
    """prefill and decode_step on a cache sharded along the batch and the kv heads equal
    the unsharded ones, no all-gather in the compiled step."""
    from htree_jax import decode_step, init_cache, prefill

    rng = np.random.default_rng(1)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    S, steps, max_len = 40, 4, 64
    q = rng.standard_normal((B, S + steps, H, K)).astype(np.float32)
    k = rng.standard_normal((B, S + steps, H_KV, K)).astype(np.float32)
    v = rng.standard_normal((B, S + steps, H_KV, V)).astype(np.float32)
    lengths = np.array([40, 17, 0, 33], np.int32)
    tok = NamedSharding(mesh, P("data", None, "model", None))
    step_sh = NamedSharding(mesh, P("data", "model", None))

    def shard_cache(cache):
        layer = NamedSharding(mesh, P("data", None, "model", None))
        scales = NamedSharding(mesh, P("data", "model", None))  # FP8 tokens' [B, H_kv, N_0]
        rows = NamedSharding(mesh, P("data"))
        return jax.tree.map(lambda x: jax.device_put(x, {4: layer, 3: scales}.get(x.ndim, rows)), cache)

    # selection="bound" (SPEC 11): the cache's radii shard like its layers.
    # A cache that reads its values from the keys (no value layers; rope_dim 16 leaves 16
    # latent features, under the kernels' least V): the partitioning, on the reference.
    # FP8 tokens (bf16 queries and nodes): the scales shard like the layers.
    # The partitioning is the same code for both rules, every backend and every cache
    # kind: the reference runs them all, the kernels the bound (the default).
    runs = [("reference", CONFIG, "", False, None)] if "reference" in backends else []
    runs += [(impl, dataclasses.replace(CONFIG, selection="bound"), " (bound)", False, None) for impl in backends]
    runs += [("reference", dataclasses.replace(CONFIG, rope_dim=K // 2), " (values from the keys)", True, None)
             ] if "reference" in backends else []
    runs += [("reference", CONFIG, " (fp8 tokens)", False, jnp.float8_e4m3fn)] if "reference" in backends else []
    for impl, config, label, from_keys, token_dtype in runs:
        outs = {}
        dtype = jnp.float32 if token_dtype is None else jnp.bfloat16
        for sharded in (False, True):
            cache = init_cache(B, max_len, H_KV, K, K // 2 if from_keys else V, config, dtype,
                               values_from_keys=from_keys, token_dtype=token_dtype)
            put = ((lambda x, s: jax.device_put(jnp.asarray(x, dtype), s)) if sharded
                   else (lambda x, s: jnp.asarray(x, dtype)))
            if sharded:
                cache = shard_cache(cache)
            pre = jax.jit(lambda q, k, v, c, n: prefill(q, k, v, c, config, lengths=n, backend=impl))
            o, cache = pre(put(q[:, :S], tok), put(k[:, :S], tok), None if from_keys else put(v[:, :S], tok), cache,
                           lengths)
            step = jax.jit(lambda q, k, v, c: decode_step(q, k, v, c, config, backend=impl))
            got = [o]
            for i in range(steps):
                args = (put(q[:, S + i], step_sh), put(k[:, S + i], step_sh),
                        None if from_keys else put(v[:, S + i], step_sh), cache)
                if sharded and i == 0:
                    text = step.lower(*args).compile().as_text()
                    assert "all-gather" not in text, f"{impl}: the sharded decode step gathers"
                o_t, cache = step(*args)
                got.append(o_t)
            outs[sharded] = got
        # bfloat16 outputs (FP8 tokens): the two partitionings' float32 sums may round to
        # neighbouring bfloat16 values (seen: 1 element of 40960 one ulp apart, jax 0.10.2,
        # XLA:CPU at optimization level 0), so one ulp is allowed there.
        rtol = 1e-5 if dtype == jnp.float32 else 2.0**-7
        for a, b in zip(outs[True], outs[False]):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=rtol, atol=1e-5)
        print(f"ok {impl} decode{label}: sharded cache (batch, heads) equals unsharded, no all-gather", flush=True)


def latent_values_check(backends) -> None:  # the partitioning only: on the reference
    """`v=None, value_dim=` (the values the keys' first latent features) sharded along the
    batch and the kv heads equals the unsharded call with `v = k[..., :value_dim]`,
    forward and the gradients of q and k."""
    config = dataclasses.replace(CONFIG, rope_dim=32)
    rng = np.random.default_rng(3)
    q = rng.standard_normal((B, T, H, 64)).astype(np.float32)
    k = rng.standard_normal((B, T, H_KV, 64)).astype(np.float32)
    w = rng.standard_normal((B, T, H, 32)).astype(np.float32)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    sh = NamedSharding(mesh, P("data", None, "model", None))
    args = [jax.device_put(x, sh) for x in (q, k)]
    for impl in backends:
        latent = lambda q, k, impl=impl: htree_attention(q, k, None, config, backend=impl, value_dim=32)
        sliced = lambda q, k, impl=impl: htree_attention(q, k, k[..., :32], config, backend=impl)
        np.testing.assert_allclose(np.asarray(jax.jit(latent)(*args)), np.asarray(sliced(jnp.asarray(q),
                                   jnp.asarray(k))), rtol=1e-5, atol=1e-5)
        grad = lambda f: jax.grad(lambda q, k: jnp.sum(f(q, k) * w), argnums=(0, 1))
        for a, b in zip(jax.jit(grad(latent))(*args), grad(sliced)(jnp.asarray(q), jnp.asarray(k))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
        print(f"ok {impl} values from the keys: sharded (batch, heads) equals the unsharded call", flush=True)


def block_selection_check() -> int:
    """Block selection (SPEC 12, the reference): with T split over 4 or 2 shards (38
    or 76 tokens, so blocks of 4 straddle the shards' edges) the forward and gradients
    equal the unsharded call, each source; prefill and decode on a cache sharded along
    the batch and the kv heads equal the unsharded ones ("previous", whose rows reach
    furthest back); a shard shorter than 2 * selection_block is refused naming the mesh axis."""
    from htree_jax import decode_step, init_cache, prefill

    rng = np.random.default_rng(4)
    q = rng.standard_normal((B, T, H, K)).astype(np.float32)
    k = rng.standard_normal((B, T, H_KV, K)).astype(np.float32)
    v = rng.standard_normal((B, T, H_KV, V)).astype(np.float32)
    w = rng.standard_normal((B, T, H, V)).astype(np.float32)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    for source in ("first", "previous"):
        config = HTreeConfig(compression_rate=4, top_k=4, selection_block=4, block_source=source)
        plain = lambda q, k, v, config=config: attend(q, k, v, config, "reference")[0]
        want = plain(*(jnp.asarray(x) for x in (q, k, v)))
        want_g = jax.grad(lambda q, k, v: jnp.sum(plain(q, k, v) * w), argnums=(0, 1, 2))(
            *(jnp.asarray(x) for x in (q, k, v)))
        # One layout a source: T over 4 shards (38 tokens), and over 2 (76) with the heads.
        name, spec = {"first": ("tokens", P(None, "model", None, None)),
                      "previous": ("tokens+heads", P(None, "data", "model", None))}[source]
        args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
        f = lambda q, k, v, config=config: htree_attention(q, k, v, config, backend="reference")
        np.testing.assert_allclose(np.asarray(jax.jit(f)(*args)), np.asarray(want), rtol=1e-5, atol=1e-5)
        grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * w), argnums=(0, 1, 2)))(*args)
        for a, b in zip(grads, want_g):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
        print(f"ok block selection ({source}) {name}: forward and gradients equal the unsharded run", flush=True)
        if source == "first":  # the cache's partitioning is the same for both sources
            continue
        S, steps = 40, 6
        lengths = np.array([40, 17, 0, 33], np.int32)
        outs = {}
        for impl, sharded in (("reference", False), ("reference", True), ("pallas_interpret", True)):
            cache = init_cache(B, 64, H_KV, K, V, config, num_heads=H)
            tok = NamedSharding(mesh, P("data", None, "model", None))
            step_sh = NamedSharding(mesh, P("data", "model", None))
            put = (lambda x, sh: jax.device_put(x, sh)) if sharded else (lambda x, sh: jnp.asarray(x))
            if sharded:
                layer, rows = NamedSharding(mesh, P("data", None, "model", None)), NamedSharding(mesh, P("data"))
                recent = NamedSharding(mesh, P("data", None, "model", None, None))
                cache = jax.tree.map(lambda x: jax.device_put(x, {5: recent, 4: layer}.get(x.ndim, rows)), cache)
            o, cache = jax.jit(lambda q, k, v, c, n, config=config, impl=impl: prefill(
                q, k, v, c, config, lengths=n, backend=impl))(
                put(q[:, :S], tok), put(k[:, :S], tok), put(v[:, :S], tok), cache, lengths)
            got = [o]
            step = jax.jit(lambda q, k, v, c, config=config, impl=impl: decode_step(q, k, v, c, config, backend=impl))
            for i in range(steps):
                pos = np.minimum(lengths + i, T - 1)
                rows_at = lambda x: x[np.arange(B), pos]
                o_t, cache = step(put(rows_at(q), step_sh), put(rows_at(k), step_sh), put(rows_at(v), step_sh), cache)
                got.append(o_t)
            outs[impl, sharded] = got
        for impl in ("reference", "pallas_interpret"):
            for a, b in zip(outs[impl, True], outs["reference", False]):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
            print(f"ok block selection ({source}) decode on {impl}: sharded cache (batch, heads) equals unsharded",
                  flush=True)
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=4)
    if block_kernels_check(config, mesh, q, k, v, w):
        return 1
    short = [jax.device_put(x[:, :24], NamedSharding(mesh, P(None, "model", None, None))) for x in (q, k, v)]
    try:
        jax.jit(lambda q, k, v: htree_attention(q, k, v, config, backend="reference"))(*short)
    except Exception as e:  # noqa: BLE001 - under jit XLA wraps the ValueError in a JaxRuntimeError
        assert "mesh axis 'model' leaves 6 tokens a shard" in str(e), e
        print("ok block selection: a shard shorter than 2 * selection_block refused", flush=True)
        return 0
    print("FAIL: a shard shorter than 2 * selection_block was not refused", flush=True)
    return 1


def block_kernels_check(config, mesh, q, k, v, w) -> int:
    """Block selection on its kernels (interpreted) with the batch and the kv heads split,
    then ("previous", whose first block of a shard ranks with the shard before's rows)
    the tokens over 2 shards of 76 and the heads: forward and gradients equal the
    unsharded kernels' call, sharded like the inputs; the tokens over 4 shards of 38 (a
    shard holding part of a block) refused on a kernel backend, naming the mesh axis."""
    # One row (the batch is not split there): the interpreted kernels' time halved.
    if block_context_check(dataclasses.replace(config, block_source="previous"), mesh, q[:1], k[:1], v[:1], w[:1]):
        return 1
    impl = "pallas_interpret"
    plain = lambda q, k, v: attend(q, k, v, config, impl)[0]
    want = plain(*(jnp.asarray(x) for x in (q, k, v)))
    want_g = jax.grad(lambda q, k, v: jnp.sum(plain(q, k, v) * w), argnums=(0, 1, 2))(
        *(jnp.asarray(x) for x in (q, k, v)))
    sh = NamedSharding(mesh, P("data", None, "model", None))
    args = [jax.device_put(x, sh) for x in (q, k, v)]
    f = lambda q, k, v: htree_attention(q, k, v, config, backend=impl)
    forward = jax.jit(f).lower(*args).compile()  # run, and its text read, from one compile
    o = forward(*args)
    np.testing.assert_allclose(np.asarray(o), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert o.sharding.is_equivalent_to(sh, 4), o.sharding
    grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * w), argnums=(0, 1, 2)))(*args)
    for a, b in zip(grads, want_g):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
        assert a.sharding.is_equivalent_to(sh, 4), a.sharding
    text = forward.as_text()
    if "all-gather" in text:
        print("FAIL block selection kernels batch+heads: the compiled forward gathers", flush=True)
        return 1
    print("ok block selection kernels batch+heads: forward and gradients equal the unsharded kernels, no all-gather",
          flush=True)
    along_t = [jax.device_put(x, NamedSharding(mesh, P(None, "model", None, None))) for x in (q, k, v)]
    try:
        jax.jit(f)(*along_t)
    except Exception as e:  # noqa: BLE001 - under jit XLA wraps the ValueError
        assert "mesh axis 'model' shards T" in str(e) and "whole blocks" in str(e), e
        print("ok block selection kernels: a context shard of part of a block refused on a kernel backend",
              flush=True)
        return 0
    print("FAIL: a context shard of part of a block ran on the kernels", flush=True)
    return 1


def block_context_check(config, mesh, q, k, v, w) -> int:
    """Block selection's kernels (interpreted) on context shards: T over mesh axis "data"
    (2 shards of 76 tokens, whole blocks of 4), the kv heads over "model"; the forward
    and gradients equal the unsharded kernels'."""
    impl = "pallas_interpret"
    plain = lambda q, k, v: attend(q, k, v, config, impl)[0]
    want = plain(*(jnp.asarray(x) for x in (q, k, v)))
    want_g = jax.grad(lambda q, k, v: jnp.sum(plain(q, k, v) * w), argnums=(0, 1, 2))(
        *(jnp.asarray(x) for x in (q, k, v)))
    args = [jax.device_put(x, NamedSharding(mesh, P(None, "data", "model", None))) for x in (q, k, v)]
    f = lambda q, k, v: htree_attention(q, k, v, config, backend=impl)
    np.testing.assert_allclose(np.asarray(jax.jit(f)(*args)), np.asarray(want), rtol=1e-5, atol=1e-5)
    # Interpreted, the default sums the key and value gradients by atomics; on a GPU from
    # partial sums, which each shard's backward takes here by name.
    for sums, asks in (("", None), (", partial sums", BlockKernels(sums="partials"))):
        g = lambda q, k, v, a=asks: jnp.sum(htree_attention(q, k, v, config, backend=impl, block_kernels=a) * w)
        grads = jax.jit(jax.grad(g, argnums=(0, 1, 2)))(*args)
        for a, b in zip(grads, want_g):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
        print(f"ok block selection kernels ({config.block_source}) tokens+heads{sums}: forward and gradients equal "
              "the unsharded kernels", flush=True)
    return 0


# The partitioning (`htree_jax.sharding`) is the same code for every backend: the
# reference runs every layout, the interpreted kernels (7 minutes for all six on two
# cores) the one that splits the tokens (context parallelism) and the heads.
KERNEL_LAYOUTS = ("tokens+heads",)


def main(backends) -> int:
    assert jax.device_count() == 8, jax.devices()
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, T, H, K)).astype(np.float32)
    k = rng.standard_normal((B, T, H_KV, K)).astype(np.float32)
    v = rng.standard_normal((B, T, H_KV, V)).astype(np.float32)
    w = rng.standard_normal((B, T, H, V)).astype(np.float32)
    # SPEC 10 across shards: a NaN key at position 50 (in the first half and the second
    # quarter of T) makes every later row of that kv head NaN, on the shards after it too.
    k[1, 50, 2, 3] = np.nan
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    layouts = {"batch": P("data", None, None, None), "heads": P(None, None, "model", None),
               "batch+heads": P("data", None, "model", None), "tokens": P(None, "model", None, None),
               "batch+tokens": P("data", "model", None, None), "tokens+heads": P(None, "data", "model", None)}
    for impl in backends:
        want_o, want_sel = attend(*(jnp.asarray(x) for x in (q, k, v)), CONFIG, impl)
        # (the batch and the heads split alone ran too until 2026-11-28 (3): "batch+heads"
        # splits both in the same partitioning code)

        def loss(q, k, v, impl=impl):
            return jnp.sum(htree_attention(q, k, v, CONFIG, backend=impl) * w)

        want_g = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v, CONFIG, impl)[0] * w), argnums=(0, 1, 2))(
            *(jnp.asarray(x) for x in (q, k, v)))
        for name, spec in layouts.items():
            if name in ("batch", "heads") or impl != "reference" and name not in KERNEL_LAYOUTS:
                continue
            sh = NamedSharding(mesh, spec)
            args = [jax.device_put(x, sh) for x in (q, k, v)]
            f = jax.jit(lambda q, k, v, impl=impl: htree_attention(q, k, v, CONFIG, backend=impl,
                                                                   return_selected=True))
            f = f.lower(*args).compile()  # the executable that runs is the one whose text is read
            o, sel = f(*args)
            np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), rtol=1e-5, atol=1e-5)
            G = H // H_KV
            dead = np.isnan(np.asarray(o)[1, :, 2 * G:3 * G])
            assert dead[50:].all() and not dead[:50].any() and not np.isnan(np.asarray(o)[0]).any(), name
            for a, b in zip(sel, want_sel):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert o.sharding.is_equivalent_to(sh, 4), (o.sharding, sh)
            text = f.as_text()
            g = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
            grads = g(*args)
            for a, b, x in zip(grads, want_g, args):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
                assert a.sharding.is_equivalent_to(x.sharding, 4), (name, a.sharding, x.sharding)
            g_text = g.as_text()
            if "tokens" in name:
                # Context parallelism gathers k and v (not q), and reduce-scatters dk, dv.
                gathered = [line for line in text.splitlines() if "all-gather(" in line]
                assert gathered and all(f"f32[{B // (2 if 'batch' in name else 1)},{T}," in line
                                        or "s32" in line for line in gathered), gathered
                assert "reduce-scatter" in g_text, f"{impl} {name}: no reduce-scatter of dk, dv"
                print(f"ok {impl} {name}: forward and gradients equal the unsharded run, k and v gathered, "
                      "dk and dv reduce-scattered", flush=True)
                continue
            assert "all-gather" not in text, f"{impl} {name}: the compiled forward gathers"
            assert "all-gather" not in g_text, f"{impl} {name}: the gradient gathers"
            print(f"ok {impl} {name}: forward and gradients equal the unsharded run, no all-gather", flush=True)
    decode_check(backends)
    packed_check([b for b in backends if b == "reference"])  # the partitioning splits the batch rows alone
    latent_values_check([b for b in backends if b == "reference"])
    # A mesh axis that splits a GQA group (8 head shards over 4 kv heads) is refused.
    mesh8 = jax.make_mesh((8,), ("model",), axis_types=(AxisType.Auto,))
    split = jax.device_put(q, NamedSharding(mesh8, P(None, None, "model", None)))
    by_t = NamedSharding(mesh8, P(None, "model", None, None))  # T = 150 over 8 shards
    constrained = jax.jit(lambda q, k, v: htree_attention(jax.lax.with_sharding_constraint(q, by_t), k, v, CONFIG,
                                                          backend="reference"))
    for what, call in (("split group", lambda: htree_attention(split, k, v, CONFIG, backend="reference")),
                       ("T indivisible", lambda: constrained(q[:, :150], k[:, :150], v[:, :150]))):
        try:
            call()
        except Exception as e:  # noqa: BLE001 - under jit XLA wraps the ValueError in a JaxRuntimeError
            assert "mesh axis 'model'" in str(e), e
            print(f"ok {what} refused: {str(e).splitlines()[-1] if 'Traceback' in str(e) else e}", flush=True)
        else:
            print(f"FAIL: {what} was not refused", flush=True)
            return 1
    try:  # under jit the partitioner refuses it, naming the axis
        jax.jit(lambda q, k, v: htree_attention(q, k, v, CONFIG, backend="reference"))(split, k, v)
    except Exception as e:  # noqa: BLE001 - XLA wraps it in a JaxRuntimeError
        # Under jit the partitioner refuses it before htree's own callback runs: JAX cannot
        # express the 8-way split of H = H_kv * G = 4 * 2 heads over the [.., H_kv, G, ..]
        # queries. The check asks for that refusal (or htree's own), not any error that
        # happens to say "model".
        text = str(e)
        own = "htree sharding: mesh axis 'model'" in text and "GQA group" in text
        # (jax 0.10 writes the mesh as OrderedDict([('model', 8)]), jax 0.12 as OrderedDict({'model': 8}))
        partitioner = ("IndivisibleError" in text and re.search(r"'model'\W+8\b", text) is not None
                       and f"dim_size={H_KV} is not divisible" in text)
        assert own or partitioner, e
        print("ok split group refused under jit", flush=True)
    else:
        print("FAIL: a split GQA group was not refused under jit", flush=True)
        return 1
    return 0


def gate_devices_check() -> int:
    """`tools/gpu_gate.py`'s two-device case (one call split along T over two devices
    against the same call on one) at a small size on the interpreted kernels, at the
    default: the case's code runs here before a GPU pair is lent (the sources differ only
    in the config; the block context checks above take both); its numerics are the GPUs'."""
    ok, out = gpu_gate.run_devices_case(np.random.default_rng(5), "first", "float32", 512,
                                        backend="pallas_interpret", G=2, H_kv=2, K=32)
    if not ok:
        print(f"FAIL gate two-device case (first): {out}", flush=True)
        return 1
    print(f"ok gate two-device case (first): agree {out['agree']:.4f}, o {out['o']:.1e}, grad {out['grad']:.1e}",
          flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["gate"]:
        raise SystemExit(gate_devices_check())
    if sys.argv[1:] == ["memory"]:
        raise SystemExit(memory_plans())
    if sys.argv[1:] == ["module"]:
        raise SystemExit(module_step())
    if sys.argv[1:] == ["blocks"]:
        raise SystemExit(block_selection_check())
    raise SystemExit(main(sys.argv[1:] or ["reference", "pallas_interpret"]))
