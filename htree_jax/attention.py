"""`htree_attention`: the public entry point (validation, then backend dispatch)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from htree_jax.backends import attend, check_block_kernels, check_block_sizes, full_sequence_plan
from htree_jax.core.config import HTreeConfig
from htree_jax.core.indexer import Index, check_index
from htree_jax.core.one_layer import fitted_to_length
from htree_jax.core.packing import check_fits, check_max_documents, check_segment_ids, pack_layout, virtual_length
from htree_jax.core.rope import rope_layout
from htree_jax.core.validation import as_jax_takes_it, check_config, check_latent_value_dim, check_qkv
from htree_jax.routes import latent_values
from htree_jax.sharding import partitioned_attention
from pallas_kernels.shared.configs import BlockSizes
from pallas_kernels.shared.kernels import BlockKernels


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
    block_sizes: BlockSizes | None = None,
    value_dim: int | None = None,
    index: Index | None = None,
    block_kernels: BlockKernels | None = None,
):
    """Hierarchical sparse (htree) attention, causal, with RoPE applied inside.

    Args:
      q: `[B, T, H, K]` queries, un-rotated.
      k: `[B, T, H_kv, K]` keys, un-rotated; `H % H_kv == 0`, `K` even.
      v: `[B, T, H_kv, V]` values; or None with `value_dim=V`: the values are the first
        `V` features of `k`, un-rotated (DeepSeek's absorbed latent attention: `k` the
        512-feature latent followed by its 64 RoPE features, `rope_dim=64`, `v` the
        latent, `value_dim=512`). `V <= K - rope_dim`. The Pallas kernels for groups of
        32 or more heads read them from `k` without a copy (the backward copies them
        once); every other path copies them out first.
        q, k, v share one dtype: float32, bfloat16 or float16.
      config: an `HTreeConfig` (default `HTreeConfig()`), static under `jax.jit`.
      segment_ids: int32 `[B, T]` (optional), packed documents (SPEC 6): a document is
        a maximal run of equal consecutive ids, and each is attended as a sequence of
        its own (its own tree; positions, hence RoPE, counted from its start). Padding
        is one more document whose outputs you ignore. `None`: one document per row.
      max_documents: the static size of the packed layout, in documents' worth of alignment
        padding (`htree_jax/core/packing.py`: the tree is laid out with each document aligned to
        `r^(L-1)` tokens, `T + max_documents * (r^(L-1) - 1)` tokens of tree at most);
        `None`: `T // r^(L-1)` (a tree of at most `2T` tokens). It sizes the layout, not
        a count: a row fits when its documents, each started at a multiple of `r^(L-1)`,
        fit those tokens, so a row of more documents fits where they leave less padding.
        A row that does not fit raises `ValueError` when `segment_ids` is concrete, and
        answers NaN under `jit`.
      max_document_len: the static cap of a document's length (`None`: `T`). The tree
        then has the layers a document of that length needs (`config.num_layers`), not
        those of `T`: less work and less padding when documents are short (at T=131072,
        `top_k=64`, documents of 16384 tokens take 2 layers instead of 3). Longer
        documents: as for `max_documents`.
      backend: `"auto"` (`"pallas"` on a GPU when the shapes allow it, else the reference),
        `"reference"` (the jittable JAX reference), `"pallas"` (the Pallas kernels, CUDA
        GPUs; per-query selection, `selection_block=1`: K in [32, 576], V in [32, 512]
        (padded inside to powers of two); block selection, the default: K and V up to
        256, larger heads on `"reference"`; up to 16 query heads per kv head, or a
        multiple of 16 up to 128) or
        `"pallas_interpret"` (the same kernels interpreted, any platform; slow: how CI
        tests them).
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
      value_dim: with `v=None`, how many leading features of `k` are the values.
      index: with `config.selection="indexer"` (SPEC 13), the learned indexer's inputs,
        `htree_jax.Index(q=[B, T, H_I, D_I], k=[B, T, H_ik, D_I], w=[B, T, H_I])`
        (`H_ik` 1 or `H_kv`): every layer above 0 ranks its candidates by `sum_i w_i *
        relu(q_i . k_node)` over the index keys' tree, and SPEC 13's loss comes back
        last, float32 `[B, T, H_kv]`: per query and kv head, the KL divergence from the
        attention's own group-summed distribution over each layer's candidates to the
        softmax of the index scores, summed over the layers (add its mean to the training
        loss; its gradient reaches `index` only, and the output's reaches `q, k, v`
        only). The reference backend only, one document a row, not sharded (each
        refused by name otherwise); zeros where the tree has one layer.
      block_sizes: the Pallas kernels' tiling and launch parameters
        (`htree_jax.BlockSizes`, static; `None`, and each field left `None`: the tuned
        value for the head dims). The reference ignores them.
      block_kernels: which kernel runs each part of block selection (`htree_jax.
        BlockKernels`: the merge, the backward's walk, its sums and their kernel;
        static; `None`, and each field `"auto"`: the plan's choice, the fastest measured
        where it takes the call). A kernel asked for that cannot take the call is a
        ValueError naming the rule. Other selections and the reference ignore it.

    Non-finite inputs (SPEC 10): a NaN or infinity in `k` or `v` at position `p` changes
    no output before `p`; every output row of that kv head's group from `p` on is NaN,
    as in dense causal attention (`htree_jax/core/non_finite.py`); with `segment_ids` the
    rows from `p` on in later documents of the row too (SPEC 10 leaves them open).

    Gradients (`jax.grad`, every backend) treat the selections as constants (SPEC 5):
    they flow through the scores and values of the merged nodes and down the pooling.
    Which are bitwise the same run to run (`docs/backends.md`, "Determinism"):
    - per-query selection on the Pallas kernels (`selection_block=1`, the GQA and wide
      families): all three, no atomics (key and value gradients are summed per tree
      node in a fixed order);
    - block selection on the Pallas kernels (`selection_block > 1`, `HTreeConfig()`'s
      default): `dq` is, and on a GPU `dk` and `dv` are too (`BlockKernels.sums=
      "auto"`): each block's sums written out as partial sums, each node's summed over
      the blocks that merged it in block order, with up to
      `BlockConfig.backward_partial_bytes` (16 GiB) more memory; interpreted, or with
      `block_kernels=BlockKernels(sums="atomics")`, they are added into the nodes with
      float32 atomics, in no fixed order (they may differ in the last bits);
    - the reference: XLA autodiff; on a GPU its gathers' transposes are scatter-adds,
      reproducible only under XLA's `--xla_gpu_deterministic_ops=true`.
    The selections themselves are a hard top-K: a near-tie of two nodes' importances may
    flip with the batch size, the dtype or the backend (README, "Hard selection").

    Returns:
      `o [B, T, H, V]` in the input dtype, then `selected` with `return_selected`, then
      `importance` with `return_importance`, then SPEC 13's loss with `index` (a tuple
      when any is asked).
    """
    config = check_config(config)
    q, k, v = (as_jax_takes_it(x) for x in (q, k, v))
    latent = v is None
    if latent:
        v = values_stand_in(k, value_dim, config)  # shape and dtype, for the checks
    elif value_dim is not None:
        raise ValueError("value_dim is for v=None (the values read from k); with v given it must be None")
    dims = check_qkv(q, k, v)
    config.check_rope_dim(dims.head_dim)
    check_block_sizes(block_sizes)
    check_block_kernels(block_kernels)
    # One layer is causal attention whatever top_k is: no buffer sized by a larger top_k.
    config = fitted_to_length(config, dims.seq_len)
    packed = segment_ids is not None
    packing, segment_ids = packing_of(segment_ids, max_documents, config, dims.batch, dims.seq_len,
                                      max_document_len)
    # What runs the call, decided once here (the backend, the route, block selection's
    # ranking route, merge, backward walk and sum, over the packed layout where there is
    # one) and passed down: nothing below chooses again.
    plan = full_sequence_plan(backend, dims, config, packed=packed, dtype=q.dtype, latent=latent,
                              block_sizes=block_sizes, packing=packing, kernels=block_kernels)
    for name, flag in (("return_selected", return_selected), ("return_importance", return_importance)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    check_indexer_call(index, config, q, k, packed=packed, latent=latent, return_importance=return_importance)
    q, k = jnp.asarray(q), jnp.asarray(k)
    v = None if latent else jnp.asarray(v)
    # Partial RoPE (SPEC 7) as full rotate-half RoPE on permuted features (`rope_layout`).
    # q is left as given for `attend`, which permutes it unless the wide kernels take the
    # call (they slice each chunk's parts from q as it is: no permuted copy of q, 18 GiB
    # at the latent shape at T=128K).
    R = config.partial_rope(dims.head_dim)
    k = rope_layout(k, R)
    exported = ()
    if jax.device_count() > 1 and not return_importance and index is None:
        q = rope_layout(q, R)
        if latent:  # the sharded calls take the values as an array
            v = latent_values(k, config, value_dim)
        # Sharded inputs: one local call per shard (`htree_jax/sharding.py`). (The
        # importance export is not partitioned yet: with it, the plain call.)
        # `backend="auto"`: a context shard that block selection's kernels cannot take
        # (part of a block) runs on the reference (`sharding.context_backend`); a kernel
        # backend named is refused.
        o, selected = partitioned_attention(q, k, v, config, plan.impl, segment_ids, None if packing is None else
                                            packing.virtual_len, max_document_len, block_sizes,
                                            context_impl="reference" if backend == "auto" else None,
                                            block_kernels=block_kernels)
    else:
        # (The importance export and the indexer are not partitioned yet: with either, the plain call.)
        o, selected, *exported = attend(q, k, v, config, plan, packing, export=return_importance,
                                        block_sizes=block_sizes, value_dim=value_dim if latent else None,
                                        q_layout="given", index=index)
    result = (o,) + ((selected,) if return_selected else ()) + tuple(exported)
    return result if len(result) > 1 else o


def check_indexer_call(index, config: HTreeConfig, q, k, *, packed: bool, latent: bool,
                       return_importance: bool) -> None:
    """`index` goes with `selection="indexer"` and only with it (SPEC 13), fitted to `q`
    and `k` (`core.indexer.check_index`); what the indexer does not take yet is refused
    by name: packed rows, `v=None`, the importance export."""
    if (config.selection == "indexer") != (index is not None):
        raise ValueError("index (htree_jax.Index) goes with HTreeConfig(selection='indexer'), and only with it (SPEC "
                         f"13): selection={config.selection!r}, index {'given' if index is not None else 'None'}")
    if index is None:
        return
    check_index(index, q, k)
    for name, asked in (("segment_ids", packed), ("v=None", latent), ("return_importance", return_importance)):
        if asked:
            raise ValueError(f"selection='indexer' (SPEC 13) does not take {name} yet: one document a row, the "
                             "values given; its training signal is the loss it returns")


def values_stand_in(k, value_dim, config: HTreeConfig):
    """`v=None`: `value_dim` checked (a positive int, at most the unrotated features `K -
    rope_dim`), and a stand-in with the values' shape and dtype for `check_qkv`."""
    if isinstance(value_dim, bool) or not isinstance(value_dim, int) or value_dim < 1:
        raise ValueError(f"v=None reads the values from k: value_dim must be a positive int, got {value_dim!r}")
    shape = tuple(getattr(k, "shape", ()))
    if len(shape) == 4:
        check_latent_value_dim(value_dim, shape[-1], config)
    return jax.ShapeDtypeStruct(shape[:-1] + (value_dim,), getattr(k, "dtype", jnp.float32))


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
    check_fits(packing, segment_ids, max_documents, config.compression_rate ** (packing.num_layers - 1),
               max_document_len)
    return packing, segment_ids
