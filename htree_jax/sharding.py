"""htree under `jax.jit` with inputs sharded along the batch and the heads.

A Pallas call is a custom call that XLA's SPMD partitioner cannot split: handed sharded
operands it would gather them and compute the whole attention on every device. Here the
forward and the backward are each a `jax.experimental.custom_partitioning` function:
the partitioner asks them how to split, and they answer with the operands' own batch and
kv-head shardings and a *local* call per shard (any backend: the Pallas kernels, their
interpreted twins, the JAX reference). Queries enter as `[B, T, H_kv, G, K]` so that a
head sharding is a kv-head sharding with each GQA group whole (Shardy's rule names the
kv-head factor once for q, k, v and the outputs); a sharding of the group axis (a mesh
axis that splits a group), of `T` or of the feature axes is refused with an error naming
the mesh axis. The gradients are wired with `jax.custom_vjp` around the two
partitioned calls, so each device differentiates its own shard.

Used by `htree_attention` when there is more than one device (on one device there is
nothing to split), and callable directly (`partitioned_attention`) on any mesh,
one device included. Meshes with `AxisType.Auto` axes (what `jax.jit` with
`in_shardings` uses); for `Explicit` axes pass the arrays through `jax.sharding.reshard`
to Auto first or use `jax.shard_map` around `htree_attention`.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def _axes(spec, ndim):
    return tuple(spec) + (None,) * (ndim - len(spec))


def _mesh_axes(entry):
    return () if entry is None else (entry if isinstance(entry, tuple) else (entry,))


def local_specs(q_sharding, ndim: int = 5):
    """`(batch, kv_heads)` mesh-axis entries of a `[B, T, H_kv, G, K]` query sharding;
    any other axis sharded is an error naming the mesh axis."""
    spec = _axes(getattr(q_sharding, "spec", P()), ndim)
    names = ("T (context parallelism is not built yet)", "", "the GQA group (H / H_kv heads of one kv head)",
             "the head dim K")
    for axis, why in zip((1, 3, 4), (names[0], names[2], names[3])):
        if spec[axis] is not None:
            raise ValueError(f"htree sharding: mesh axis {spec[axis]!r} shards {why}; htree shards the batch and "
                             "the kv heads (whole GQA groups) only")
    return spec[0], spec[2]


def _shardings(mesh, b, g, num_selections: int):
    """Operand and result shardings: q5/o5 `[B, T, H_kv, G, *]`, k/v `[B, T, H_kv, *]`,
    selections `[B, T, H_kv, top_k]`."""
    q5 = NamedSharding(mesh, P(b, None, g, None, None))
    kv = NamedSharding(mesh, P(b, None, g, None))
    return q5, kv, kv


def _check_mesh_fits(mesh, b, g, B: int, H_kv: int):
    for entry, size, what in ((b, B, "B"), (g, H_kv, "H_kv")):
        n = 1
        for a in _mesh_axes(entry):
            n *= mesh.shape[a]
        if size % n:
            raise ValueError(f"htree sharding: {what} = {size} is not divisible by the {n} shards of mesh axis {entry!r}")


# Shardy rules: b batch, t tokens, g kv heads, r heads of a group, k / v features,
# s selection slots. Only b and g are ever sharded (the callbacks refuse the rest).
def _forward_rule(num_selections: int):
    return "b t g r k, b t g k, b t g v -> " + ", ".join(["b t g r v"] + ["b t g s"] * num_selections)


def _backward_rule():
    return "b t g r k, b t g k, b t g v, b t g r v -> b t g r k, b t g k, b t g v"


@functools.lru_cache(maxsize=None)
def _partitioned_calls(config, impl: str, num_selections: int):
    """`(forward, backward)`: custom-partitioned local calls for `config` and `impl`."""
    from htree_jax.attention import _attend

    def forward(q5, k, v):
        B, T, H_kv, G, K = q5.shape
        o, selected = _attend(q5.reshape(B, T, H_kv * G, K), k, v, config, impl)
        return (o.reshape(B, T, H_kv, G, -1), *selected)

    def backward(q5, k, v, do5):
        # The local forward again, differentiated (the Pallas path by its own backward).
        def o_of(q5, k, v):
            return forward(q5, k, v)[0]
        _, vjp = jax.vjp(o_of, q5, k, v)
        return vjp(do5)

    fwd, bwd = custom_partitioning(forward), custom_partitioning(backward)

    def infer_fwd(mesh, arg_shapes, result_shape):
        b, g = local_specs(arg_shapes[0].sharding)
        q5, kv, _ = _shardings(mesh, b, g, num_selections)
        return (q5,) + (kv,) * num_selections

    def partition_fwd(mesh, arg_shapes, result_shape):
        b, g = local_specs(arg_shapes[0].sharding)
        _check_mesh_fits(mesh, b, g, arg_shapes[0].shape[0], arg_shapes[0].shape[2])
        q5, kv, _ = _shardings(mesh, b, g, num_selections)
        return mesh, forward, (q5,) + (kv,) * num_selections, (q5, kv, kv)

    def infer_bwd(mesh, arg_shapes, result_shape):
        b, g = local_specs(arg_shapes[0].sharding)
        q5, kv, _ = _shardings(mesh, b, g, num_selections)
        return q5, kv, kv

    def partition_bwd(mesh, arg_shapes, result_shape):
        b, g = local_specs(arg_shapes[0].sharding)
        q5, kv, _ = _shardings(mesh, b, g, num_selections)
        return mesh, backward, (q5, kv, kv), (q5, kv, kv, q5)

    fwd.def_partition(partition=partition_fwd, infer_sharding_from_operands=infer_fwd,
                      sharding_rule=_forward_rule(num_selections))
    bwd.def_partition(partition=partition_bwd, infer_sharding_from_operands=infer_bwd,
                      sharding_rule=_backward_rule())
    return fwd, bwd


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attend_partitioned(q5, k, v, config, impl):
    return _attend_partitioned_fwd(q5, k, v, config, impl)[0]


def _attend_partitioned_fwd(q5, k, v, config, impl):
    fwd, _ = _partitioned_calls(config, impl, config.num_layers(q5.shape[1]) - 1)
    o5, *selected = fwd(q5, k, v)
    return (o5, selected), (q5, k, v)


def _attend_partitioned_bwd(config, impl, residuals, cotangents):
    q5, k, v = residuals
    _, bwd = _partitioned_calls(config, impl, config.num_layers(q5.shape[1]) - 1)
    return tuple(bwd(q5, k, v, cotangents[0]))


_attend_partitioned.defvjp(_attend_partitioned_fwd, _attend_partitioned_bwd)


def check_input_shardings(q, k, v) -> None:
    """Concrete (eager) inputs with a `NamedSharding`: `T` and the feature axes unsharded,
    the heads split into whole GQA groups; errors name the mesh axis. (Under `jit` the
    shardings are known only to the partitioner, whose errors name it too.)"""
    H_kv = k.shape[2]
    for name, x in (("q", q), ("k", k), ("v", v)):
        sharding = getattr(x, "sharding", None)
        if isinstance(x, jax.core.Tracer) or not isinstance(sharding, NamedSharding):
            continue
        spec = _axes(sharding.spec, 4)
        for axis, what in ((1, "T (context parallelism is not built yet)"), (3, "the head dim")):
            if spec[axis] is not None:
                raise ValueError(f"htree sharding: mesh axis {spec[axis]!r} shards {what} of {name}; htree shards "
                                 "the batch and the kv heads (whole GQA groups) only")
        shards = 1
        for a in _mesh_axes(spec[2]):
            shards *= sharding.mesh.shape[a]
        if H_kv % shards:
            raise ValueError(f"htree sharding: mesh axis {spec[2]!r} splits the heads of {name} {shards} ways, which "
                             f"splits a GQA group: H_kv = {H_kv} kv heads must be divisible by it")


def partitioned_attention(q, k, v, config, impl: str):
    """`(o [B, T, H, V], selections)` of validated inputs through the custom-partitioned
    calls: under `jit` with batch- or head-sharded inputs, one local call per shard."""
    check_input_shardings(q, k, v)
    B, T, H, K = q.shape
    H_kv = k.shape[2]
    o5, selected = _attend_partitioned(q.reshape(B, T, H_kv, H // H_kv, K), k, v, config, impl)
    return o5.reshape(B, T, H, -1), list(selected)
