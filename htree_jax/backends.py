"""The backend layer: which implementation runs a call, decided once (`plan_call`: the
backend by `choose_backend`, the route by `choose_route`, into a frozen `Plan`), and the
two calls every entry point above it makes (`htree_attention`, decoding, the sharded
wrappers, benchmarks):

- `attend`: a full sequence (or a context-parallel shard's queries) by its `Plan`
  (`htree_jax.routes.ROUTES`: the JAX reference, cuDNN for a one-layer tree, or a Pallas
  kernel family with its backward).
- `attend_cache`: new queries walking a decode cache's tree (`htree_jax.decode`).

Backend names (one rule for both): `"auto"` (the Pallas kernels on a GPU where they take
the shapes, else the reference), `"reference"`, `"pallas"` (CUDA GPUs),
`"pallas_interpret"` (the same kernels interpreted, any platform: how CI tests them).
`choose_backend` turns a name into the concrete one: `"reference"`, `"pallas"` or
`"pallas_interpret"`; `choose_route` the concrete one, the shapes and the options into
one route, or the error that names the rule no kernel route takes.

Inputs here are validated by the caller (`htree_jax.core.validation`), with `q`, `k` in
`rope_layout` order (SPEC 7).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from htree_jax.core.config import HTreeConfig
from htree_jax.core.one_layer import dense_takes, one_layer
from htree_jax.core.packing import Packing
from htree_jax.core.quantize import dequantize_rows
from htree_jax.core.rope import rope_layout
from htree_jax.core.tree import CacheTree
from htree_jax.core.validation import Dims
from htree_jax.reference import TreeWalk, attend_tree, default_query_chunk
from htree_jax.routes import ROUTES, Call, Route, block_selections, latent_values
from pallas_kernels.block.backward import backward_kernels
from pallas_kernels.block.forward import check_merge_route, chosen_merge, merge_static
from pallas_kernels.block.layout import PackedLayout, RowLayout
from pallas_kernels.block.merge import MAX_DIM as BLOCK_MAX_DIM
from pallas_kernels.decode.walk import attend_cache_pallas, check_pallas_decode_dims
from pallas_kernels.gqa.plan import check_pallas_dims
from pallas_kernels.shared.common import MAX_GROUP, check_query_layout
from pallas_kernels.shared.configs import BlockConfig, BlockSizes, DecodeBlockSizes, KernelConfigs
from pallas_kernels.shared.kernels import BlockKernels
from pallas_kernels.wide.forward import wide_eligible

BACKENDS = ("auto", "reference", "pallas", "pallas_interpret")


def check_backend(backend) -> str:
    """`backend` must be one of `BACKENDS`; returns it."""
    if backend not in BACKENDS:
        hint = ""
        if backend == "interpret":
            hint = " (the Pallas kernels interpreted are backend='pallas_interpret')"
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}{hint}")
    return backend


def check_block_sizes(block_sizes) -> None:
    """`block_sizes` must be None, a `BlockSizes` or (tuning every value) a
    `pallas_kernels.shared.configs.KernelConfigs` (static under `jit`: frozen, hashable)."""
    if block_sizes is not None and not isinstance(block_sizes, (BlockSizes, KernelConfigs)):
        raise TypeError(f"block_sizes must be an htree_jax.BlockSizes or None, got {type(block_sizes).__name__}")


def check_block_kernels(block_kernels) -> None:
    """`block_kernels` must be None or a `BlockKernels` (static under `jit`: frozen, hashable)."""
    if block_kernels is not None and not isinstance(block_kernels, BlockKernels):
        raise TypeError(f"block_kernels must be an htree_jax.BlockKernels or None, got {type(block_kernels).__name__}")


def choose_backend(backend: str, check_kernel_limits) -> str:
    """The concrete backend, `"reference"`, `"pallas"` or `"pallas_interpret"`, that the
    name `backend` gives on this platform. `check_kernel_limits()` raises a ValueError
    where the Pallas kernels do not take the call's shapes.

    "auto" is the Pallas kernels on a GPU where they take the shapes (faster than the
    reference at every size measured, benchmarks/RESULTS.md), else the reference.
    "pallas" off a GPU is refused with a pointer to "pallas_interpret"; "pallas" and
    "pallas_interpret" with shapes the kernels do not take are refused (`check_kernel_limits`
    takes the backend's name, which its errors name)."""
    check_backend(backend)
    if backend == "reference":
        return backend
    if backend == "auto":
        if jax.default_backend() != "gpu":
            return "reference"
        try:
            check_kernel_limits("pallas")
        except ValueError:
            return "reference"
        return "pallas"
    if backend == "pallas" and jax.default_backend() != "gpu":
        raise ValueError(
            "backend 'pallas' needs a CUDA GPU (Triton lowering); on "
            f"{jax.default_backend()!r} use backend='pallas_interpret' to run the same kernels interpreted"
        )
    check_kernel_limits(backend)
    return backend


@dataclasses.dataclass(frozen=True)
class Plan:
    """What runs a full-sequence call, decided once (`plan_call`) and passed down: the
    concrete backend `impl` (`"reference"`, `"pallas"` or `"pallas_interpret"`), the
    `route` (a key of `htree_jax.routes.ROUTES`) and, for block selection, the
    `selection_route` its ranking rows take (`ranking_route`); `tuning` the kernels'
    configs the call runs with; `kernels` block selection's kernels, chosen
    (`resolve_block_kernels`: the merge, the backward's walk and sum; no `"auto"` left for the
    kernels to read)."""

    impl: str
    route: str
    selection_route: str | None = None
    tuning: KernelConfigs | None = None
    kernels: BlockKernels = BlockKernels()


def resolve_block_kernels(kernels: BlockKernels, route: str, impl: str, *, dims: Dims, config: HTreeConfig,
                          dtype, block: BlockConfig, packed=False) -> BlockKernels:
    """`kernels` (the call's asks) with block selection's choices made for the call
    (`route` a `"block_<merge>"` route): the route's merge, and the backward's walk and
    sum as `block.backward.backward_kernels` chooses them over the call's layout (one
    document a row; packed rows: `packed`, their `Packing`, whose static fields are all it
    reads; with `packed=True`, the layout unknown, the two are left as asked, for the
    backward to choose), `block` the launch."""
    kernels = dataclasses.replace(kernels, merge=route.removeprefix("block_"))
    packing = packed if isinstance(packed, Packing) else None
    if packed is True:
        return kernels
    layout = (PackedLayout(packing, None) if packing is not None
              else RowLayout(keys=dims.seq_len, queries=dims.seq_len, b=config.selection_block, offset=None))
    return backward_kernels(layout, config, G=dims.group_size, K=dims.head_dim, V=dims.value_dim, dtype=dtype,
                            block=block, kernels=kernels, interpret=impl == "pallas_interpret")


@dataclasses.dataclass(frozen=True)
class CallKind:
    """What a full-sequence call's rows are besides their sizes (`Dims`): `packed` packed
    rows (True, or their `htree_jax.core.packing.Packing`, whose static layout block
    selection's backward choice reads), `latent` `v=None` (the values read from the
    keys), `context_shard` the queries a shard of the sequence (positions or ranking rows
    given)."""

    packed: object = False
    latent: bool = False
    context_shard: bool = False

    @property
    def is_packed(self) -> bool:
        return self.packed is not None and self.packed is not False


def plan_call(backend: str, *, dims: Dims, config: HTreeConfig, dtype, tuning: KernelConfigs,
              kernels: BlockKernels = BlockKernels(), kind: CallKind = CallKind(), check_limits: bool = True) -> Plan:
    """The `Plan` of a full-sequence call with `dims`, inputs in `dtype`, rows of `kind`,
    `tuning` the kernels' configs, `kernels` block selection's asks: the backend `backend` names
    (`choose_backend`, each candidate's route chosen once, its limits checked), the
    route's explicit asks checked (`check_route`), and block selection's ranking route
    and its kernels (`resolve_block_kernels`). `check_limits=False`: `backend` is
    already concrete and its limits were checked by the caller (a shard of a call
    planned whole)."""
    facts = dict(dims=dims, config=config, dtype=dtype, tuning=tuning, kernels=kernels, kind=kind)
    routes = {}

    def route_on(name):  # what `choose_backend` asks of a candidate: its route, or the rule it breaks
        routes[name] = choose_route(name, **facts)

    impl = choose_backend(backend, route_on) if check_limits else backend
    route = routes[impl] if impl in routes else choose_route(impl, **facts, check_limits=check_limits)
    check_route(route, impl, dims=dims, config=config, dtype=dtype, tuning=tuning)
    selection = None
    if route.startswith("block_"):
        selection = ranking_route(impl, dims=dims, config=config, dtype=dtype, tuning=tuning)
        kernels = resolve_block_kernels(kernels, route, impl, dims=dims, config=config, dtype=dtype,
                                        block=tuning.block, packed=kind.packed)
    return Plan(impl=impl, route=route, selection_route=selection, tuning=tuning, kernels=kernels)


def full_sequence_plan(backend: str, dims: Dims, config: HTreeConfig | None = None, packed: bool = False,
                       dtype=jnp.float32, latent: bool = False, block_sizes=None, packing=None,
                       kernels: BlockKernels | None = None) -> Plan:
    """`plan_call` for `htree_attention` with `dims` (`core.validation.Dims`), inputs in
    `dtype` (`latent`: `v=None`, the values read from the keys; `packed`: the call has
    `segment_ids`, laid out as `packing` where given; `kernels` block selection's asks,
    None: every choice the plan's): the kernels where `choose_route` finds a kernel
    route."""
    config = config or HTreeConfig()
    tuning = KernelConfigs.resolve(block_sizes, dims.head_dim, dims.value_dim)
    return plan_call(backend, dims=dims, config=config, dtype=dtype, tuning=tuning, kernels=kernels or BlockKernels(),
                     kind=CallKind(packed=packing or packed, latent=latent))


def full_sequence_backend(backend: str, dims: Dims, config: HTreeConfig | None = None, packed: bool = False,
                          dtype=jnp.float32, latent: bool = False, block_sizes=None) -> str:
    """The concrete backend of `full_sequence_plan` (for callers that pass it on)."""
    return full_sequence_plan(backend, dims, config, packed, dtype, latent, block_sizes).impl


WHOLE_SEQUENCES = ("block selection's kernels take context shards of whole blocks (a shard's length a multiple of "
                   "selection_block): backend='reference' takes the others")


def takes_context_shards(impl: str, config: HTreeConfig, shard_len: int) -> bool:
    """Whether `impl` runs a context shard of `shard_len` tokens (tokens split along T)
    on its own route: every one does but block selection's kernels where the shard
    holds part of a block (`WHOLE_SEQUENCES`: its blocks would start in another)."""
    kernels = config.selects_by_block and impl in ("pallas", "pallas_interpret")
    return not (kernels and shard_len % config.selection_block)


def check_block_kernel_dims(dims: Dims, config: HTreeConfig, backend: str) -> None:
    """Block selection's kernels (SPEC 12, `pallas_kernels.block`): the per-query kernels'
    limits for the call (they choose each block's nodes on its ranking rows), heads up to
    `BLOCK_MAX_DIM` features and the ranking rows (`"previous"`: `b * G` rows a kv
    head). A context shard's whole blocks: `block.forward.check_shard_offset`."""
    check_pallas_dims(dims, backend)
    if max(dims.head_dim, dims.value_dim) > BLOCK_MAX_DIM:
        raise ValueError(f"backend {backend!r}: block selection's kernels take K and V up to {BLOCK_MAX_DIM}, got "
                         f"K = {dims.head_dim}, V = {dims.value_dim}; backend='reference' takes larger heads")
    check_ranking_rows(dims.group_size, config, backend)


def choose_route(impl: str, *, dims: Dims, config: HTreeConfig, dtype, tuning: KernelConfigs,
                 kernels: BlockKernels = BlockKernels(), kind: CallKind = CallKind(),
                 check_limits: bool = True) -> str:
    """The route (a key of `htree_jax.routes.ROUTES`) a full-sequence call takes on the
    concrete backend `impl`: `dims` the call's sizes (`seq_len` the keys' `T`; `H` the
    queries' heads), inputs in `dtype`, `tuning` the kernels' configs, `kernels` block
    selection's asks, `kind` the rows (`CallKind`: packed, latent, a context shard). On a
    kernel backend a call no kernel route takes is a ValueError naming the rule (what
    "auto" catches to take the reference);
    `check_limits=False` (`attend`, whose caller has chosen the backend with them) skips
    the kernels' size limits, not which routes take packed rows or context shards.

    - `"reference"`, `"reference_packed"`: `impl == "reference"`.
    - `"block_<merge>"`: block selection (SPEC 12) past one layer, the merge
      `kernels.merge` (`"auto"`: `block.forward.chosen_merge`, Mosaic GPU on a
      Hopper GPU where it takes the shape; `check_block_kernel_dims`; whether a named
      merge runs the shapes is `check_route`'s, an error under backend "auto" too).
    - `"dense"`: a one-layer tree (exact causal attention) on a GPU that cuDNN takes:
      16-bit inputs of equal head dims up to 128, the values given, whole sequences of
      one document a row.
    - `"wide"`: groups of 32 or more heads (`wide_eligible`).
    - `"gqa"`: every other call the kernels take (`check_pallas_dims`)."""
    if impl == "reference":
        return "reference_packed" if kind.is_packed else "reference"
    if config.selection == "indexer":
        raise ValueError(f"backend {impl!r}: selection='indexer' (SPEC 13) runs on backend='reference' only; the "
                         "kernels do not rank by an indexer yet")
    whole = one_layer(config, dims.seq_len)
    if config.selects_by_block and not whole:
        if check_limits:
            check_block_kernel_dims(dims, config, impl)
        return "block_" + chosen_merge(kernels.merge, config, dims.seq_len, dims.group_size, dims.head_dim,
                                       dims.value_dim, dtype, tuning.block, impl == "pallas_interpret")
    if check_limits:
        check_pallas_dims(dims, impl)
    if (whole and impl == "pallas" and not (kind.is_packed or kind.latent or kind.context_shard)
            and dense_takes(dtype, dims.head_dim, dims.value_dim)):
        return "dense"
    if wide_eligible(dims.group_size, dims.head_dim, dims.value_dim, tuning, True if kind.is_packed else None):
        return "wide"
    return "gqa"


def ranking_route(impl: str, *, dims: Dims, config: HTreeConfig, dtype, tuning: KernelConfigs) -> str:
    """The per-query route block selection's ranking rows (SPEC 12) take, run as the
    queries of one position a block (`routes.block_selections`): `G` rows a kv head with
    `"first"`, `b * G` with `"previous"` (the block route's limits hold for them)."""
    rows = config.selection_block if config.block_source == "previous" else 1
    return choose_route(impl, dims=dataclasses.replace(dims, num_heads=dims.num_heads * rows),
                        config=dataclasses.replace(config, selection_block=1), dtype=dtype, tuning=tuning,
                        kind=CallKind(context_shard=True), check_limits=False)


def kernel_route(q, k, v, config: HTreeConfig, block_sizes=None, impl: str = "pallas") -> Route:
    """The row of `ROUTES` that `attend(q, k, v, config, impl)` takes for whole sequences
    of one document a row: its `forward` and `backward` passes are what the benchmarks
    and GPU checks time and compare apart from the guard."""
    dims = Dims(q.shape[0], k.shape[1], q.shape[2], k.shape[2], q.shape[-1], v.shape[-1])
    tuning = KernelConfigs.resolve(block_sizes, dims.head_dim, dims.value_dim)
    return ROUTES[choose_route(impl, dims=dims, config=config, dtype=q.dtype, tuning=tuning)]


def blocks_of(q, k, v, config: HTreeConfig, block_sizes=None, impl: str = "pallas"):
    """The blocks' selections of a block-selection call (SPEC 12), as `attend`'s block
    routes make them: per layer above 0, top first, `[B, ceil(T / b), H_kv, top_k]`
    int32. For benchmarks and probes that time the block kernels apart."""
    dims = Dims(q.shape[0], k.shape[1], q.shape[2], k.shape[2], q.shape[-1], v.shape[-1])
    tuning = KernelConfigs.resolve(block_sizes, dims.head_dim, dims.value_dim)
    route = ranking_route(impl, dims=dims, config=config, dtype=q.dtype, tuning=tuning)
    call = Call(config=config, tuning=tuning, interpret=impl == "pallas_interpret", selection_route=route)
    return block_selections(q, k, v, call)[0]


def check_route(name: str, impl: str, *, dims: Dims, config: HTreeConfig, dtype, tuning: KernelConfigs) -> None:
    """What a call asked for explicitly and the chosen route cannot do, a ValueError
    naming the rule ("auto" does not fall back from it): block selection's merge
    (the route's, `BlockKernels.merge` resolved) on these shapes (`check_merge_route`).
    Every merge takes packed rows and context shards."""
    if name.startswith("block_"):
        merge = name[len("block_"):]
        st = merge_static(config, dims.seq_len, dims.group_size, dims.head_dim, dims.value_dim, dtype, tuning.block,
                          merge)
        check_merge_route(merge, st, dims.head_dim, dims.value_dim, dtype, impl == "pallas_interpret")


@functools.partial(jax.jit, static_argnames=("config", "impl", "export", "block_sizes", "value_dim", "q_layout",
                                             "block_kernels"))
def attend(q, k, v, config: HTreeConfig, impl: str | Plan, packing=None, positions=None, export: bool = False,
           block_sizes: BlockSizes | KernelConfigs | None = None, value_dim: int | None = None,
           q_layout: str = "rope_layout", rank_rows=None, index=None, block_kernels: BlockKernels | None = None):
    """htree attention of validated `q [B, S, H, K]`, `k [B, T, H_kv, K]`, `v [B, T, H_kv,
    V]` (`q`, `k` in `rope_layout` order; `q_layout="given"`: `q` in the caller's order,
    which the wide kernels read as it is, no permuted copy of q; elsewhere it is permuted
    here) by the `Plan` `impl` (`htree_attention`'s, made once), or on the concrete
    backend `impl` (`choose_backend`'s; its limits checked by the caller) by the plan made
    here. Returns `(o [B, S, H, V], selections)`, and the kept nodes' importance last
    with `export` (SPEC 8).

    SPEC 10's guard (`htree_jax.core.non_finite`): non-finite `k`, `v` entries zeroed,
    outputs NaN from the first such position on. Packed rows (`packing`,
    `htree_jax.core.packing.Packing`) that do not fit their static layout answer NaN;
    their selections are counted inside each token's document. `positions [S]` int32: the
    queries' positions among `k`'s `T` tokens (a context-parallel shard's queries;
    `None`: `S = T`). `block_sizes`: the Pallas kernels' tiling (`BlockSizes`, None:
    the tuned values; `configs.KernelConfigs.resolve`); `block_kernels`: block
    selection's asks where `impl` is a backend (a `Plan` has them). `v=None` with `value_dim`: the
    values are the first `value_dim` latent features of `k`, read from the keys by the
    wide kernels (elsewhere they are copied out first). `rank_rows`: block selection's
    ranking rows (SPEC 12) of a context shard, whose blocks may start in the shard
    before (`reference.attend_tree`); None: from `q`. `index` (`core.indexer.Index`,
    `selection="indexer"`): the indexer's inputs; SPEC 13's loss `[B, S, H_kv]` comes
    last, differentiable in them."""
    check_query_layout(q_layout, wide=True)
    B, S, H, K = q.shape
    V = value_dim if v is None else v.shape[-1]
    dims = Dims(B, k.shape[1], H, k.shape[2], K, V)
    plan = impl if isinstance(impl, Plan) else plan_call(
        impl, dims=dims, config=config, dtype=q.dtype, tuning=KernelConfigs.resolve(block_sizes, K, V),
        kernels=block_kernels or BlockKernels(), check_limits=False,
        kind=CallKind(packed=packing if packing is not None else False, latent=v is None,
                      context_shard=positions is not None or rank_rows is not None))
    tuning = plan.tuning or KernelConfigs.resolve(block_sizes, K, V)
    route = ROUTES[plan.route]
    if q_layout == "given" and not route.given_layout:
        q, q_layout = rope_layout(q, config.partial_rope(K)), "rope_layout"
    if v is None and not route.values_from_keys:
        v = latent_values(k, config, value_dim)
    call = Call(config=config, tuning=tuning, interpret=plan.impl == "pallas_interpret", export=export,
                positions=positions, packing=packing, rank_rows=rank_rows, value_dim=value_dim if v is None else None,
                q_layout=q_layout, selection_route=plan.selection_route, kernels=plan.kernels, index=index)
    o, selected, *exported = route.attend(q, k, v, call)
    loss = () if index is None else (exported.pop(),)
    if packing is not None:
        o = jnp.where(packing.fits[:, None, None, None], o, jnp.asarray(jnp.nan, o.dtype))
    return (o, selected, *(jax.lax.stop_gradient(x) for x in exported), *loss)


def decode_backend(backend: str, head_dim: int, value_dim: int, group: int, latent_half: int | None = None,
                   config: HTreeConfig | None = None) -> str:
    """`choose_backend` for a decode call: the cache's `K`, `V` and the group size
    (every `HTreeConfig.selection` decodes on the kernels). Block selection (SPEC 12)
    also walks its ranking rows on them (`check_block_decode_dims`)."""
    def limits(name):
        check_pallas_decode_dims(head_dim, value_dim, group, latent_half)
        if config is not None and config.selects_by_block:
            check_block_decode_dims(group, config, name)
    return choose_backend(backend, limits)


def check_ranking_rows(group: int, config: HTreeConfig, backend: str) -> None:
    """SPEC 12's ranking rows a kv head (the first query's `G`, or the previous block's
    `b * G`) run on the kernels as one query's heads: at most `MAX_GROUP`."""
    rows = group * (config.selection_block if config.block_source == "previous" else 1)
    if rows > MAX_GROUP:
        raise ValueError(f"backend {backend!r}: block_source='previous' ranks with selection_block * H / H_kv = "
                         f"{rows} rows a kv head, at most {MAX_GROUP} on the kernels")


def check_block_decode_dims(group: int, config: HTreeConfig, backend: str) -> None:
    """Block selection decoding on the kernels: the ranking rows walk as one query's
    heads (`check_ranking_rows`)."""
    check_ranking_rows(group, config, backend)



@functools.partial(jax.jit, static_argnames=("config", "impl", "block_sizes"))
def attend_cache(q, tree: CacheTree, positions, config: HTreeConfig, impl: str, *,
                 block_sizes: DecodeBlockSizes | None = None, rank_rows=None, chosen=()):
    """Queries `q [B, S, H, K]` (in `rope_layout` order) at `positions [B, S]` over a
    decode cache's `tree` (`core.tree.CacheTree`: its layers bottom first, un-rotated,
    the radii of layers 1.. with `selection="bound"`, FP8 scales, `value_dim`), on the
    concrete backend `impl` (the Pallas kernels' `block_sizes`, None: the defaults):
    `(o [B, S, H, V], selections)`. `tree.value_dim > 0`: the values are the keys' first
    `value_dim` latent features (the kernels read them from the gathered keys). FP8
    tokens (`tree.scales`): the reference reads them back in q's dtype, the kernels
    scale each token's score and weight. Block selection
    (SPEC 12): `rank_rows [B, S, H_kv, R, K]`, each query's ranking rows
    (`reference.block_rows` over the cache's recent queries and `q`), which the
    reference ranks with; the kernels keep `chosen` (every layer's kept nodes above 0,
    top first, `[B, S, H_kv, top_k]`: `rank_cache`'s, or a cache's) or, where it is
    empty, make them with `rank_cache`."""
    if impl != "reference":
        if config.selects_by_block and rank_rows is not None and not chosen:
            chosen = rank_cache(rank_rows, tree, positions, config, impl, block_sizes)
        # One new token is the newest in the cache: nothing after it can be NaN, so the
        # decode kernels need not zero the values it does not merge (SPEC 10).
        return attend_cache_pallas(q, tree, positions, config, block_sizes=block_sizes or DecodeBlockSizes(),
                                   interpret=impl == "pallas_interpret", zero_unmerged=q.shape[1] > 1,
                                   chosen=tuple(chosen))
    keys, values, radii, scales, value_dim = tree.keys, tree.values, tree.radii, tree.scales, tree.value_dim
    if scales:
        read_back = lambda x, scale: dequantize_rows(x, jnp.swapaxes(scale, 1, 2), q.dtype)
        keys = (read_back(keys[0], scales[0]),) + tuple(keys[1:])
        if values:
            values = (read_back(values[0], scales[1]),) + tuple(values[1:])
    if value_dim:
        values = tuple(latent_values(kl, config, value_dim) for kl in keys)
    B, S, H, K = q.shape
    H_kv, V = keys[0].shape[2], values[0].shape[-1]
    chunk = min(S, default_query_chunk(config, B, S, H_kv, H // H_kv, K, V))
    layers = [(keys[0], values[0])] + [(kl, vl) + tuple(rho) for kl, vl, *rho in
                                       zip(keys[1:], values[1:], *([radii] if radii else []))]
    return attend_tree(q, layers, positions, TreeWalk(config, chunk, keys_rotated=False), rank_rows=rank_rows)


def rank_cache(rank_rows, tree: CacheTree, positions, config: HTreeConfig, impl: str,
               block_sizes: DecodeBlockSizes | None = None):
    """Block selection (SPEC 12) on the decode kernels: each query's kept nodes of every
    layer above 0 (top first, `[B, S, H_kv, top_k]`), those its ranking rows `rank_rows
    [B, S, H_kv, R, K]` keep when they walk the cache as one query's `R` heads at the
    first position of the query's block (`positions [B, S]`). The walk's outputs are
    not used: it is the block's selection that is wanted. The cache may hold tokens
    after that position (later tokens of the block): with `strict_causal` they sit in
    the rightmost nodes only, which are kept whatever they hold and rank nothing."""
    B, S, H_kv, R, K = rank_rows.shape
    starts = positions - positions % config.selection_block
    _, selections = attend_cache_pallas(rank_rows.reshape(B, S, H_kv * R, K), tree, starts, config,
                                        block_sizes=block_sizes or DecodeBlockSizes(),
                                        interpret=impl == "pallas_interpret")
    return tuple(selections)
