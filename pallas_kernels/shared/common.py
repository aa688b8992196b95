"""What every kernel shares: the static parameters of a launch (`LayerStatic`), the
candidate buffer's geometry inside a kernel, padding, and BlockSpecs.

Every kernel uses the Triton lowering (`compiler_params`); every load and store is a
power of two wide, so head dims are padded here (RoPE halves apart) and sliced back by
the compositions (`gqa/forward.py`, `gqa/backward.py`, `decode/walk.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.shared.precision import key_parts

NEG_INF = float("-inf")

# The kernels' limits. Head dims are padded to powers of two inside (every load is);
# 576 and 512 are latent attention's (DeepSeek: K = 512 + 64, V = 512).
MIN_DIM, MAX_HEAD_DIM, MAX_VALUE_DIM = 32, 576, 512
# At most `KERNEL_GROUP` query heads per kv head make a program's rows; larger groups (a
# multiple of it, up to `MAX_GROUP`: latent attention's 64-128 heads over one kv head)
# run as `G / KERNEL_GROUP` virtual kv heads whose selections come from the whole group.
KERNEL_GROUP, MAX_GROUP = 16, 128


def check_group(G: int, who: str) -> None:
    """`G = H / H_kv`: at most `KERNEL_GROUP`, or a multiple of it up to `MAX_GROUP`."""
    if G > MAX_GROUP or (G > KERNEL_GROUP and G % KERNEL_GROUP):
        raise ValueError(
            f"{who} supports GQA groups of at most {KERNEL_GROUP} query heads per kv head, or a multiple of "
            f"{KERNEL_GROUP} up to {MAX_GROUP}, got H / H_kv = {G}"
        )


def head_split(G: int) -> int:
    """Virtual kv heads per kv head: `G / KERNEL_GROUP` for larger groups, else 1."""
    return G // KERNEL_GROUP if G > KERNEL_GROUP else 1


class Bound(NamedTuple):
    """`selection="bound"` (SPEC 11) as a GQA kernel call takes it (`importance`,
    `gqa.top_layer`, the decode scores): the query rows' feature-group norms `[..., rows,
    width]` float32 and the candidate layer's radii `[B, H_kv, N, width]` (the parts of
    `precision.key_operands`; one array at decode). Inside a kernel, the same fields
    hold the loaded norms and the radii refs."""

    query_norms: Any
    radii: Any


class LayerInputs(NamedTuple):
    """One per-query layer (below the top) as a GQA launch takes it beside the queries:
    `parents [B, Q / BQ, H_kv, P]` and `n [B, Q / BQ, H_kv, 1]` int32, one row per block
    of `BQ = st.block_queries` queries that share them; the kept candidates' packed
    importance `keys [B, Q, H_kv, Mp]` and threshold `tau` (those with `keys < tau`
    merge; None, None: every valid candidate, the bottom layer); the layer's keys `k`
    (the kernels: `precision.key_operands` parts of `rotate_phases`; the twins: the
    un-rotated keys `[B, H_kv, N, Kp]`); its values `v [B, H_kv, N, Vp]` (None where a
    launch reads none); the RoPE tables `cos, sin [Mp, Kp / 2]`."""

    parents: Any
    n: Any
    keys: Any
    tau: Any
    k: Any
    v: Any
    cos: Any
    sin: Any


class TopInputs(NamedTuple):
    """The top layer as a GQA launch takes it beside the rotated queries: `n [B, Q,
    H_kv, 1]` each query's candidates, `first` (packed rows: each query's document's
    first node, same shape; None: one document a row), the kept candidates' `keys` and
    `tau` as `LayerInputs` holds them (None, None: every valid one), the rotated keys'
    `precision.key_operands` parts `k` and the values `v` padded like them (None where
    a launch reads none)."""

    n: Any
    first: Any
    keys: Any
    tau: Any
    k: Any
    v: Any


class RowStats(NamedTuple):
    """A backward launch's rows beside the queries: `lse`, `delta [B, Q, H_kv, Gr]`
    float32 (the forward's log-sum-exp, `rowsum(do * o)`) and the cotangent `do [B,
    Q, H_kv, Gr, Vp]`."""

    lse: Any
    do: Any
    delta: Any


class WideBound(NamedTuple):
    """`selection="bound"` (SPEC 11) as the wide kernels take it (`wide/kernels.py`): the queries'
    latent features' norms `|q|` and RoPE pairs' norms, and the layer's radii in the same
    two parts (each `precision.key_operands` parts). Inside a kernel: their refs."""

    latent_norms: Any
    pair_norms: Any
    latent_radii: Any
    pair_radii: Any


@dataclasses.dataclass(frozen=True)
class LayerStatic:
    """Everything static about one layer launch."""

    r: int
    tile: int  # candidates per inner step: a multiple of `span`
    group: int  # real heads per group G (rows >= G are padding)
    alpha: float
    importance: str
    strict_causal: bool
    log_n: int
    top_k: int
    precision: lax.Precision | None
    num_warps: int = 4
    num_stages: int = 2
    # Candidates per score product below the top layer, all scored with one rotation of
    # the query (`rotate_phases`): a power of two, a multiple of r, >= 16 (a dot's least).
    span: int = 16
    # Operand dtype of the importance dots: None (float32 at `precision`), `BF16X3`
    # (float32-grade from bfloat16 pairs) or a dtype name.
    importance_operands: str | None = None
    # Queries per program. Per-query kernels: they must share parents and n; the top
    # layer's kernels (`gqa/top_layer.py`): each query has its own n.
    block_queries: int = 1
    # Score dots of the merge passes. Their scores only weigh values in the output
    # softmax (selection is decided by the keys kernel), so bf16/f16 inputs need
    # only output precision here. None: same as `precision`.
    merge_precision: lax.Precision | None = None
    # Warps of the merge kernels (None: num_warps). With 16 rows and 64 keys per
    # product, 2 warps ran a bottom merge fastest (journal, 2026-11-22 (later)).
    merge_num_warps: int | None = None
    # Decode kernels: features at the start of each RoPE half that do not rotate (SPEC 7's
    # partial RoPE in `rope_layout` order), scored without a rotation (`half_pieces`).
    latent_half: int = 0
    # Operand dtype of the merge dots ("bfloat16"/"float16", float32 accumulation), as
    # flash attention does for such inputs; None: float32 operands at merge_precision.
    merge_operands: str | None = None


def merge_score_precision(st: LayerStatic):
    """The merge dots' precision: `st.merge_precision`, or `st.precision` when unset."""
    return st.precision if st.merge_precision is None else st.merge_precision


def next_power_of_two(x: int, minimum: int = 1) -> int:
    x = max(int(x), minimum)
    return 1 << (x - 1).bit_length()


def wide_head_dims(K: int, V: int) -> bool:
    """Head dims past 256 features once padded (latent attention's K = 576, V = 512)."""
    return next_power_of_two(K, 32) > 256 or next_power_of_two(V, 16) > 256


def compiler_params(num_warps: int, num_stages: int):
    """Selects the Triton lowering (Pallas on GPU defaults to Mosaic GPU)."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def zeros_after(shape, dtype, anchor):
    """`jnp.zeros(shape, dtype)` that XLA cannot allocate before `anchor` (any array) is
    computed: the zero passes through an optimization barrier with it. For a pass's
    large buffers (a backward's accumulators, anchored on the forward's `lse`): XLA's
    GPU scheduler places a constant broadcast anywhere before its use while the plan
    stays under the device's memory, and placed inside the forward they add to its peak
    (journal, 2026-11-27 (8))."""
    zero, _ = lax.optimization_barrier((jnp.zeros((), dtype), anchor))
    return jnp.broadcast_to(zero, shape)


def pad_axis(x, axis: int, size: int):
    """Zero-pads `x` along `axis` up to `size`."""
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def real_heads(x, split: int):
    """The first virtual head of each kv head (`[B, Q, H_kv * split, ...]` ->
    `[B, Q, H_kv, ...]`): what the split heads share (parents, n, selections)."""
    return x if split == 1 else x[:, :, ::split]


def virtual_heads(x, split: int):
    """`[B, Q, H_kv, ...]` -> `[B, Q, H_kv * split, ...]`, each kv head's row repeated."""
    return x if split == 1 else jnp.repeat(x, split, axis=2)


def shared_shift(shift, split: int, importance: str):
    """The rows' importance shifts `[..., H_kv * split, rows]` -> `[..., H_kv, split *
    rows]`, as the whole group's: per row (`softmax`: each head's LSE) or, for
    `shared_max`, the largest of the split heads' group maxima (all are 0, R empty, or
    none is: R is the same for every head)."""
    shape = shift.shape[:-2] + (shift.shape[-2] // split, split * shift.shape[-1])
    if importance == "shared_max":
        grouped = shift.reshape(shape[:-1] + (split, shift.shape[-1]))
        shift = jnp.broadcast_to(jnp.max(grouped, axis=(-2, -1), keepdims=True), grouped.shape)
    return shift.reshape(shape)


def pad_rope_halves(x, half: int):
    """`[..., K]` -> `[..., 2*half]` as `[x_lo, 0, x_hi, 0]`: rotate-half pairs dim `i`
    with `i + K/2`, so each half is padded on its own and the pairs stay aligned."""
    k2 = x.shape[-1] // 2
    if x.shape[-1] == 2 * half:  # nothing to pad: no copy
        return x
    lo, hi = x[..., :k2], x[..., k2:]
    return jnp.concatenate([pad_axis(lo, -1, half), pad_axis(hi, -1, half)], axis=-1)


def unpad_rope_halves(x, K: int):
    """Inverse of `pad_rope_halves`: `[..., 2*half]` -> `[..., K]`."""
    half = x.shape[-1] // 2
    if x.shape[-1] == K:
        return x
    return jnp.concatenate([x[..., : K // 2], x[..., half: half + K // 2]], axis=-1)


def pad_nodes(layer, tile: int):
    """Zero rows up to the next multiple of `tile` (`[B, H_kv, N, D]`)."""
    return pad_axis(layer, 2, -(-layer.shape[2] // tile) * tile)


def span_candidates(par_ref, p0, width: int, n, r: int):
    """Candidate positions `[p0, p0 + width)` (`p0` a multiple of `r`): `(positions,
    valid, nodes)`, position `p = s*r + c` holding node `parents[s]*r + c`, node 0 where
    invalid (a safe row to gather)."""
    parents = par_ref[pl.ds(p0 // r, width // r)]
    positions = p0 + jnp.arange(width, dtype=jnp.int32)
    valid = positions < n
    child = jnp.arange(r, dtype=jnp.int32)
    nodes = jnp.where(valid, (parents[:, None] * r + child[None, :]).reshape(width), 0)
    return positions, valid, nodes


def layer_refs(refs, leading: int, st: LayerStatic, bottom: bool):
    """Splits a merge-shaped kernel's refs: `(leading refs, keys_ref, tau_ref, k_refs,
    rest)`; `keys_ref, tau_ref` are None at the bottom (every valid candidate merges),
    `k_refs` the merge keys' `key_operands` parts."""
    head, refs = refs[:leading], refs[leading:]
    keys_ref = tau_ref = None
    if not bottom:
        (keys_ref, tau_ref), refs = refs[:2], refs[2:]
    parts = key_parts(merge_score_precision(st), st.merge_operands)
    return head, keys_ref, tau_ref, refs[:parts], refs[parts:]


def per_head_spec(x):
    """A whole `[B, H_kv, rows, D]` array, one `(b, h)` slice per program of a grid
    `(B, Q / BQ, H_kv)` (a layer's keys or values, a gradient accumulator)."""
    return pl.BlockSpec((None, None) + x.shape[2:], lambda b, i, h: (b, h, 0, 0))


def block_specs(st: LayerStatic, gp: int, kp: int, Mp: int, parents, k_phases: tuple, layer_v):
    """BlockSpecs for a grid `(B, Q / BQ, H_kv)`: per-query arrays in blocks of BQ
    queries (`gp` rows, `kp` wide queries, `Mp` candidates), per-block arrays (parents,
    n: one row per block), whole layers and tables."""
    bq = st.block_queries
    queries = lambda *tail: pl.BlockSpec((None, bq, None) + tail, lambda b, i, h: (b, i, h) + (0,) * len(tail))
    block = lambda *tail: pl.BlockSpec((None, None, None) + tail, lambda b, i, h: (b, i, h) + (0,) * len(tail))
    table = pl.BlockSpec((Mp, kp), lambda b, i, h: (0, 0))  # full_width
    specs = dict(q=queries(gp, kp), parents=block(parents.shape[-1]), n=block(1), keys=queries(Mp),
                 tau=queries(1), k=[per_head_spec(x) for x in k_phases], table=table, vec=queries(gp),
                 scores=queries(gp, Mp))
    if layer_v is not None:
        specs.update(v=per_head_spec(layer_v), mat=queries(gp, layer_v.shape[-1]))
    return specs


def layer_params(st: LayerStatic, warps=None):
    warps = st.num_warps if warps is None else warps
    warps = warps if st.block_queries == 1 else max(warps, 8)
    return compiler_params(warps, st.num_stages)


def per_query(x, st: LayerStatic):
    """Block-level rows (parents, n) repeated for each query of the block."""
    return jnp.repeat(x, st.block_queries, axis=1)


def head_block(G: int, rows: int) -> int:
    """Heads per program: the largest power of two `<= rows` dividing `G`."""
    block = 1
    while block * 2 <= rows and G % (block * 2) == 0:
        block *= 2
    return block


def dividing_chunk(T: int, Qc: int, multiple: int) -> int:
    """The largest multiple of `multiple` in `[Qc/2, Qc]` that divides `T`, else `Qc`.
    With chunks that tile T exactly nothing is padded to `chunks * Qc` positions: no
    padded copy of q (forward and backward), of the cotangent, of dq or of the output
    (8 GiB each in bfloat16 at T=1M, H=32, K=128). Used where such a copy outweighs the
    chunk budget; smaller chunks launch more (2 GiB chunks ran 2% faster than 1 GiB)."""
    for size in range(Qc - Qc % multiple, Qc // 2 - 1, -multiple):
        if size > 0 and T % size == 0:
            return size
    return Qc


def check_selections_only(selections_only: bool, return_lse: bool) -> None:
    """A forward asked for its selections only (block selection's ranking pass) merges
    nothing, so it has no log-sum-exp to return: refused by name."""
    if selections_only and return_lse:
        raise ValueError("selections_only=True merges nothing: there is no log-sum-exp to return (return_lse)")


def check_query_layout(q_layout: str, wide: bool = False) -> None:
    """`q_layout`: `"rope_layout"` (every kernel) or `"given"` (the caller's feature order:
    the wide kernels only)."""
    if q_layout not in (("rope_layout", "given") if wide else ("rope_layout",)):
        raise ValueError(f"q_layout {q_layout!r}: the wide kernels take 'rope_layout' or 'given', the others "
                         "'rope_layout' only")
