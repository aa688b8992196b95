"""The backend layer: which implementation runs a call, and the two calls every entry
point above it makes (`htree_attention`, decoding, the sharded wrappers, benchmarks):

- `attend`: a full sequence (or a context-parallel shard's queries) through the JAX
  reference or the Pallas kernels, the latter as a `jax.custom_vjp` whose backward is
  the Pallas backward; both under SPEC 10's guard for non-finite `k`, `v`.
- `attend_cache`: new queries walking a decode cache's tree (`htree_jax.decode`).

Backend names (one rule for both): `"auto"` (the Pallas kernels on a GPU where they take
the shapes, else the reference), `"reference"`, `"pallas"` (CUDA GPUs),
`"pallas_interpret"` (the same kernels interpreted, any platform: how CI tests them).
`choose_backend` turns a name into the concrete one: `"reference"`, `"pallas"` or
`"pallas_interpret"`.

Inputs here are validated by the caller (`htree_jax.core.validation`), with `q`, `k` in
`rope_layout` order (SPEC 7).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from htree_jax.core.config import HTreeConfig
from htree_jax.core.non_finite import dead_rows, first_non_finite, poison_rows, zero_non_finite
from htree_jax.core.one_layer import dense_eligible, one_layer, one_layer_attention
from htree_jax.core.packing import local_selections
from htree_jax.core.quantize import dequantize_rows
from htree_jax.core.rope import rope_layout
from htree_jax.reference import (
    attend_tree,
    default_query_chunk,
    htree_attention_reference,
    htree_attention_reference_packed,
)
from pallas_kernels.block.backward import block_backward_pallas
from pallas_kernels.block.forward import block_forward_pallas, block_static, check_merge_route
from pallas_kernels.block.merge import MAX_DIM as BLOCK_MAX_DIM
from pallas_kernels.decode.walk import attend_cache_pallas, check_pallas_decode_dims
from pallas_kernels.gqa.backward import htree_backward_pallas
from pallas_kernels.gqa.forward import htree_forward_pallas
from pallas_kernels.gqa.plan import check_pallas_dims
from pallas_kernels.shared.common import MAX_GROUP, check_query_layout
from pallas_kernels.shared.configs import BlockSizes, DecodeBlockSizes, KernelConfigs
from pallas_kernels.shared.dead_rows import poison_rows_in_place
from pallas_kernels.wide.backward import wide_backward_pallas
from pallas_kernels.wide.forward import FeatureSplit, wide_eligible, wide_forward_pallas

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


def full_sequence_backend(backend: str, dims, config: HTreeConfig | None = None, packed: bool = False) -> str:
    """`choose_backend` for `htree_attention` with `dims` (`core.validation.Dims`);
    block selection's rule (`block_selection_backend`) where `config` asks for it
    (`packed`: the call has `segment_ids`)."""
    if config is not None and config.selects_by_block:
        return block_selection_backend(backend, config, dims, packed)
    return choose_backend(backend, lambda name: check_pallas_dims(dims, name))


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
    heads (`check_ranking_rows`), on one device (a sharded cache decodes on the
    reference)."""
    check_ranking_rows(group, config, backend)
    if jax.device_count() > 1:
        raise ValueError(f"backend {backend!r}: decoding with selection_block={config.selection_block} (block "
                         f"selection) on {jax.device_count()} devices runs on the JAX reference only for now; use "
                         "backend='reference' or 'auto'")


def check_block_kernel_dims(dims, config: HTreeConfig, backend: str, packed: bool) -> None:
    """Block selection's kernels (SPEC 12, `pallas_kernels.block`): the per-query kernels'
    limits for the call (they choose each block's nodes on its ranking rows, and run the
    backward), heads up to `BLOCK_MAX_DIM` features, and for the ranking rows (`"previous"`: `b * G` rows a kv head), one
    document per row, one device (a context shard's blocks reach into the shard
    before it: the reference takes those)."""
    check_pallas_dims(dims, backend)
    if max(dims.head_dim, dims.value_dim) > BLOCK_MAX_DIM:
        raise ValueError(f"backend {backend!r}: block selection's kernels take K and V up to {BLOCK_MAX_DIM}, got "
                         f"K = {dims.head_dim}, V = {dims.value_dim}; backend='reference' takes larger heads")
    check_ranking_rows(dims.group_size, config, backend)
    if packed:
        raise ValueError(f"backend {backend!r}: selection_block={config.selection_block} (block selection) with "
                         "segment_ids runs on the JAX reference only for now; use backend='reference' or 'auto'")
    if jax.device_count() > 1:
        raise ValueError(f"backend {backend!r}: selection_block={config.selection_block} (block selection) on "
                         f"{jax.device_count()} devices runs on the JAX reference only for now; use "
                         "backend='reference' or 'auto'")


def block_selection_backend(backend: str, config: HTreeConfig, dims, packed: bool = False) -> str:
    """Block selection (SPEC 12, `config.selection_block > 1`) on full sequences: the
    block kernels where they take the call (`check_block_kernel_dims`), as for every
    other option ("auto": on a GPU, else the reference)."""
    return choose_backend(backend, lambda name: check_block_kernel_dims(dims, config, name, packed))


def query_positions(positions, q):
    """The queries' token positions `[S]` (`positions`, or `0 .. S-1`)."""
    return jnp.arange(q.shape[1], dtype=jnp.int32) if positions is None else positions


def pallas_forward_pass(q, k, v, config: HTreeConfig, block_sizes: BlockSizes | KernelConfigs | None = None,
                        interpret: bool = False, precisions=None, return_lse: bool = False, packing=None,
                        positions=None, return_importance: bool = False, value_dim: int | None = None,
                        q_layout: str = "rope_layout"):
    """The Pallas forward of the kernel family that takes the call, chosen here once:
    groups of 32 or more heads per kv head (latent attention; `v=None` reads the values
    from the keys) run the wide family (`pallas_kernels.wide.forward.wide_eligible`,
    `wide_forward_pallas`), every other group the per-query GQA family
    (`pallas_kernels.gqa.forward.htree_forward_pallas`, which says what the arguments
    and results are). Inputs validated by the caller."""
    H, K = q.shape[2], q.shape[-1]
    H_kv, V = k.shape[2], value_dim if v is None else v.shape[-1]
    tuning = KernelConfigs.resolve(block_sizes, K, V)
    if wide_eligible(H // H_kv, K, V, tuning, packing):
        return wide_forward_pallas(q, k, v, config, tuning, interpret, precisions, return_lse, value_dim,
                                   positions, return_importance, q_layout)
    return htree_forward_pallas(q, k, v, config, tuning, interpret, precisions, return_lse, packing, positions,
                                return_importance, value_dim, q_layout)


def pallas_backward_pass(q, k, v, o, lse, do, config: HTreeConfig,
                         block_sizes: BlockSizes | KernelConfigs | None = None, interpret: bool = False,
                         dead_rows=None, selections=None, packing=None, positions=None, value_dim: int | None = None,
                         q_layout: str = "rope_layout"):
    """`(dq, dk, dv)` from the Pallas backward of the family `pallas_forward_pass` runs
    for the same call: the wide family's (`pallas_kernels.wide.backward`, `dv=None` where
    the values are the keys') or the GQA family's
    (`pallas_kernels.gqa.backward.htree_backward_pallas`, which says what the arguments
    are). Inputs validated by the caller."""
    H, K = q.shape[2], q.shape[-1]
    H_kv = k.shape[2]
    V = value_dim if v is None else v.shape[-1]
    tuning = KernelConfigs.resolve(block_sizes, K, V)
    if wide_eligible(H // H_kv, K, V, tuning, packing):
        return wide_backward_pallas(q, k, v, o, lse, do, config, tuning, interpret, dead_rows, selections,
                                    value_dim, positions, q_layout)
    return htree_backward_pallas(q, k, v, o, lse, do, config, tuning, interpret, dead_rows, selections, packing,
                                 positions, value_dim, q_layout)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10))
def _pallas_forward(q, k, v, positions, packing, config, interpret, export, tuning, value_dim, q_layout):
    """`(o, selected)`, and the kept nodes' importance with `export` (SPEC 8; a constant
    under autodiff, as the selections are). `positions [S]`: the queries' positions among
    `k`'s tokens (None: all of them); `packing`: packed rows (selections then as tree
    rows, `packing.local_selections` makes them document-local). `v=None`: the values
    are the first `value_dim` latent features of `k`, which the wide kernels read from
    the keys (no copy in the forward; their gradient is in `dk`). `tuning`: the
    kernels' `KernelConfigs`; `q_layout`: q's feature order (`pallas_forward_pass`)."""
    o, selected, _, _, *exported = _guarded_pallas_forward(q, k, v, positions, packing, config, interpret, export,
                                                           tuning, value_dim, q_layout)
    return (o, selected, *exported)


def _guarded_pallas_forward(q, k, v, positions, packing, config, interpret, export, tuning, value_dim, q_layout):
    """The Pallas forward under SPEC 10's guard (`htree_jax.core.non_finite`), inside the
    `custom_vjp`: the zeroed `k`, `v` feed the forward's own padded copies and the NaN
    rows its output's last copy, and the output the backward saves is the one returned,
    so the guard adds no input- or output-sized buffer for the backward to keep. With
    the values inside the keys (`v=None`) a non-finite key row is a non-finite value row."""
    first = first_non_finite(k, k[..., :0] if v is None else v, jnp.arange(k.shape[1], dtype=jnp.int32))
    o, selected, lse, *exported = pallas_forward_pass(
        q, zero_non_finite(k), None if v is None else zero_non_finite(v), config, block_sizes=tuning,
        interpret=interpret, return_lse=True, positions=positions, packing=packing, return_importance=export,
        value_dim=value_dim, q_layout=q_layout)
    return (poison_rows(o, query_positions(positions, q), first), selected, lse, first, *exported)


def _pallas_forward_fwd(q, k, v, positions, packing, config, interpret, export, tuning, value_dim, q_layout):
    # Saved for the backward: inputs, output, the rows' log-sum-exp (O(T)), the first
    # non-finite positions and the selections (`tuning.save_selections`, else they
    # are recomputed there by the same kernels; always with packing, whose backward
    # reads them).
    o, selected, lse, first, *exported = _guarded_pallas_forward(q, k, v, positions, packing, config, interpret,
                                                                 export, tuning, value_dim, q_layout)
    saved = selected if tuning.save_selections or packing is not None else None
    return (o, selected, *exported), (q, k, v, positions, packing, o, lse, first, saved)


def _pallas_forward_bwd(config, interpret, export, tuning, value_dim, q_layout, residuals, cotangents):
    q, k, v, positions, packing, o, lse, first, saved = residuals
    do = cotangents[0]  # the selections are integers, the importance a constant: no cotangent
    # Rows set to NaN depend on nothing: no cotangent flows from them (and their NaN `o`
    # must not reach `delta`); entries of k, v zeroed by the guard get no gradient.
    dead = dead_rows(query_positions(positions, q), first, q.shape[2])
    dq, dk, dv = pallas_backward_pass(q, zero_non_finite(k), None if v is None else zero_non_finite(v), o, lse, do,
                                       config, block_sizes=tuning, interpret=interpret, dead_rows=dead,
                                       selections=saved, positions=positions, packing=packing, value_dim=value_dim,
                                       q_layout=q_layout)
    return (dq, *zero_late_tokens(dk, dv, first), None, None)


def zero_late_tokens(dk, dv, first):
    """`(dk, dv)` zero at and after each row's first non-finite position `first [B, H_kv]`
    (`dv` may be None).

    Tokens at or after `first` get no gradient: the entries the guard zeroed, and the
    rest of those tokens, whose gradient comes only from the dead rows (causal: only
    later queries merge a token or a node holding it) and is 0 already. Before `first`
    every entry is finite. So a mask by position is SPEC 10's per-entry mask, without
    a bool per entry of k and v kept from the forward to here (1 GiB at T=1M, H_kv=4,
    K=V=128: journal, 2026-11-27 (8))."""
    late = (jnp.arange(dk.shape[1], dtype=jnp.int32)[None, :, None] >= first[:, None, :])[..., None]
    zero = lambda x: None if x is None else jnp.where(late, jnp.zeros((), x.dtype), x)
    return zero(dk), zero(dv)


_pallas_forward.defvjp(_pallas_forward_fwd, _pallas_forward_bwd)


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


def block_selections(q, k, v, config: HTreeConfig, tuning: KernelConfigs, interpret: bool, export: bool):
    """`(selections, importance)` of every block (SPEC 12): the per-query kernels
    (`pallas_forward_pass`) run on each block's ranking rows at its first position choose
    what the block refines. Each `[B, ceil(T / b), H_kv, top_k]`, top layer first
    (importance `[]` without `export`). Their outputs are not used: the block merge
    recomputes every row's."""
    b = config.selection_block
    starts = jnp.arange(-(-q.shape[1] // b), dtype=jnp.int32) * b
    rows = jax.lax.stop_gradient(block_ranking_rows(q, k.shape[2], config))
    per_query = dataclasses.replace(config, selection_block=1)
    _, selected, *exported = pallas_forward_pass(rows, k, v, per_query, tuning, interpret, positions=starts,
                                                 return_importance=export)
    return selected, (exported[0] if export else [])


def check_block_merge(q, k, v, config: HTreeConfig, tuning: KernelConfigs, interpret: bool) -> None:
    """`tuning.block_merge` can run these shapes here (`check_merge_route`), checked
    before the blocks' selections run."""
    _, T, H, K = q.shape
    st = block_static(config, T, H // k.shape[2], K, v.shape[-1], q.dtype)
    check_merge_route(tuning.block_merge, st, K, v.shape[-1], q.dtype, interpret)


def per_token(block_values, b: int, T: int):
    """A block's lists for each of its tokens: `[B, NB, ...]` -> `[B, T, ...]`."""
    return jnp.repeat(block_values, b, axis=1)[:, :T]


def _guarded_block_forward(q, k, v, config, interpret, export, tuning):
    """Block selection's forward (`block_selections`, then `block_forward_pallas`) under
    SPEC 10's guard: `(o, blocks' selections, lse, first, blocks' importance)`."""
    T = k.shape[1]
    check_block_merge(q, k, v, config, tuning, interpret)
    first = first_non_finite(k, v, jnp.arange(T, dtype=jnp.int32))
    k, v = zero_non_finite(k), zero_non_finite(v)
    blocks, exported = block_selections(q, k, v, config, tuning, interpret, export)
    o, lse = block_forward_pallas(q, k, v, blocks, config, interpret, route=tuning.block_merge)
    return poison_rows(o, jnp.arange(T, dtype=jnp.int32), first), blocks, lse, first, exported


def _block_outputs(o, blocks, exported, config, T: int, export: bool):
    """`(o, selections, *importance)`, each token's lists its block's."""
    b = config.selection_block
    return (o, [per_token(s, b, T) for s in blocks], *([[per_token(x, b, T) for x in exported]] if export else []))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _block_forward(q, k, v, config, interpret, export, tuning):
    """`(o, selections, *importance)` with block selection (SPEC 12) on the kernels, each
    token's lists its block's; the backward is the block family's
    (`block_backward_pallas`)."""
    o, blocks, _, _, exported = _guarded_block_forward(q, k, v, config, interpret, export, tuning)
    return _block_outputs(o, blocks, exported, config, q.shape[1], export)


def _block_forward_fwd(q, k, v, config, interpret, export, tuning):
    o, blocks, lse, first, exported = _guarded_block_forward(q, k, v, config, interpret, export, tuning)
    return _block_outputs(o, blocks, exported, config, q.shape[1], export), (q, k, v, o, lse, first, blocks)


def _block_forward_bwd(config, interpret, export, tuning, residuals, cotangents):
    q, k, v, o, lse, first, blocks = residuals
    T = q.shape[1]
    dead = dead_rows(jnp.arange(T, dtype=jnp.int32), first, q.shape[2])
    dq, dk, dv = block_backward_pallas(q, zero_non_finite(k), zero_non_finite(v), o, lse, cotangents[0], blocks,
                                       config, interpret, dead)
    return (dq, *zero_late_tokens(dk, dv, first))


_block_forward.defvjp(_block_forward_fwd, _block_forward_bwd)


def latent_values(k, config: HTreeConfig, value_dim: int):
    """The values that are the first `value_dim` latent (unrotated) features of `k [B, T,
    H_kv, K]` (`rope_layout` order): what `v=None` stands for (`htree_attention`)."""
    K = k.shape[-1]
    return FeatureSplit(K, config.partial_rope(K) or K).values(k, value_dim)


@functools.partial(jax.jit, static_argnames=("config", "impl", "export", "block_sizes", "value_dim", "q_layout"))
def attend(q, k, v, config: HTreeConfig, impl: str, packing=None, positions=None, export: bool = False,
           block_sizes: BlockSizes | None = None, value_dim: int | None = None, q_layout: str = "rope_layout",
           rank_rows=None):
    """htree attention of validated `q [B, S, H, K]`, `k [B, T, H_kv, K]`, `v [B, T, H_kv,
    V]` (`q`, `k` in `rope_layout` order; `q_layout="given"`: `q` in the caller's order,
    which the wide kernels read as it is, no permuted copy of q; elsewhere it is permuted
    here) on the concrete backend `impl`
    (`choose_backend`). Returns `(o [B, S, H, V], selections)`, and the kept nodes'
    importance last with `export` (SPEC 8).

    SPEC 10's guard (`htree_jax.core.non_finite`): non-finite `k`, `v` entries zeroed,
    outputs NaN from the first such position on. Packed rows (`packing`,
    `htree_jax.core.packing.Packing`) that do not fit their static layout answer NaN;
    their selections are counted inside each token's document. `positions [S]` int32: the
    queries' positions among `k`'s `T` tokens (a context-parallel shard's queries;
    `None`: `S = T`). `block_sizes`: the Pallas kernels' tiling (`BlockSizes`, None:
    the tuned values; `configs.KernelConfigs.resolve`). `v=None` with `value_dim`: the values are the first
    `value_dim` latent features of `k`, read from the keys by the wide kernels
    (`pallas_kernels.wide.forward.wide_eligible`; elsewhere they are copied out first).
    `rank_rows`: block selection's ranking rows (SPEC 12) of a context shard, whose
    blocks may start in the shard before (`reference.attend_tree`); None: from `q`."""
    tuning = KernelConfigs.resolve(block_sizes, q.shape[-1], value_dim if v is None else v.shape[-1])
    wide = impl != "reference" and wide_eligible(q.shape[2] // k.shape[2], q.shape[-1],
                                                 value_dim if v is None else v.shape[-1], tuning, packing)
    # A one-layer tree is causal attention: RoPE, then cuDNN (no selections, no
    # importance to export), under SPEC 10's guard.
    dense_one_layer = (v is not None and impl == "pallas" and packing is None and positions is None
                       and one_layer(config, k.shape[1]) and dense_eligible(q, k, v))
    check_query_layout(q_layout, wide=True)
    if config.selects_by_block and impl != "reference" and not one_layer(config, k.shape[1]):
        if packing is not None or positions is not None or rank_rows is not None:
            raise ValueError("block selection's kernels take whole sequences of one document a row "
                             "(no packing, no context shards): backend='reference' takes the others")
        if q_layout == "given":
            q = rope_layout(q, config.partial_rope(q.shape[-1]))
        v = latent_values(k, config, value_dim) if v is None else v
        o, selected, *exported = _block_forward(q, k, v, config, impl == "pallas_interpret", export, tuning)
        return (o, selected, *(jax.lax.stop_gradient(x) for x in exported))
    if q_layout == "given" and (dense_one_layer or not wide):
        q, q_layout = rope_layout(q, config.partial_rope(q.shape[-1])), "rope_layout"
    if v is None:
        if wide:
            o, selected, *exported = _pallas_forward(q, k, None, positions, packing, config,
                                                     impl == "pallas_interpret", export, tuning, value_dim, q_layout)
            return (o, selected, *(jax.lax.stop_gradient(x) for x in exported))
        v = latent_values(k, config, value_dim)
    if dense_one_layer:
        first = first_non_finite(k, v, jnp.arange(k.shape[1], dtype=jnp.int32))
        # cuDNN named: left to choose (None), jax took XLA's dense attention there, which
        # holds a `[B, H, T, T]` array (journal, 2026-11-26 (7)).
        o = one_layer_attention(q, zero_non_finite(k), zero_non_finite(v), config,
                                implementation="cudnn" if jax.default_backend() == "gpu" else None)
        # On the GPU the poisoned rows are written in place (`pallas_kernels.shared.dead_rows`:
        # nothing is read or written with finite inputs), not with a pass over `o`.
        o = (poison_rows_in_place(o, first) if jax.default_backend() == "gpu"
             else poison_rows(o, query_positions(None, q), first))
        return (o, []) + (([],) if export else ())
    if impl != "reference":
        o, selected, *exported = _pallas_forward(q, k, v, positions, packing, config, impl == "pallas_interpret",
                                                 export, tuning, None, q_layout)
        if packing is not None:
            selected = local_selections(selected, packing, config.compression_rate)
    else:
        first = first_non_finite(k, v, jnp.arange(k.shape[1], dtype=jnp.int32))
        k, v = zero_non_finite(k), zero_non_finite(v)
        if packing is None:
            o, selected, *exported = htree_attention_reference(q, k, v, config, positions=positions,
                                                               return_importance=export, rank_rows=rank_rows)
        else:
            o, selected, *exported = htree_attention_reference_packed(q, k, v, packing, config,
                                                                      return_importance=export)
        o = poison_rows(o, query_positions(positions, q), first)
    if packing is not None:
        o = jnp.where(packing.fits[:, None, None, None], o, jnp.asarray(jnp.nan, o.dtype))
    exported = [jax.lax.stop_gradient(x) for x in exported]
    return (o, selected, *exported)


@functools.partial(jax.jit, static_argnames=("config", "impl", "block_sizes", "value_dim"))
def attend_cache(q, keys, values, radii, positions, config: HTreeConfig, impl: str,
                 block_sizes: DecodeBlockSizes | None = None, value_dim: int = 0, scales=(), rank_rows=None,
                 chosen=()):
    """Queries `q [B, S, H, K]` (in `rope_layout` order) at `positions [B, S]` over a
    decode cache's tree layers (`keys`, `values`, bottom first, un-rotated; `radii` of
    layers 1.. with `selection="bound"`, else `()`), on the concrete backend `impl`
    (the Pallas kernels' `block_sizes`, None: the defaults): `(o [B, S, H, V],
    selections)`. `value_dim > 0`: `values` is `()`, the values are the keys' first
    `value_dim` latent features (the kernels read them from the gathered keys).
    `scales` (FP8 tokens, `htree_jax.core.quantize`): layer 0's keys (and values) are
    e4m3, these their float32 row scales `[B, H_kv, N_0]`; the reference reads them
    back in q's dtype, the kernels scale each token's score and weight. Block selection
    (SPEC 12): `rank_rows [B, S, H_kv, R, K]`, each query's ranking rows
    (`reference.block_rows` over the cache's recent queries and `q`), which the
    reference ranks with; the kernels keep `chosen` (every layer's kept nodes above 0,
    top first, `[B, S, H_kv, top_k]`: `rank_cache`'s, or a cache's) or, where it is
    empty, make them with `rank_cache`."""
    if impl != "reference":
        if config.selects_by_block and rank_rows is not None and not chosen:
            chosen = rank_cache(rank_rows, keys, values, radii, positions, config, impl, block_sizes, value_dim,
                                scales)
        # One new token is the newest in the cache: nothing after it can be NaN, so the
        # decode kernels need not zero the values it does not merge (SPEC 10).
        return attend_cache_pallas(q, keys, values, positions, config, block_sizes or DecodeBlockSizes(),
                                   interpret=impl == "pallas_interpret", zero_unmerged=q.shape[1] > 1,
                                   radii=tuple(radii), value_dim=value_dim, scales=tuple(scales),
                                   chosen=tuple(chosen))
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
    return attend_tree(q, layers, positions, config, chunk, keys_rotated=False, rank_rows=rank_rows)


def rank_cache(rank_rows, keys, values, radii, positions, config: HTreeConfig, impl: str,
               block_sizes: DecodeBlockSizes | None = None, value_dim: int = 0, scales=()):
    """Block selection (SPEC 12) on the decode kernels: each query's kept nodes of every
    layer above 0 (top first, `[B, S, H_kv, top_k]`), those its ranking rows `rank_rows
    [B, S, H_kv, R, K]` keep when they walk the cache as one query's `R` heads at the
    first position of the query's block (`positions [B, S]`). The walk's outputs are
    not used: it is the block's selection that is wanted. The cache may hold tokens
    after that position (later tokens of the block): with `strict_causal` they sit in
    the rightmost nodes only, which are kept whatever they hold and rank nothing."""
    B, S, H_kv, R, K = rank_rows.shape
    starts = positions - positions % config.selection_block
    _, selections = attend_cache_pallas(rank_rows.reshape(B, S, H_kv * R, K), keys, values, starts, config,
                                        block_sizes or DecodeBlockSizes(), interpret=impl == "pallas_interpret",
                                        radii=tuple(radii), value_dim=value_dim, scales=tuple(scales))
    return tuple(selections)
