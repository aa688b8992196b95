"""The ways a full-sequence call can run, and the table that maps each to its forward and
its backward (`ROUTES`). `htree_jax.backends.choose_route` picks one of them for a call;
this module only says what each one is.

A route's `attend(q, k, v, call)` is its differentiable call: `q [B, S, H, K]`, `k [B, T,
H_kv, K]` (both in `rope_layout` order, unless the route reads q as given), `v [B, T,
H_kv, V]` (or None, where the route reads the values from the keys), and a `Call` ->
`(o [B, S, H, V], selections, *importance)`. For the kernel routes it is the family's
`jax.custom_vjp` (`pallas_kernels/<family>/attention.py`), which pairs the route's
`forward` with its `backward`; the reference and cuDNN routes are differentiated by XLA
(`backward` None). Every route applies SPEC 10's guard to `k`, `v`.

| route | runs | backward |
|---|---|---|
| `reference` | the JAX reference (`htree_attention_reference`) | XLA autodiff |
| `reference_packed` | the JAX reference over packed rows | XLA autodiff |
| `dense` | a one-layer tree: RoPE, then cuDNN (`core.one_layer`) | XLA (cuDNN's) |
| `gqa` | the GQA family (`pallas_kernels/gqa/`) | `htree_backward_pallas` |
| `wide` | the wide family (latent attention, `pallas_kernels/wide/`) | `wide_backward_pallas` |
| `block_<merge>` | block selection: the blocks' selections on `Call.selection_route`, then the block merge `<merge>` (`pallas_kernels/block/`); packed rows laid out virtually (`pallas_kernels/block/layout.py`) | `block_backward_pallas` (over the same layout) |

Adding a route is a row here (and a rule in `choose_route`), the family's file and its tests.
Each row also declares what it takes (`Support`): `support_matrix` prints those as the
table of `docs/backends.md`, from the same constants the routes' checks read
(`tools/support_matrix.py --write` writes it there; `tests/test_docs.py` fails where the
two differ).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from htree_jax.core.config import HTreeConfig
from htree_jax.core.non_finite import first_non_finite, poison_rows, zero_non_finite
from htree_jax.core.one_layer import DENSE_DTYPES, DENSE_MAX_HEAD_DIM, one_layer_attention
from htree_jax.core.packing import Packing, local_selections, tokens_to_virtual, virtual_doc_starts
from htree_jax.reference import htree_attention_reference, htree_attention_reference_packed
from pallas_kernels.block.attention import attention as block_attention
from pallas_kernels.block.attention import block_operands
from pallas_kernels.block.backward import block_backward_pallas
from pallas_kernels.block.forward import MERGES, block_forward_pallas
from pallas_kernels.block.layout import PackedLayout
from pallas_kernels.block.merge import MAX_DIM as BLOCK_MAX_DIM
from pallas_kernels.block.mosaic_merge import DTYPES as MOSAIC_DTYPES
from pallas_kernels.block.mosaic_merge import HALVES, MAX_PROGRAM_ROWS, RATES, VALUE_DIMS, spoken
from pallas_kernels.gqa.attention import gqa_attention
from pallas_kernels.gqa.backward import htree_backward_pallas
from pallas_kernels.gqa.forward import htree_forward_pallas
from pallas_kernels.shared.common import KERNEL_GROUP, MAX_GROUP, MAX_HEAD_DIM, MAX_VALUE_DIM, MIN_DIM
from pallas_kernels.shared.configs import KernelConfigs
from pallas_kernels.shared.dead_rows import poison_rows_in_place
from pallas_kernels.shared.guarded import KernelCall, query_positions
from pallas_kernels.shared.kernels import BlockKernels
from pallas_kernels.wide.attention import wide_attention
from pallas_kernels.wide.backward import wide_backward_pallas
from pallas_kernels.wide.forward import FeatureSplit, wide_forward_pallas


@dataclasses.dataclass(frozen=True)
class Call:
    """What a route is called with besides `q, k, v` (built by `backends.attend`):
    `positions [S]` the queries' positions among the `T` tokens (a context shard; None:
    `S = T`); `packing` packed rows; `rank_rows` a context shard's block-selection ranking
    rows (the reference's, SPEC 12); `value_dim` with `v=None`; `q_layout` q's feature
    order (`"given"` only on routes that read it so); `selection_route` block selection's
    route for its ranking rows, `kernels` its kernels (the plan's, each named); `index`
    the learned indexer's inputs (SPEC 13, `core.indexer.Index`; the reference's)."""

    config: HTreeConfig
    tuning: KernelConfigs
    interpret: bool = False
    export: bool = False
    positions: object = None
    packing: object = None
    rank_rows: object = None
    value_dim: int | None = None
    q_layout: str = "rope_layout"
    selection_route: str | None = None
    kernels: BlockKernels = BlockKernels()
    index: object = None

    def kernel_call(self, merge: str | None = None) -> KernelCall:
        """What a kernel family's differentiable call is compiled for (`guarded.KernelCall`),
        block selection's kernels with the route's `merge`."""
        kernels = self.kernels if merge is None else dataclasses.replace(self.kernels, merge=merge)
        return KernelCall(self.config, self.tuning, self.interpret, self.export, self.value_dim, self.q_layout,
                          kernels)


@dataclasses.dataclass(frozen=True)
class Support:
    """What a route takes, a phrase a feature: the columns of `docs/backends.md`'s support
    matrix (`support_matrix`), written from the constants its checks read."""

    runs_on: str
    dtypes: str
    head_dims: str
    group: str
    tree: str
    selection: str
    packed: str
    context_shards: str
    values_from_keys: str
    export: str
    backward: str
    sharding: str = "yes"


# The matrix's rows: `Support`'s fields and how the table names them.
SUPPORT_ROWS = (("runs_on", "runs on"), ("dtypes", "dtypes"), ("head_dims", "head dims"),
                ("group", "heads a kv head (G)"), ("tree", "tree"), ("selection", "selection"),
                ("packed", "packed rows (`segment_ids`)"), ("context_shards", "context shards (T sharded)"),
                ("sharding", "batch / head sharding"), ("values_from_keys", "values from the keys (`v=None`)"),
                ("export", "importance export (SPEC 8)"), ("backward", "backward"))


def dtype_names(dtypes) -> str:
    """`(jnp.bfloat16, jnp.float16)` -> `"bf16, f16"`."""
    short = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
    return ", ".join(short[jnp.dtype(d).name] for d in dtypes)


ALL_DTYPES = dtype_names((jnp.float32, jnp.bfloat16, jnp.float16))
KERNELS = "a GPU; interpreted anywhere"
REFERENCE = Support(
    runs_on="any platform", dtypes=ALL_DTYPES, head_dims="any even K", group="any", tree="any",
    selection="per query and by block; the learned indexer (SPEC 13, one document a row)",
    packed="yes (`reference_packed`)", context_shards="yes", values_from_keys="copied out", export="yes",
    backward="XLA autodiff")
DENSE = Support(
    runs_on="a GPU (cuDNN)", dtypes=dtype_names(DENSE_DTYPES),
    head_dims=f"K = V <= {DENSE_MAX_HEAD_DIM}, a multiple of 8", group="any", tree="one layer",
    selection="none (exact attention)", packed="no (`gqa`)", context_shards="no (`gqa`)",
    values_from_keys="no (`gqa`/`wide`)", export="none: one layer", backward="XLA (cuDNN's)")
GQA = Support(
    runs_on=KERNELS, dtypes=ALL_DTYPES, head_dims=f"K in [{MIN_DIM}, {MAX_HEAD_DIM}], V in [{MIN_DIM}, "
                                                  f"{MAX_VALUE_DIM}]",
    group=f"<= {KERNEL_GROUP}, or {2 * KERNEL_GROUP}-{MAX_GROUP} in multiples of {KERNEL_GROUP} (virtual kv heads)",
    tree="any", selection="per query", packed="yes", context_shards="yes", values_from_keys="copied out",
    export="yes", backward="its own, deterministic")
WIDE = dataclasses.replace(
    GQA, head_dims="the same", group=f">= {2 * KERNEL_GROUP}, or {KERNEL_GROUP} at K past 256",
    packed="no (`gqa`, virtual heads)", values_from_keys="read in place")
BLOCK = Support(
    runs_on=KERNELS, dtypes=ALL_DTYPES, head_dims=f"K, V <= {BLOCK_MAX_DIM}",
    group=f"as `gqa`; ranking rows `b * G` <= {MAX_GROUP} (`\"previous\"`)", tree="past one layer",
    selection="by block (SPEC 12)",
    packed="yes: the queries laid out as the tree (`block/layout.py`), partials' (or atomics') backward",
    context_shards="yes: whole blocks a shard (`S` a multiple of `b`), from its offset; partials' (or atomics') "
                   "backward",
    values_from_keys="copied out", export="yes",
    backward="its own, `dk`/`dv` from partial sums on a GPU (deterministic; atomics interpreted)")
# Each block merge: its `Support` where it differs from the Pallas-Triton one's.
MERGE_SUPPORT = {
    "pallas_triton": BLOCK,
    "mosaic_gpu": dataclasses.replace(
        BLOCK, runs_on="a Hopper GPU", dtypes=dtype_names(MOSAIC_DTYPES),
        head_dims=f"K / 2 of {spoken(HALVES)}, V of {spoken(VALUE_DIMS)}",
        group=f"the same, at most {MAX_PROGRAM_ROWS} rows a program",
        tree=f"past one layer; r of {RATES[0]}-{RATES[-1]}", selection="by block",
        packed="yes, as `block_pallas_triton` (its top layer's steps from the document's; the earlier nodes of that "
               "step marked in its bitmaps)",
        context_shards="yes, as `block_pallas_triton`", backward="`block_pallas_triton`'s"),
}


@dataclasses.dataclass(frozen=True)
class Route:
    """One row of `ROUTES`: `attend(q, k, v, call)` (the differentiable call), the
    `forward` it runs (kernels' forward pass, or the function XLA differentiates) and the
    `backward` paired with it (None: XLA's). `given_layout`: takes q in the caller's
    feature order (no permuted copy); `values_from_keys`: takes `v=None`. `support`:
    what it takes (None: another route's column says it, as `reference_packed`'s is the
    reference's)."""

    attend: Callable
    forward: Callable
    backward: Callable | None
    given_layout: bool = False
    values_from_keys: bool = False
    support: Support | None = None


def latent_values(k, config: HTreeConfig, value_dim: int):
    """The values that are the first `value_dim` latent (unrotated) features of `k [B, T,
    H_kv, K]` (`rope_layout` order): what `v=None` stands for (`htree_attention`)."""
    K = k.shape[-1]
    return FeatureSplit(K, config.partial_rope(K) or K).values(k, value_dim)


def _guarded(attention, q, k, v, positions):
    """SPEC 10's guard around an XLA-differentiated `attention(q, k, v)`: non-finite `k`,
    `v` entries zeroed, output rows from the first such position on NaN."""
    first = first_non_finite(k, v, jnp.arange(k.shape[1], dtype=jnp.int32))
    o, *rest = attention(q, zero_non_finite(k), zero_non_finite(v))
    return (poison_rows(o, query_positions(positions, q), first), *rest)


def _reference(q, k, v, c: Call):
    return _guarded(lambda q, k, v: htree_attention_reference(q, k, v, c.config, positions=c.positions,
                                                              return_importance=c.export, rank_rows=c.rank_rows,
                                                              index=c.index),
                    q, k, v, c.positions)


def _reference_packed(q, k, v, c: Call):
    return _guarded(lambda q, k, v: htree_attention_reference_packed(q, k, v, c.packing, c.config,
                                                                     return_importance=c.export),
                    q, k, v, None)


def _dense(q, k, v, c: Call):
    """A one-layer tree is causal attention: RoPE, then cuDNN (no selections, no
    importance to export), under SPEC 10's guard."""
    first = first_non_finite(k, v, jnp.arange(k.shape[1], dtype=jnp.int32))
    on_gpu = jax.default_backend() == "gpu"
    # cuDNN named: left to choose (None), jax took XLA's dense attention there, which
    # holds a `[B, H, T, T]` array (journal, 2026-11-26 (7)).
    o = one_layer_attention(q, zero_non_finite(k), zero_non_finite(v), c.config,
                            implementation="cudnn" if on_gpu else None)
    # On the GPU the poisoned rows are written in place (`pallas_kernels.shared.dead_rows`:
    # nothing is read or written with finite inputs), not with a pass over `o`.
    o = poison_rows_in_place(o, first) if on_gpu else poison_rows(o, query_positions(None, q), first)
    return (o, []) + (([],) if c.export else ())


def _gqa(q, k, v, c: Call):
    o, selected, *exported = gqa_attention(q, k, v, c.kernel_call(), positions=c.positions, packing=c.packing)
    if c.packing is not None:
        selected = local_selections(selected, c.packing, c.config.compression_rate)
    return (o, selected, *exported)


def _wide(q, k, v, c: Call):
    return wide_attention(q, k, v, c.kernel_call(), positions=c.positions)


def block_ranking_rows(q, num_kv_heads: int, config: HTreeConfig):
    """SPEC 12's ranking rows of every block as the queries of one position, its first:
    `q [B, T, H, K]` -> `[B, ceil(T / b), H_kv * R, K]`, each kv head's `R` rows together:
    the block's first query (`"first"`, `R = G`) or the previous block's `b` queries
    (`"previous"`, `R = b * G`, zeros before the first block)."""
    B, T, H, K = q.shape
    b = config.selection_block
    if config.block_source == "first":
        return q[:, ::b]
    NB, G = -(-T // b), H // num_kv_heads
    blocks = jnp.pad(q, ((0, 0), (0, NB * b - T), (0, 0), (0, 0))).reshape(B, NB, b, num_kv_heads, G, K)
    previous = jnp.concatenate([jnp.zeros_like(blocks[:, :1]), blocks[:, :-1]], axis=1)
    return jnp.swapaxes(previous, 2, 3).reshape(B, NB, num_kv_heads * b * G, K)


def shard_ranking_rows(rank_rows, config: HTreeConfig):
    """A context shard's ranking rows as `block_ranking_rows` lays them out: each
    query's `[B, S, H_kv, R, K]` (`sharding.shard_rank_rows`; a block's queries share
    them) -> each block's `[B, S / b, H_kv * R, K]`."""
    B, S, H_kv, R, K = rank_rows.shape
    return rank_rows[:, :: config.selection_block].reshape(B, -1, H_kv * R, K)


def block_selections(q, k, v, c: Call, offset=None):
    """`(selections, importance)` of every block (SPEC 12): the forward of the per-query
    route `c.selection_route` (`backends.ranking_route`), run on each block's ranking
    rows at its first position, chooses what the block refines. Each `[B, ceil(S / b),
    H_kv, top_k]`, top layer first (importance `[]` without `c.export`). Constants
    under autodiff. A context shard: `q [B, S, H, K]` from position `offset` of `k`'s `T` tokens,
    `c.rank_rows` its queries' ranking rows (`shard_ranking_rows`; None: from `q`, which
    holds each block's first query but not the block before a shard's first). No merge
    runs (`selections_only`): the block merge computes every row's output."""
    config, rank_rows = c.config, c.rank_rows
    b = config.selection_block
    starts = jnp.arange(-(-q.shape[1] // b), dtype=jnp.int32) * b
    if offset is not None:
        starts = starts + offset
    rows = block_ranking_rows(q, k.shape[2], config) if rank_rows is None else shard_ranking_rows(rank_rows, config)
    rows, k, v = (jax.lax.stop_gradient(x) for x in (rows, k, v))
    _, selected, *exported = ROUTES[c.selection_route].forward(
        rows, k, v, config=dataclasses.replace(config, selection_block=1), block_sizes=c.tuning, interpret=c.interpret,
        positions=starts, return_importance=c.export, selections_only=True)
    return selected, (exported[0] if c.export else [])


def packed_block_selections(q, k, v, packing, *, config: HTreeConfig, tuning: KernelConfigs,
                            interpret: bool = False, export: bool = False):
    """`block_selections` over packed rows (SPEC 6, 12): the queries laid out as the tree
    is (`core.packing`: a document starts at a multiple of `r^(L-1)`, so its blocks at
    multiples of `b`), each virtual block ranked at its first virtual position by the
    per-query GQA kernels over the keys' packed tree (`"previous"`: zero rows where a
    block starts its document). Returns `(selections, firsts, importance)`: each layer's
    `[B, T_v / b, H_kv, top_k]` virtual tree rows (top layer first), `firsts [B, T_v /
    b]` each block's document's first top node (`pallas_kernels.block.layout.PackedLayout`), and the
    importance (`[]` without `export`). Blocks of padding rank too; nothing reads them."""
    b, r, L = config.selection_block, config.compression_rate, packing.num_layers
    doc = virtual_doc_starts(packing)[:, ::b]  # [B, NB_v]
    starts = jnp.broadcast_to(jnp.arange(doc.shape[1], dtype=jnp.int32) * b, doc.shape)
    rows = block_ranking_rows(tokens_to_virtual(q, packing), k.shape[2], config)
    if config.block_source == "previous":  # the virtual block before may hold the previous document's tokens
        rows = jnp.where((starts == doc)[:, :, None, None], jnp.zeros((), rows.dtype), rows)
    places = Packing(starts, doc, packing.fits, packing.virtual_len, L)
    rows, k, v = (jax.lax.stop_gradient(x) for x in (rows, k, v))
    _, selected, *exported = ROUTES["gqa"].forward(
        rows, k, v, config=dataclasses.replace(config, selection_block=1), block_sizes=tuning, interpret=interpret,
        packing=packing, query_packing=places, return_importance=export, selections_only=True)
    return selected, doc // r ** (L - 1), (exported[0] if export else [])


def per_token(block_values, b: int, T: int):
    """A block's lists for each of its tokens: `[B, NB, ...]` -> `[B, T, ...]`."""
    return jnp.repeat(block_values, b, axis=1)[:, :T]


def _block_packed(q, k, v, c: Call, merge: str):
    """Block selection over packed rows on the kernels (`packed_block_selections`, then
    the block merge `merge` and backward over `PackedLayout`); each token's lists are its
    virtual block's, counted inside its document. A one-layer tree is exact attention
    in each document: the per-query route's."""
    if c.packing.num_layers == 1:
        return _gqa(q, k, v, dataclasses.replace(c, config=dataclasses.replace(c.config, selection_block=1)))
    blocks, firsts, exported = packed_block_selections(q, zero_non_finite(k), zero_non_finite(v), c.packing,
                                                       config=c.config, tuning=c.tuning, interpret=c.interpret,
                                                       export=c.export)
    operands = block_operands(q, k, blocks, c.config, layout=PackedLayout(c.packing, firsts))
    o = block_attention(q, k, v, operands, c.kernel_call(merge))[0]
    block_of = (c.packing.position // c.config.selection_block)[:, :, None, None]
    tokens = lambda x: jnp.take_along_axis(x, block_of, axis=1)
    selected = local_selections([tokens(s) for s in blocks], c.packing, c.config.compression_rate)
    return (o, selected, *([[tokens(x) for x in exported]] if c.export else []))


def shard_offset(c: Call):
    """A context shard's first position (`c.positions`, consecutive from a multiple of
    `b`, as `sharding` gives them), or None for whole sequences. Under `"previous"` its
    first block ranks with the shard before's rows (`c.rank_rows`): a ValueError
    otherwise (its whole blocks: the kernels' `check_shard_offset`)."""
    if c.positions is None and c.rank_rows is None:
        return None
    if c.rank_rows is None and c.config.block_source == "previous":
        raise ValueError("block_source='previous' in a context shard needs its ranking rows (rank_rows): its "
                         "first block ranks with the shard before's last queries")
    return jnp.zeros((), jnp.int32) if c.positions is None else c.positions[0].astype(jnp.int32)


def _block(q, k, v, c: Call, merge: str):
    """Block selection on the kernels: the blocks' selections, then the block family's
    merge `merge` and its backward; each token's lists are its block's. Packed rows:
    `_block_packed`."""
    if c.packing is not None:
        return _block_packed(q, k, v, c, merge)
    b, T = c.config.selection_block, q.shape[1]
    offset = shard_offset(c)
    blocks, exported = block_selections(q, zero_non_finite(k), zero_non_finite(v), c, offset)
    operands = block_operands(q, k, blocks, c.config, positions=c.positions)
    o = block_attention(q, k, v, operands, c.kernel_call(merge))[0]
    return (o, [per_token(s, b, T) for s in blocks], *([[per_token(x, b, T) for x in exported]] if c.export else []))


ROUTES = {
    "reference": Route(_reference, htree_attention_reference, None, support=REFERENCE),
    "reference_packed": Route(_reference_packed, htree_attention_reference_packed, None),
    "dense": Route(_dense, one_layer_attention, None, support=DENSE),
    "gqa": Route(_gqa, htree_forward_pallas, htree_backward_pallas, support=GQA),
    "wide": Route(_wide, wide_forward_pallas, wide_backward_pallas, given_layout=True, values_from_keys=True,
                  support=WIDE),
    **{f"block_{name}": Route(functools.partial(_block, merge=name),
                              functools.partial(block_forward_pallas, merge=name), block_backward_pallas,
                              support=MERGE_SUPPORT[name])
       for name in MERGES},
}
KERNEL_ROUTES = tuple(name for name, route in ROUTES.items() if route.backward is not None)


def support_matrix(routes: dict = ROUTES) -> str:
    """The support matrix of `docs/backends.md`: a column a route with a `Support`, a row
    a feature (`SUPPORT_ROWS`), as Markdown."""
    shown = [(name, route.support) for name, route in routes.items() if route.support is not None]
    lines = ["| | " + " | ".join(f"`{name}`" for name, _ in shown) + " |",
             "|---|" + "---|" * len(shown)]
    for field, label in SUPPORT_ROWS:
        lines.append(f"| {label} | " + " | ".join(getattr(s, field) for _, s in shown) + " |")
    return "\n".join(lines)


__all__ = ["Call", "KERNEL_ROUTES", "ROUTES", "Route", "Support", "block_ranking_rows", "support_matrix", "block_selections", "latent_values",
           "packed_block_selections", "per_token"]
