"""htree under `jax.jit` with inputs sharded along the batch, the heads and the tokens.

A Pallas call is a custom call that XLA's SPMD partitioner cannot split: handed sharded
operands it would gather them and compute the whole attention on every device. Here the
forward and the backward are each a `jax.experimental.custom_partitioning` function:
the partitioner asks them how to split, and they answer with the operands' own batch and
kv-head shardings and a *local* call per shard (any backend: the Pallas kernels, their
interpreted twins, the JAX reference). Queries enter as `[B, T, H_kv, G, K]` so that a
head sharding is a kv-head sharding with each GQA group whole (Shardy's rule names the
kv-head factor once for q, k, v and the outputs); a sharding of the group axis (a mesh
axis that splits a group) or of the feature axes is refused with an error naming the
mesh axis. The gradients are wired with `jax.custom_vjp` around the two partitioned
calls, so each device differentiates its own shard.

Context parallelism (`T` sharded): each device keeps its `T / n` queries, all-gathers
`k` and `v` (with GQA `G` times smaller than `q`), builds the whole tree and attends its
queries at their positions; the backward reduce-scatters `dk`, `dv` (each device's share
of every token's gradient) back to `T / n` tokens. Per-device memory (XLA's compiled
plan of one shard's call, `benchmarks/memory_plan.py --devices n`; figures in
benchmarks/RESULTS.md): the shard's own queries, output, cotangent, dq and selections
are `T / n`-sized; per token, for the whole sequence on every device, the bottom
layer's keys in their `span / r` rotated copies (`rope.rotate_phases`) and the
backward's float32 dk, dv accumulators. The backward allocates those accumulators and
dq's chunks only after the forward (`pallas_kernels.shared.common.zeros_after`), so the
forward's peak does not hold them. The causal work per shard grows
with its position only until the candidate buffers fill, so the split is left even (the
slowest shard's time against the mean's: journal, 2026-11-23 (session 3), context parallelism).

Decoding (`prefill`, `decode_step`): the walk over a cache sharded along the batch
and/or the kv heads is custom-partitioned the same way (`partitioned_cache_attention`);
the tree update is plain XLA, which the partitioner splits by itself.

Used by `htree_attention` when there is more than one device (on one device there is
nothing to split; packed rows shard along the batch and the kv heads), and callable
directly (`partitioned_attention`) on any mesh, one device included. Meshes with `AxisType.Auto` axes (what `jax.jit` with
`in_shardings` uses); for `Explicit` axes pass the arrays through `jax.sharding.reshard`
to Auto first or use `jax.shard_map` around `htree_attention`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from htree_jax.backends import WHOLE_SEQUENCES, takes_context_shards
from htree_jax.backends import attend as attend_locally
from htree_jax.backends import attend_cache
from htree_jax.core.blocks import block_rows, recent_queries
from htree_jax.core.packing import pack_layout
from htree_jax.core.tree import CacheTree


def _axes(spec, ndim):
    return tuple(spec) + (None,) * (ndim - len(spec))


def _mesh_axes(entry):
    return () if entry is None else (entry if isinstance(entry, tuple) else (entry,))


def local_specs(q_sharding, ndim: int = 5):
    """`(batch, tokens, kv_heads)` mesh-axis entries of a `[B, T, H_kv, G, K]` query
    sharding; a sharded group or feature axis is an error naming the mesh axis."""
    spec = _axes(getattr(q_sharding, "spec", P()), ndim)
    for axis, what in ((3, "the GQA group (H / H_kv heads of one kv head)"), (4, "the head dim K")):
        if spec[axis] is not None:
            raise ValueError(f"htree sharding: mesh axis {spec[axis]!r} shards {what}; htree shards the batch, "
                             "the tokens and the kv heads (whole GQA groups) only")
    return spec[0], spec[1], spec[2]


def _shardings(mesh, b, t, g):
    """Operand and result shardings: q5/o5 `[B, T, H_kv, G, *]`, k/v and the selections
    `[B, T, H_kv, *]`."""
    return NamedSharding(mesh, P(b, t, g, None, None)), NamedSharding(mesh, P(b, t, g, None))


def _shards(mesh, entry) -> int:
    n = 1
    for a in _mesh_axes(entry):
        n *= mesh.shape[a]
    return n


def _check_mesh_fits(mesh, b, t, g, B: int, T: int, H_kv: int):
    for entry, size, what in ((b, B, "B"), (t, T, "T"), (g, H_kv, "H_kv")):
        if size % _shards(mesh, entry):
            raise ValueError(f"htree sharding: {what} = {size} is not divisible by the {_shards(mesh, entry)} shards "
                             f"of mesh axis {entry!r}")


# Shardy rules: b batch, t tokens, g kv heads, r heads of a group, k / v features,
# s selection slots. b, t and g may be sharded (the callbacks refuse the rest).
def _forward_rule(num_selections: int, packed: bool):
    operands = "b t g r k, b t g k, b t g v" + (", b t" if packed else "")
    return operands + " -> " + ", ".join(["b t g r v"] + ["b t g s"] * num_selections)


def _backward_rule(packed: bool):
    return "b t g r k, b t g k, b t g v" + (", b t" if packed else "") + ", b t g r v -> b t g r k, b t g k, b t g v"


def context_backend(impl: str, config, t, context_impl: str | None, shard_len: int) -> str:
    """The backend of a local call whose tokens are split along mesh axis `t` (None: not
    split) into shards of `shard_len`: `impl`, unless it names block selection's kernels
    and the shards hold part of a block (`backends.WHOLE_SEQUENCES`): then `context_impl`
    (what `backend="auto"` asks: the reference), or a ValueError naming the axis."""
    if t is None or takes_context_shards(impl, config, shard_len):
        return impl
    if context_impl is None:
        raise ValueError(f"htree sharding: mesh axis {t!r} shards T (context parallelism) of a block-selection call "
                         f"on backend {impl!r}; {WHOLE_SEQUENCES}")
    return context_impl


@functools.lru_cache(maxsize=None)
def _partitioned_calls(config, impl: str, num_selections: int, packed=None, kernels=(None, None),
                       context_impl: str | None = None):
    """`(forward, backward)`: custom-partitioned local calls for `config` and `impl`.

    `packed`: `(virtual_len, max_document_len)` for packed rows (`segment_ids [B, T]`
    the last operand, split with the batch; each shard lays out its own rows), or None.

    Context parallelism (`T` sharded over mesh axis `t`): each device keeps its queries,
    all-gathers `k`, `v` along `t` (the tree is built from every token), attends its
    queries at their own positions (`axis_index(t) * S + s`), and in the backward
    reduce-scatters its share of `dk`, `dv` back along `t` (`psum_scatter`).
    `kernels`: `(block_sizes, block_kernels)`, the Pallas kernels' tiling and block
    selection's asks (`backends.attend`); `context_impl`: as `context_backend`."""
    block_sizes, block_kernels = kernels

    def attend(t, q5, k, v, positions=None, rank_rows=None, segment_ids=None):
        B, S, H_kv, G, K = q5.shape
        packing = None if segment_ids is None else pack_layout(segment_ids, config, packed[0], packed[1])
        local = context_backend(impl, config, t, context_impl, S)
        o, selected = attend_locally(q5.reshape(B, S, H_kv * G, K), k, v, config, local, packing, positions,
                                     block_sizes=block_sizes, rank_rows=rank_rows, block_kernels=block_kernels)
        return (o.reshape(B, S, H_kv, G, -1), *selected)

    def gathered(q5, k, v, t):
        """`(k, v, positions, rank_rows)` of a shard: every token's keys and values, its
        queries' positions and (block selection) their ranking rows."""
        if t is None:
            return k, v, None, None
        S = q5.shape[1]
        positions = (jax.lax.axis_index(t) * S + jnp.arange(S)).astype(jnp.int32)
        k, v = (jax.lax.all_gather(x, t, axis=1, tiled=True) for x in (k, v))
        return k, v, positions, shard_rank_rows(q5, positions, t, config)

    def local_forward(t):
        def forward(q5, k, v, *segment_ids):
            return attend(t, q5, *gathered(q5, k, v, t), *segment_ids)
        return forward

    def local_backward(t):
        def backward(q5, k, v, *rest):
            # The local forward again, differentiated (the Pallas path by its own backward).
            # Jitted whole: constants it makes stay inside (custom_partitioning takes none).
            return jax.jit(functools.partial(differentiate, t))(q5, k, v, *rest)
        return backward

    def differentiate(t, q5, k, v, *rest):
        *segment_ids, do5 = rest
        k_all, v_all, positions, rank_rows = gathered(q5, k, v, t)
        _, vjp = jax.vjp(lambda q5, k, v: attend(t, q5, k, v, positions, rank_rows, *segment_ids)[0], q5, k_all,
                         v_all)
        dq, dk, dv = vjp(do5)
        if t is not None:  # each shard's share of every token's gradient, summed and split back
            dk, dv = (jax.lax.psum_scatter(x, t, scatter_dimension=1, tiled=True) for x in (dk, dv))
        return dq, dk, dv

    fwd, bwd = custom_partitioning(local_forward(None)), custom_partitioning(local_backward(None))

    def infer_fwd(mesh, arg_shapes, result_shape):
        q5, kv = _shardings(mesh, *local_specs(arg_shapes[0].sharding))
        return (q5,) + (kv,) * num_selections

    def rows_of(mesh, b, t):
        """The segment ids' sharding (packed rows: the batch only)."""
        if t is not None:
            raise ValueError(f"htree sharding: mesh axis {t!r} shards T of packed rows (segment_ids); packed "
                             "documents shard along the batch and the kv heads only")
        return (NamedSharding(mesh, P(b, None)),) if packed else ()

    def partition_fwd(mesh, arg_shapes, result_shape):
        b, t, g = local_specs(arg_shapes[0].sharding)
        B, T, H_kv = arg_shapes[0].shape[:3]
        _check_mesh_fits(mesh, b, t, g, B, T, H_kv)
        _check_shard_blocks(mesh, t, T, config)
        context_backend(impl, config, t, context_impl, T // _shards(mesh, t) if t else T)  # refused here
        q5, kv = _shardings(mesh, b, t, g)
        seg = rows_of(mesh, b, t) if packed else ()
        return mesh, local_forward(t), (q5,) + (kv,) * num_selections, (q5, kv, kv) + seg

    def infer_bwd(mesh, arg_shapes, result_shape):
        q5, kv = _shardings(mesh, *local_specs(arg_shapes[0].sharding))
        return q5, kv, kv

    def partition_bwd(mesh, arg_shapes, result_shape):
        b, t, g = local_specs(arg_shapes[0].sharding)
        q5, kv = _shardings(mesh, b, t, g)
        seg = rows_of(mesh, b, t) if packed else ()
        return mesh, local_backward(t), (q5, kv, kv), (q5, kv, kv) + seg + (q5,)

    fwd.def_partition(partition=partition_fwd, infer_sharding_from_operands=infer_fwd,
                      sharding_rule=_forward_rule(num_selections, packed is not None))
    bwd.def_partition(partition=partition_bwd, infer_sharding_from_operands=infer_bwd,
                      sharding_rule=_backward_rule(packed is not None))
    return fwd, bwd


def shard_rank_rows(q5, positions, t, config):
    """Block selection (SPEC 12) in a context shard: the ranking rows `[B, S, H_kv, R, K]`
    of its queries `q5 [B, S, H_kv, G, K]` at `positions [S]`, whose blocks may begin in
    the shard before (the last `recent_queries` rows of each shard are all-gathered
    along mesh axis `t`); None without block selection."""
    P = recent_queries(config)
    if not P:
        return None
    B, S = q5.shape[:2]
    tails = jax.lax.all_gather(q5[:, S - P:], t, axis=1)  # [B, shards, P, H_kv, G, K]
    before = jax.lax.dynamic_index_in_dim(tails, jnp.maximum(jax.lax.axis_index(t) - 1, 0), axis=1,
                                          keepdims=False)  # shard 0: its own, never read (no block above)
    history = jnp.concatenate([before, q5], axis=1)
    own = P + jnp.arange(S, dtype=jnp.int32)
    return jax.lax.stop_gradient(block_rows(history, own, jnp.broadcast_to(positions, (B, S)), config))


def _check_shard_blocks(mesh, t, T: int, config) -> None:
    """A context shard must hold the `recent_queries` rows that its neighbour's blocks rank with."""
    if t is None or not config.selects_by_block:
        return
    S = T // _shards(mesh, t)
    if S < recent_queries(config):
        raise ValueError(f"htree sharding: mesh axis {t!r} leaves {S} tokens a shard; block selection "
                         f"(selection_block={config.selection_block}) needs at least 2 * selection_block = "
                         f"{recent_queries(config)} a shard")


def _num_selections(config, T: int, packed) -> int:
    return config.num_layers(T if packed is None or packed[1] is None else packed[1]) - 1


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _attend_partitioned(q5, k, v, segment_ids, config, impl, packed, kernels, context_impl):
    return _attend_partitioned_fwd(q5, k, v, segment_ids, config, impl, packed, kernels, context_impl)[0]


def _attend_partitioned_fwd(q5, k, v, segment_ids, config, impl, packed, kernels, context_impl):
    fwd, _ = _partitioned_calls(config, impl, _num_selections(config, q5.shape[1], packed), packed, kernels,
                                context_impl)
    o5, *selected = fwd(q5, k, v, *([] if segment_ids is None else [segment_ids]))
    return (o5, selected), (q5, k, v, segment_ids)


def _attend_partitioned_bwd(config, impl, packed, kernels, context_impl, residuals, cotangents):
    q5, k, v, segment_ids = residuals
    _, bwd = _partitioned_calls(config, impl, _num_selections(config, q5.shape[1], packed), packed, kernels,
                                context_impl)
    extra = [] if segment_ids is None else [segment_ids]
    return tuple(bwd(q5, k, v, *extra, cotangents[0])) + (None,)


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
        if spec[3] is not None:
            raise ValueError(f"htree sharding: mesh axis {spec[3]!r} shards the head dim of {name}; htree shards "
                             "the batch, the tokens and the kv heads (whole GQA groups) only")
        T = x.shape[1]
        if T % _shards(sharding.mesh, spec[1]):
            raise ValueError(f"htree sharding: mesh axis {spec[1]!r} splits T = {T} of {name} into "
                             f"{_shards(sharding.mesh, spec[1])} shards: T must be divisible by it")
        shards = _shards(sharding.mesh, spec[2])
        if H_kv % shards:
            raise ValueError(f"htree sharding: mesh axis {spec[2]!r} splits the heads of {name} {shards} ways, which "
                             f"splits a GQA group: H_kv = {H_kv} kv heads must be divisible by it")


def partitioned_attention(q, k, v, config, impl: str, segment_ids=None, virtual_len=None, max_document_len=None,
                          block_sizes=None, context_impl: str | None = None, block_kernels=None):
    """`(o [B, T, H, V], selections)` of validated inputs through the custom-partitioned
    calls: under `jit` with batch- or head-sharded inputs, one local call per shard.
    `impl`: a concrete backend (`backends.choose_backend`). Packed rows: `segment_ids
    [B, T]` int32 (checked) and the static layout (`virtual_len`, `max_document_len`,
    `htree_jax.core.packing`). `block_sizes`: the Pallas kernels' (None: tuned);
    `block_kernels`: block selection's asks (`htree_jax.BlockKernels`, None: the plan's).
    `context_impl`: the backend of a context shard's local call where `impl`'s kernels
    cannot take the shards (block selection's, where a shard holds part of a block:
    `context_backend`); None refuses such a call, naming the mesh axis."""
    check_input_shardings(q, k, v)
    B, T, H, K = q.shape
    H_kv = k.shape[2]
    packed = None if segment_ids is None else (virtual_len, max_document_len)
    o5, selected = _attend_partitioned(q.reshape(B, T, H_kv, H // H_kv, K), k, v, segment_ids, config, impl, packed,
                                       (block_sizes, block_kernels), context_impl)
    return o5.reshape(B, T, H, -1), list(selected)


# ---------------------------------------------------------------------------------------
# Decoding: the walk over a cache sharded along the batch and/or the kv heads.


@functools.lru_cache(maxsize=None)
def _partitioned_cache_call(config, impl: str, num_layers: int, num_selections: int, num_radii: int,
                            block_sizes=None, value_dim: int = 0, num_scales: int = 0, ranked: bool = False):
    """A custom-partitioned `backends.attend_cache` over `num_layers` cache layers (and
    `num_radii` layers of radii, `num_scales` FP8 row scales): `f(q5, positions, *keys,
    *values, *radii, *scales[, rank_rows]) -> (o5, *selections)`; `value_dim > 0`: no
    values (read from the keys); `ranked`: block selection's ranking rows `[B, S, H_kv,
    R, K]` last, split as q5."""
    num_values = 0 if value_dim else num_layers
    num_ranks = 1 if ranked else 0

    def walk(q5, positions, *layers):
        B, S, H_kv, G, K = q5.shape
        rank_rows = layers[-1] if ranked else None
        layers = layers[:len(layers) - num_ranks]
        keys, values = layers[:num_layers], layers[num_layers:num_layers + num_values]
        radii = layers[num_layers + num_values:len(layers) - num_scales]
        scales = layers[len(layers) - num_scales:]
        tree = CacheTree(tuple(keys), tuple(values), tuple(radii), tuple(scales), value_dim)
        o, selected = attend_cache(q5.reshape(B, S, H_kv * G, K), tree, positions, config, impl,
                                   block_sizes=block_sizes, rank_rows=rank_rows)
        return (o.reshape(B, S, H_kv, G, -1), *selected)

    call = custom_partitioning(walk)

    def shardings(mesh, arg_shapes):
        b, t, g = local_specs(arg_shapes[0].sharding)
        if t is not None:
            raise ValueError(f"htree sharding: mesh axis {t!r} shards the new tokens of a decode step; a decode "
                             "cache shards along the batch and the kv heads only")
        q5, kv = _shardings(mesh, b, None, g)
        return q5, kv, NamedSharding(mesh, P(b, None))

    def infer(mesh, arg_shapes, result_shape):
        q5, kv, _ = shardings(mesh, arg_shapes)
        return (q5,) + (kv,) * num_selections

    def partition(mesh, arg_shapes, result_shape):
        q5, kv, rows = shardings(mesh, arg_shapes)
        scale = NamedSharding(mesh, P(kv.spec[0], kv.spec[2], None))
        return (mesh, walk, (q5,) + (kv,) * num_selections,
                (q5, rows) + (kv,) * (num_layers + num_values + num_radii) + (scale,) * num_scales + (q5,) * num_ranks)

    names = [f"n{chr(ord('a') + l)}" for l in range(num_layers)]
    rule = ", ".join(["b s g r k", "b s"] + [f"b {n} g k" for n in names] + [f"b {n} g v" for n in names[:num_values]]
                     + [f"b {n} g x" for n in names[1:1 + num_radii]] + ["b g na"] * num_scales
                     + ["b s g q k"] * num_ranks)
    rule += " -> " + ", ".join(["b s g r v"] + ["b s g t"] * num_selections)
    call.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule)
    return call


def partitioned_cache_attention(q, tree: CacheTree, positions, config, impl: str, block_sizes=None, rank_rows=None):
    """`backends.attend_cache` through a custom-partitioned call: under `jit` with a cache
    (and queries) sharded along the batch and/or the kv heads, one local walk per shard
    (`tree` the cache's, `core.tree.CacheTree`: FP8 tokens' row scales `[B, H_kv, N_0]`
    sharded as the layers; `rank_rows`: block selection's ranking rows, sharded as the
    queries)."""
    keys, values, radii, scales, value_dim = tree.keys, tree.values, tree.radii, tree.scales, tree.value_dim
    B, S, H, K = q.shape
    H_kv, L = keys[0].shape[2], len(keys)
    ranks = () if rank_rows is None else (rank_rows,)
    call = _partitioned_cache_call(config, impl, L, L - 1, len(radii), block_sizes, value_dim, len(scales),
                                   bool(ranks))
    o5, *selected = call(q.reshape(B, S, H_kv, H // H_kv, K), positions, *keys, *values, *radii, *scales, *ranks)
    return o5.reshape(B, S, H, -1), list(selected)
