"""The route table (`htree_jax.routes.ROUTES`) and the one rule that picks a row
(`htree_jax.backends.choose_route`): every shape class the API accepts maps to the route
written beside it here, every row is reached, the classes no kernel route takes are
refused naming the rule, and the kernels a route runs, forward and backward, are the
pair its row names."""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import pytest

from htree_jax import HTreeConfig, backends, htree_attention
from htree_jax.backends import CallKind, attend, choose_route, ranking_route
from htree_jax.core.validation import Dims
from htree_jax.routes import KERNEL_ROUTES, ROUTES
from pallas_kernels.block import backward as block_backward
from pallas_kernels.block import forward as block_forward
from pallas_kernels.block.forward import MERGES
from pallas_kernels.shared.configs import KernelConfigs
from pallas_kernels.shared.kernels import MERGE_ROUTES, BlockKernels

try:
    from jax.extend.core import jaxprs_in_params
except ImportError:  # jax < 0.11
    from jax.core import jaxprs_in_params

BF16, F32 = jnp.bfloat16, jnp.float32
PER_QUERY = HTreeConfig(top_k=64, selection_block=1)  # T=131072: 3 layers; T=1024: one (exact attention)
BLOCK = HTreeConfig(top_k=64, selection_block=16)
PREVIOUS = HTreeConfig(top_k=64, selection_block=16, block_source="previous")


def dims(T=131072, H=32, H_kv=4, K=128, V=128, B=1):
    return Dims(B, T, H, H_kv, K, V)


def tuned(K=128, V=128, **changes):
    return KernelConfigs.resolve(None, K, V).with_changes(changes)


# (class, impl, dims, config, dtype, options, route): every shape class the API takes.
CLASSES = [
    ("reference", "reference", dims(), PER_QUERY, BF16, {}, "reference"),
    ("reference, packed", "reference", dims(), PER_QUERY, BF16, dict(packed=True), "reference_packed"),
    ("reference, block selection", "reference", dims(), BLOCK, BF16, {}, "reference"),
    ("reference, block selection packed", "reference", dims(), BLOCK, BF16, dict(packed=True), "reference_packed"),
    ("GQA G=8", "pallas", dims(), PER_QUERY, BF16, {}, "gqa"),
    ("GQA G=1 f32", "pallas", dims(H=4), PER_QUERY, F32, {}, "gqa"),
    ("GQA G=16 K=V=256", "pallas", dims(H=64, K=256, V=256), PER_QUERY, BF16, {}, "gqa"),
    ("GQA packed", "pallas", dims(), PER_QUERY, BF16, dict(packed=True), "gqa"),
    ("GQA context shard", "pallas", dims(), PER_QUERY, BF16, dict(context_shard=True), "gqa"),
    ("G=64 as virtual kv heads of 16 (wide_rows=0)", "pallas", dims(H=256), PER_QUERY, BF16,
     dict(tuning=tuned(**{"wide.rows": 0})), "gqa"),
    ("G=64 packed: virtual kv heads", "pallas", dims(H=256), PER_QUERY, BF16, dict(packed=True), "gqa"),
    ("interpreted", "pallas_interpret", dims(), PER_QUERY, F32, {}, "gqa"),
    ("wide G=32", "pallas", dims(H=128), PER_QUERY, BF16, {}, "wide"),
    ("latent G=128 K=576 V=512 from the keys", "pallas", dims(H=128, H_kv=1, K=576, V=512),
     HTreeConfig(top_k=64, rope_dim=64), BF16, dict(latent=True), "wide"),
    ("latent G=16 K=576 (past 256 features)", "pallas", dims(H=16, H_kv=1, K=576, V=512),
     HTreeConfig(top_k=64, rope_dim=64), BF16, dict(latent=True), "wide"),
    ("latent G=8: the values copied out", "pallas", dims(H=8, H_kv=1, K=192, V=128),
     HTreeConfig(top_k=64, rope_dim=64), BF16, dict(latent=True), "gqa"),
    ("one layer, bf16: cuDNN", "pallas", dims(T=1024), PER_QUERY, BF16, {}, "dense"),
    ("one layer, f32", "pallas", dims(T=1024), PER_QUERY, F32, {}, "gqa"),
    ("one layer, K=V=192: past cuDNN's 128", "pallas", dims(T=1024, K=192, V=192), PER_QUERY, BF16, {}, "gqa"),
    ("one layer, K=V=120 (a multiple of 8 to 128): cuDNN", "pallas", dims(T=1024, K=120, V=120), PER_QUERY, BF16,
     {}, "dense"),
    ("one layer, K=V=100 (not a multiple of 8)", "pallas", dims(T=1024, K=100, V=100), PER_QUERY, BF16, {}, "gqa"),
    ("one layer, K != V", "pallas", dims(T=1024, V=64), PER_QUERY, BF16, {}, "gqa"),
    ("one layer, interpreted", "pallas_interpret", dims(T=1024), PER_QUERY, BF16, {}, "gqa"),
    ("one layer, packed", "pallas", dims(T=1024), PER_QUERY, BF16, dict(packed=True), "gqa"),
    ("one layer, context shard", "pallas", dims(T=1024), PER_QUERY, BF16, dict(context_shard=True), "gqa"),
    ("one layer, latent", "pallas", dims(T=1024, H=128, H_kv=1, K=576, V=512), HTreeConfig(top_k=64, rope_dim=64),
     BF16, dict(latent=True), "wide"),
    ("one layer, block selection: exact attention", "pallas", dims(T=1024), BLOCK, BF16, {}, "dense"),
    ("block selection, first", "pallas", dims(), BLOCK, BF16, {}, "block_pallas_triton"),
    ("block selection, previous", "pallas", dims(), PREVIOUS, BF16, {}, "block_pallas_triton"),
    ("block selection f32 K=V=256", "pallas", dims(K=256, V=256), BLOCK, F32, {}, "block_pallas_triton"),
    ("block selection, interpreted", "pallas_interpret", dims(), BLOCK, F32, {}, "block_pallas_triton"),
    ("block selection, packed", "pallas", dims(), BLOCK, BF16, dict(packed=True), "block_pallas_triton"),
    ("block selection, context shard", "pallas", dims(), BLOCK, BF16, dict(context_shard=True), "block_pallas_triton"),
    ("block selection, the Mosaic GPU merge", "pallas", dims(), BLOCK, BF16,
     dict(kernels=BlockKernels(merge="mosaic_gpu")), "block_mosaic_gpu"),
]

# `BlockKernels.merge="auto"` (the default) on a Hopper GPU: Mosaic GPU where it takes the shape.
ON_HOPPER = [
    ("bf16", dims(), BLOCK, BF16, "pallas", "block_mosaic_gpu"),
    ("f16, previous", dims(), PREVIOUS, jnp.float16, "pallas", "block_mosaic_gpu"),
    ("K=V=64", dims(K=64, V=64), BLOCK, BF16, "pallas", "block_mosaic_gpu"),
    ("f32: no WGMMA form of its exact dots", dims(), BLOCK, F32, "pallas", "block_pallas_triton"),
    ("K=V=256: past shared memory", dims(K=256, V=256), BLOCK, BF16, "pallas", "block_pallas_triton"),
    ("interpreted", dims(), BLOCK, BF16, "pallas_interpret", "block_pallas_triton"),
]


@pytest.mark.parametrize("what, d, config, dtype, impl, route", ON_HOPPER, ids=[c[0] for c in ON_HOPPER])
def test_the_default_merge_is_mosaic_gpu_on_hopper_where_it_takes_the_shape(monkeypatch, what, d, config, dtype,
                                                                           impl, route):
    monkeypatch.setattr(block_forward, "on_hopper", lambda: True)
    assert BlockKernels().merge == "auto"
    tuning = tuned(d.head_dim, d.value_dim)
    assert choose_route(impl, dims=d, config=config, dtype=dtype, tuning=tuning) == route


def test_packed_rows_take_the_mosaic_gpu_merge_on_hopper_too(monkeypatch):
    monkeypatch.setattr(block_forward, "on_hopper", lambda: True)
    assert choose_route("pallas", dims=dims(), config=BLOCK, dtype=BF16, tuning=tuned(128, 128),
                        kind=CallKind(packed=True)) == "block_mosaic_gpu"


def test_the_default_merge_off_hopper_is_pallas_triton():
    assert not block_forward.on_hopper()  # CI: a CPU
    assert choose_route("pallas", dims=dims(), config=BLOCK, dtype=BF16, tuning=tuned(128, 128)) == "block_pallas_triton"


@pytest.mark.parametrize("what, impl, d, config, dtype, options, route", CLASSES, ids=[c[0] for c in CLASSES])
def test_each_shape_class_takes_its_route(what, impl, d, config, dtype, options, route):
    options = dict(options)
    tuning = options.pop("tuning", tuned(d.head_dim, d.value_dim))
    kernels = options.pop("kernels", BlockKernels())
    assert choose_route(impl, dims=d, config=config, dtype=dtype, tuning=tuning, kernels=kernels,
                        kind=CallKind(**options)) == route


def test_every_route_is_reached_and_every_merge_is_a_route():
    assert {c[-1] for c in CLASSES} == set(ROUTES)
    assert tuple(MERGES) == MERGE_ROUTES
    assert {f"block_{m}" for m in MERGES} <= set(KERNEL_ROUTES)
    assert set(KERNEL_ROUTES) == {"gqa", "wide"} | {f"block_{m}" for m in MERGES}


REFUSED = [
    ("K below the kernels' 32", dims(K=16, V=16), PER_QUERY, {}, "head dim K in \\[32, 576\\]"),
    ("V past 512", dims(V=640), PER_QUERY, {}, "value dim V in \\[32, 512\\]"),
    ("G=24", dims(H=96), PER_QUERY, {}, "at most 16 query heads per kv head, or a multiple of 16"),
    ("block selection K=512", dims(K=512, V=512), BLOCK, {}, "K and V up to 256"),
    ("block previous G=16: 256 ranking rows", dims(H=64), PREVIOUS, {}, "at most 128 on the kernels"),
]


@pytest.mark.parametrize("what, d, config, options, match", REFUSED, ids=[c[0] for c in REFUSED])
def test_no_kernel_route_is_an_error_naming_the_rule(what, d, config, options, match):
    with pytest.raises(ValueError, match=match):
        choose_route("pallas", dims=d, config=config, dtype=BF16, tuning=tuned(d.head_dim, d.value_dim), **options)


def test_block_selection_ranks_on_a_per_query_route():
    assert ranking_route("pallas", dims=dims(), config=BLOCK, dtype=BF16, tuning=tuned()) == "gqa"
    # "previous": 16 * G = 128 rows a kv head, the wide family's group
    assert ranking_route("pallas", dims=dims(), config=PREVIOUS, dtype=BF16, tuning=tuned()) == "wide"


def _kernel_names(jaxpr) -> list[str]:
    """The kernel function of every `pallas_call` under `jaxpr`, sub-jaxprs included."""
    names = []

    def visit(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "pallas_call":
                info = eqn.params.get("name_and_src_info") or eqn.params["jaxpr"].debug_info
                names.append(getattr(info, "name", None) or info.func_name)
                continue
            for sub in jaxprs_in_params(eqn.params):
                visit(sub)

    visit(jaxpr.jaxpr)
    return names


# Small shapes each kernel route traces at (T=150, r=4, top_k=4: 3 layers).
PAIR_CASES = {
    "gqa": (8, 2, 32, 32, HTreeConfig(compression_rate=4, top_k=4, selection_block=1), F32),
    "wide": (64, 1, 64, 64, HTreeConfig(compression_rate=4, top_k=4, selection_block=1), F32),
    "block_pallas_triton": (8, 2, 32, 32, HTreeConfig(compression_rate=4, top_k=4, selection_block=4), F32),
}


@pytest.mark.parametrize("name", sorted(PAIR_CASES))
def test_a_route_runs_the_forward_and_backward_of_its_row(name):
    """The kernels `attend` runs on this route are its row's `forward`'s (for block
    selection with its ranking route's forward), and its gradient's are the row's
    `backward`'s and (what the backward needs of it) the forward's: each pass traced
    alone at the same shapes. So the `custom_vjp` pairs the row's two passes."""
    H, H_kv, K, V, config, dtype = PAIR_CASES[name]
    T = 150
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
    q, k, v, do = spec(1, T, H, K), spec(1, T, H_kv, K), spec(1, T, H_kv, V), spec(1, T, H, V)
    d = Dims(1, T, H, H_kv, K, V)
    tuning = tuned(K, V)
    assert choose_route("pallas", dims=d, config=config, dtype=dtype, tuning=tuning) == name
    route = ROUTES[name]
    forward_of = lambda q, k, v: attend(q, k, v, config, "pallas")[0]
    got_forward = set(_kernel_names(jax.make_jaxpr(forward_of)(q, k, v)))
    loss = lambda q, k, v: jnp.sum(forward_of(q, k, v))
    got_gradient = set(_kernel_names(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)))

    if name.startswith("block_"):
        ranking = ROUTES[ranking_route("pallas", dims=d, config=config, dtype=dtype, tuning=tuning)]
        rows = spec(1, -(-T // config.selection_block), H, K)
        per_query = dataclasses.replace(config, selection_block=1)
        select = jax.make_jaxpr(lambda q, k, v: ranking.forward(q, k, v, config=per_query, block_sizes=tuning,
                                                                positions=jnp.zeros(q.shape[1], jnp.int32),
                                                                selections_only=True))
        blocks = [jax.ShapeDtypeStruct((1, rows.shape[1], H_kv, config.top_k), jnp.int32)
                  for _ in range(config.num_layers(T) - 1)]
        forward = jax.make_jaxpr(lambda q, k, v, s: route.forward(q, k, v, s, config=config, block=tuning.block))
        backward = jax.make_jaxpr(lambda q, k, v, s: route.backward(q, k, v, q[..., :V], q[..., 0], q[..., :V], s,
                                                                    config=config, block=tuning.block))
        want_forward = set(_kernel_names(select(rows, k, v))) | set(_kernel_names(forward(q, k, v, blocks)))
        want_backward = set(_kernel_names(backward(q, k, v, blocks)))
    else:
        forward = jax.make_jaxpr(lambda q, k, v: route.forward(q, k, v, config=config, block_sizes=tuning,
                                                               return_lse=True))
        backward = jax.make_jaxpr(lambda q, k, v, do: route.backward(q, k, v, do, do[..., 0], do, config=config,
                                                                     block_sizes=tuning))
        want_forward = set(_kernel_names(forward(q, k, v)))
        want_backward = set(_kernel_names(backward(q, k, v, do)))
    assert got_forward == want_forward, (got_forward ^ want_forward)
    assert want_backward <= got_gradient <= want_forward | want_backward, (want_backward - got_gradient)
    assert want_backward - want_forward, "the backward runs kernels of its own"
    assert route.backward is not None and name in KERNEL_ROUTES


def test_the_xla_routes_have_no_backward_of_their_own():
    for name in ("reference", "reference_packed", "dense"):
        assert ROUTES[name].backward is None and name not in KERNEL_ROUTES


COUNTED = ("plan_call", "choose_route", "choose_backend", "check_route")


def counted_planning(monkeypatch) -> collections.Counter:
    """A counter of the planning functions of `htree_jax.backends` (`COUNTED`) called
    from here on."""
    counts = collections.Counter()
    for name in COUNTED:
        def counted(*args, _name=name, _function=getattr(backends, name), **kwargs):
            counts[_name] += 1
            return _function(*args, **kwargs)
        monkeypatch.setattr(backends, name, counted)
    return counts


@pytest.mark.parametrize("config, H, routes", [
    (HTreeConfig(compression_rate=4, top_k=4, selection_block=4), 8, 2),  # block selection: the ranking route too
    (HTreeConfig(compression_rate=4, top_k=4, selection_block=1), 8, 1),
])
def test_the_plan_is_made_once_a_call(monkeypatch, config, H, routes):
    """`htree_attention` decides what runs once (`backends.plan_call`) and passes the
    plan down: under `jax.grad`, one plan, one backend chosen, the route chosen once (and
    block selection's ranking route once), checked once. (Before the plan, a block call
    chose its route four times.)"""
    q = jax.ShapeDtypeStruct((1, 150, H, 32), jnp.float32)
    k = jax.ShapeDtypeStruct((1, 150, 2, 32), jnp.float32)
    loss = lambda q, k, v: htree_attention(q, k, v, config, backend="pallas_interpret").sum()
    counts = counted_planning(monkeypatch)
    jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, k, k)
    assert counts == {"plan_call": 1, "choose_backend": 1, "choose_route": routes, "check_route": 1}, counts


# Block selection's choices the plan makes (`backends.resolve_block_kernels`): (what, on a Hopper
# GPU, impl, dims, dtype, merge, backward walk, backward sum).
PLANNED = [
    ("interpreted", False, "pallas_interpret", dims(), BF16, "pallas_triton", "pallas_triton", "atomics"),
    ("a GPU not Hopper", False, "pallas", dims(), BF16, "pallas_triton", "pallas_triton", "partials"),
    ("Hopper, bf16", True, "pallas", dims(), BF16, "mosaic_gpu", "mosaic_gpu", "partials"),
    ("Hopper, f32", True, "pallas", dims(), F32, "pallas_triton", "pallas_triton", "partials"),
]


@pytest.mark.parametrize("what, on_hopper, impl, d, dtype, merge, walk, sums", PLANNED, ids=[c[0] for c in PLANNED])
def test_the_plan_makes_block_selections_choices(monkeypatch, what, on_hopper, impl, d, dtype, merge, walk, sums):
    """The plan leaves no `"auto"` for the block kernels to resolve: its `kernels` names
    the merge, and the backward's walk and sum, as `block.backward.backward_kernels`
    chooses them over the call's layout (packed rows: their packing's); the configs
    hold no such choice."""
    monkeypatch.setattr(block_forward, "on_hopper", lambda: on_hopper)
    monkeypatch.setattr(block_backward, "on_hopper", lambda: on_hopper)
    tuning = tuned(d.head_dim, d.value_dim)
    plan = backends.plan_call(impl, dims=d, config=BLOCK, dtype=dtype, tuning=tuning, check_limits=False)
    chosen = plan.kernels
    assert (chosen.merge, chosen.walk, chosen.sums, chosen.sum_kernel) == (merge, walk, sums, "pallas_triton")
    assert plan.tuning == tuning
    assert plan.route == "block_" + merge
