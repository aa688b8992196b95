"""`htree_attention`: the public entry point (validation, then backend dispatch)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from htree_jax.config import HTreeConfig
from htree_jax.non_finite import dead_rows, first_non_finite, poison_rows, zero_non_finite
from htree_jax.packing import (
    check_fits,
    check_max_documents,
    check_segment_ids,
    local_selections,
    pack_layout,
    virtual_length,
)
from htree_jax.reference import htree_attention_reference, htree_attention_reference_packed
from htree_jax.rope import rope_layout
from htree_jax.validation import check_config, check_qkv

# "auto": the Pallas kernels on a GPU where they support the shapes, else the reference
# (`pick_backend`).
BACKENDS = ("auto", "reference", "pallas", "pallas_interpret")


def resolve_backend(backend: str, interpret: bool = False, dims=None) -> str:
    """The concrete backend that `backend` (and `interpret`) name on this platform for
    `htree_attention`; `dims` (from `check_qkv`) are checked against the Pallas kernels'
    limits (`pick_backend`)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")

    def check_dims():
        if dims is not None:
            from pallas_kernels.forward import check_pallas_dims

            check_pallas_dims(dims)

    return pick_backend(backend, interpret, check_dims)


def pick_backend(backend: str, interpret: bool, check_dims) -> str:
    """The rule shared by `htree_attention` and decoding: "reference", "pallas" or
    "pallas_interpret" for a valid `backend` name. `check_dims()` raises a ValueError
    where the kernels do not support the shapes.

    "auto" is the Pallas kernels on a GPU where they support the shapes (faster than
    the reference at every size measured, benchmarks/RESULTS.md), else the reference.
    `interpret=True` asks for the Pallas kernels interpreted: with "auto" or "pallas" it
    gives "pallas_interpret" (on every platform); "reference" has no kernels to
    interpret, so it is refused there rather than ignored. "pallas" off a GPU is refused
    with a pointer to "pallas_interpret"."""
    if check_interpret(backend, interpret) or backend == "pallas_interpret":
        check_dims()
        return "pallas_interpret"
    if backend == "auto":
        if jax.default_backend() != "gpu":
            return "reference"
        try:
            check_dims()
        except ValueError:
            return "reference"
        return "pallas"
    if backend == "pallas":
        if jax.default_backend() != "gpu":
            raise ValueError(
                "backend 'pallas' needs a CUDA GPU (Triton lowering); on "
                f"{jax.default_backend()!r} use backend='pallas_interpret' (or interpret=True) "
                "to run the same kernels interpreted"
            )
        check_dims()
    return backend


def check_interpret(backend: str, interpret) -> bool:
    """`interpret` must be a bool, and True only with a backend that has Pallas kernels
    to interpret ("auto", "pallas", "pallas_interpret"); returns it."""
    if not isinstance(interpret, bool):
        raise TypeError(f"interpret must be a bool, got {interpret!r}")
    if interpret and backend == "reference":
        raise ValueError("interpret=True runs the Pallas kernels interpreted; backend='reference' has none "
                         "(use backend='pallas_interpret', or interpret=False)")
    return interpret


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _pallas_forward(q, k, v, positions, packing, config, interpret, export=False):
    """`(o, selected)`, and the kept nodes' importance with `export` (SPEC 8; a constant
    under autodiff, as the selections are). `positions [S]`: the queries' positions among
    `k`'s tokens (None: all of them); `packing`: packed rows (selections then as tree
    rows, `packing.local_selections` makes them document-local)."""
    o, selected, _, _, *exported = _guarded_pallas_forward(q, k, v, positions, packing, config, interpret, export)
    return (o, selected, *exported)


def query_positions(positions, q):
    """The queries' token positions `[S]` (`positions`, or `0 .. S-1`)."""
    return jnp.arange(q.shape[1], dtype=jnp.int32) if positions is None else positions


def _guarded_pallas_forward(q, k, v, positions, packing, config, interpret, export=False):
    """The Pallas forward under SPEC 10's guard (`htree_jax.non_finite`), inside the
    `custom_vjp`: the zeroed `k`, `v` feed the forward's own padded copies and the NaN
    rows its output's last copy, and the output the backward saves is the one returned,
    so the guard adds no input- or output-sized buffer for the backward to keep."""
    from pallas_kernels.forward import htree_forward_pallas

    first = first_non_finite(k, v, jnp.arange(k.shape[1], dtype=jnp.int32))
    o, selected, lse, *exported = htree_forward_pallas(q, zero_non_finite(k), zero_non_finite(v), config,
                                                       interpret=interpret, return_lse=True, positions=positions,
                                                       packing=packing, return_importance=export)
    return (poison_rows(o, query_positions(positions, q), first), selected, lse, first, *exported)


def _pallas_forward_fwd(q, k, v, positions, packing, config, interpret, export=False):
    # Saved for the backward: inputs, output, the rows' log-sum-exp (O(T)), the first
    # non-finite positions and the selections (`BlockSizes.save_selections`, else they
    # are recomputed there by the same kernels; always with packing, whose backward
    # reads them).
    from pallas_kernels.forward import BlockSizes

    o, selected, lse, first, *exported = _guarded_pallas_forward(q, k, v, positions, packing, config, interpret,
                                                                 export)
    saved = selected if BlockSizes().save_selections or packing is not None else None
    return (o, selected, *exported), (q, k, v, positions, packing, o, lse, first, saved)


def _pallas_forward_bwd(config, interpret, export, residuals, cotangents):
    from pallas_kernels.backward import htree_backward_pallas

    q, k, v, positions, packing, o, lse, first, saved = residuals
    do = cotangents[0]  # the selections are integers, the importance a constant: no cotangent
    # Rows set to NaN depend on nothing: no cotangent flows from them (and their NaN `o`
    # must not reach `delta`); entries of k, v zeroed by the guard get no gradient.
    dead = dead_rows(query_positions(positions, q), first, q.shape[2])
    dq, dk, dv = htree_backward_pallas(q, zero_non_finite(k), zero_non_finite(v), o, lse, do, config,
                                       interpret=interpret, dead_rows=dead, selections=saved, positions=positions,
                                       packing=packing)
    dk = jnp.where(jnp.isfinite(k), dk, jnp.zeros((), dk.dtype))
    dv = jnp.where(jnp.isfinite(v), dv, jnp.zeros((), dv.dtype))
    return dq, dk, dv, None, None


_pallas_forward.defvjp(_pallas_forward_fwd, _pallas_forward_bwd)


def htree_attention(
    q,
    k,
    v,
    config: HTreeConfig | None = None,
    *,
    segment_ids=None,
    max_documents: int | None = None,
    max_document_len: int | None = None,
    backend: str = "auto",
    return_selected: bool = False,
    return_importance: bool = False,
    interpret: bool = False,
):
    """Hierarchical sparse (htree) attention, causal, with RoPE applied inside.

    Args:
      q: `[B, T, H, K]` queries, un-rotated.
      k: `[B, T, H_kv, K]` keys, un-rotated; `H % H_kv == 0`, `K` even.
      v: `[B, T, H_kv, V]` values.
        q, k, v share one dtype: float32, bfloat16 or float16.
      config: an `HTreeConfig` (default `HTreeConfig()`), static under `jax.jit`.
      segment_ids: int32 `[B, T]` (optional), packed documents (SPEC 6): a document is
        a maximal run of equal consecutive ids, and each is attended as a sequence of
        its own (its own tree; positions, hence RoPE, counted from its start). Padding
        is one more document whose outputs you ignore. `None`: one document per row.
      max_documents: the static cap of documents per row that the packed layout holds
        (`htree_jax/packing.py`: the tree is laid out with each document aligned to
        `r^(L-1)` tokens, `T + max_documents * (r^(L-1) - 1)` tokens of tree at most);
        `None`: `T // r^(L-1)` (a tree of at most `2T` tokens). A row with more raises
        `ValueError` when `segment_ids` is concrete, and answers NaN under `jit`.
      max_document_len: the static cap of a document's length (`None`: `T`). The tree
        then has the layers a document of that length needs (`config.num_layers`), not
        those of `T`: less work and less padding when documents are short (at T=131072,
        `top_k=64`, documents of 16384 tokens take 2 layers instead of 3). Longer
        documents: as for `max_documents`.
      backend: `"auto"` (`"pallas"` on a GPU when the shapes allow it, else the reference),
        `"reference"` (the jittable JAX reference), `"pallas"` (Pallas-Triton kernels,
        CUDA GPUs; K in [32, 576], V in [32, 512] (padded inside to powers of two); up
        to 16 query heads per kv head, or a multiple of 16 up to 128) or
        `"pallas_interpret"` (the same kernels interpreted, any platform; slow).
      return_selected: also return the nodes selected for refinement at every layer
        `l >= 1` (the parent lists of the layer below), top layer first: a list of
        `L - 1` int32 arrays `[B, T, H_kv, top_k]`, ascending, `-1` padded (empty
        when `T <= top_k * compression_rate`, where htree is exact attention). With
        `segment_ids` the nodes are counted inside each token's document.
      return_importance: also return, last, the importance of every selected node
        (SPEC 8): per selecting layer, top first, float32 `[B, T, H_kv, top_k]`
        aligned with the selections (0 where they are `-1`): the group-summed attention
        probability of the node (`importance="softmax"`: each head's softmax over the
        layer's candidates, summed over the G heads of the group; the rightmost node
        reports its own value, not the forced one: with `strict_causal` it is outside
        the normaliser, so its value may exceed G). It is the distillation target of
        sparse-attention indexers (seed 003: DeepSeek's indexer is trained towards this
        head-summed distribution): e.g. a KL loss between an indexer's scores over the
        kept nodes and `importance / G`. A constant under autodiff, like the selections.

      interpret: run the Pallas kernels in interpret mode (with `backend="auto"` or
        `"pallas"`: the same as `"pallas_interpret"`); refused with `"reference"`.

    Non-finite inputs (SPEC 10): a NaN or infinity in `k` or `v` at position `p` changes
    no output before `p`; every output row of that kv head's group from `p` on is NaN,
    as in dense causal attention (`htree_jax/non_finite.py`); with `segment_ids` the
    rows from `p` on in later documents of the row too (SPEC 10 leaves them open).

    Gradients (`jax.grad`, every backend) treat the selections as constants (SPEC 5):
    they flow through the scores and values of the merged nodes and down the pooling.
    The Pallas backend's are bitwise deterministic (no atomics: key and value gradients
    are summed per tree node in a fixed order). The reference differentiates by XLA
    autodiff; on a GPU its gathers' transposes are scatter-adds, reproducible only under
    XLA's `--xla_gpu_deterministic_ops=true`.

    Returns:
      `o [B, T, H, V]` in the input dtype, then `selected` with `return_selected`, then
      `importance` with `return_importance` (a tuple when either is asked).
    """
    config = check_config(config)
    dims = check_qkv(q, k, v)
    config.check_rope_dim(dims.head_dim)
    impl = resolve_backend(backend, interpret, dims)
    for name, flag in (("return_selected", return_selected), ("return_importance", return_importance)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    packing, segment_ids = packing_of(segment_ids, max_documents, config, dims.batch, dims.seq_len,
                                      max_document_len)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    # Partial RoPE (SPEC 7) as full rotate-half RoPE on permuted features (`rope_layout`).
    q, k = rope_layout(q, config.partial_rope(dims.head_dim)), rope_layout(k, config.partial_rope(dims.head_dim))
    exported = ()
    if jax.device_count() > 1 and not return_importance:
        # Sharded inputs: one local call per shard (`htree_jax/sharding.py`). (The
        # importance export is not partitioned yet: with it, the plain call.)
        from htree_jax.sharding import partitioned_attention

        o, selected = partitioned_attention(q, k, v, config, impl, segment_ids, None if packing is None else
                                            packing.virtual_len, max_document_len)
    else:
        o, selected, *exported = _attend(q, k, v, config, impl, packing, export=return_importance)
    result = (o,) + ((selected,) if return_selected else ()) + tuple(exported)
    return result if len(result) > 1 else o


def packing_of(segment_ids, max_documents, config: HTreeConfig, batch: int, seq_len: int, max_document_len=None):
    """`(packing, segment_ids)`: the packed layout of `segment_ids` and the ids as int32
    (None, None without), checked: bad shapes, dtypes and (eagerly) rows beyond the
    static caps are errors before any kernel runs."""
    check_max_documents(max_documents, max_document_len, seq_len)
    if segment_ids is None:
        if max_documents is not None or max_document_len is not None:
            raise ValueError("max_documents and max_document_len cap packed documents: they need segment_ids")
        return None, None
    segment_ids = check_segment_ids(segment_ids, batch, seq_len)
    packing = pack_layout(segment_ids, config, virtual_length(config, seq_len, max_documents, max_document_len),
                          max_document_len)
    check_fits(packing, segment_ids, max_documents, max_document_len)
    return packing, segment_ids


@functools.partial(jax.jit, static_argnames=("config", "impl", "export"))
def _attend(q, k, v, config: HTreeConfig, impl: str, packing=None, positions=None, export: bool = False):
    """The chosen backend under SPEC 10's guard (`htree_jax.non_finite`): non-finite `k`,
    `v` entries zeroed, outputs NaN from the first such position on. Packed rows
    (`packing`) that do not fit their static layout answer NaN. `positions [S]` int32:
    the queries' positions among `k`'s `T` tokens (`q [B, S, H, K]`: a context-parallel
    shard's queries; `None`: `S = T`). `export`: the kept nodes' importance last
    (SPEC 8)."""
    if impl != "reference":
        o, selected, *exported = _pallas_forward(q, k, v, positions, packing, config, impl == "pallas_interpret",
                                                 export)
        if packing is not None:
            selected = local_selections(selected, packing, config.compression_rate)
    else:
        first = first_non_finite(k, v, jnp.arange(k.shape[1], dtype=jnp.int32))
        k, v = zero_non_finite(k), zero_non_finite(v)
        if packing is None:
            o, selected, *exported = htree_attention_reference(q, k, v, config, positions=positions,
                                                               return_importance=export)
        else:
            o, selected, *exported = htree_attention_reference_packed(q, k, v, packing, config,
                                                                      return_importance=export)
        o = poison_rows(o, query_positions(positions, q), first)
    if packing is not None:
        o = jnp.where(packing.fits[:, None, None, None], o, jnp.asarray(jnp.nan, o.dtype))
    exported = [jax.lax.stop_gradient(x) for x in exported]
    return (o, selected, *exported)
