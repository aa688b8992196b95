"""SPEC 12 in a kernel: every layer of a block's walk, once the block's selections are
known, one program per `(b, queries, h_kv)` holding `queries * G` rows that share
each gathered node tile.

With `selection_block = b = compression_rate` the queries of one bottom node share the
candidate buffer of every layer above 0, its positions and its rotation; at layer 0
they share the buffer too and differ only in how much of their own node they see
(`n` counts their own tokens). So a program gathers each tile of `tile` candidates
(`tile / r` contiguous node tiles of `r` rows) once for all its rows, rotates the keys
by their buffer position once (RoPE is relative: the rows are rotated once per layer by
their `n - 1`), and folds the candidates a layer does not refine into one online
softmax (`shared/softmax.py`). Which candidates a layer refines is the block's selection of that layer,
sorted as the selection passes return it, read a window of `tile` entries at a time.

The selections come from the per-query kernels run on the block's ranking rows
(`htree_jax.backends`); the twin is the JAX reference's walk with the same option
(`htree_jax.reference`, SPEC 12).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from htree_jax.core.config import HTreeConfig
from htree_jax.core.indexing import candidate_count, num_top_parents
from htree_jax.core.rope import rope_table
from pallas_kernels.shared.common import NEG_INF, compiler_params, next_power_of_two, pad_axis, pad_rope_halves
from pallas_kernels.shared.softmax import fold, log_sum_exp, normalized

# A selection list's padding: above every node index, and `r` times it still an int32.
PAST_NODES = 1 << 26
MAX_ROWS = 128  # rows of one program: a tensor-core tile of queries times heads
MAX_DIM = 256  # K, V the block kernels take (padded): past 128, half the rows a program


@dataclasses.dataclass(frozen=True)
class BlockStatic:
    """What one block-merge launch is compiled for. `queries` consecutive positions of
    one block (`b / queries` programs a block where `b * G > MAX_ROWS`), `group` the
    (padded) heads per kv head, `half` half the padded head dim, `vp` the padded value
    dim, `tile` candidates a step (a multiple of `r`), `width` a selection list's padded
    length (`top_k + tile`, a power of two)."""

    r: int
    top_k: int
    num_layers: int
    queries: int
    group: int
    half: int
    vp: int
    tile: int
    width: int
    alpha: float
    exact: bool  # float32 operands (the dots in full float32), else the inputs' dtype
    num_warps: int = 8
    num_stages: int = 1

    @property
    def rows(self) -> int:
        return self.queries * self.group


@dataclasses.dataclass(frozen=True)
class BlockLaunch:
    """What a block kernel's launch is compiled for besides its arrays (static under
    `jit`): the function (`config`), the launch `st`, the real head dim `head_dim` the
    RoPE tables are built for, the tables' `table_rows` (at least every `n` of a layer
    rounded up to `st.tile`), each layer's `node_counts` and the partial sums' slab
    `widths` (the backward's), and interpret mode."""

    config: HTreeConfig
    st: BlockStatic
    head_dim: int
    table_rows: int
    node_counts: tuple = ()
    interpret: bool = False
    widths: tuple = ()

    @property
    def tables(self):
        """`rope_tables` for the launch: `(cos, sin)` float32 `[table_rows, half]`."""
        return rope_tables(self.config, self.head_dim, self.table_rows, self.st)


def block_queries(b: int, G: int, widest: int) -> int:
    """Queries of one block per program: all `b` while `b * G` fits the rows (`MAX_ROWS`,
    half that where the padded `K` or `V`, `widest`, passes 128), else the most that fit
    (at least one)."""
    rows = MAX_ROWS if widest <= 128 else MAX_ROWS // 2
    return max(1, min(b, rows // G))


def scores_dot(a, b_t, st: BlockStatic, dtype):
    """`a [m, k] @ b_t[n, k]^T` in float32: float32 operands in full precision, other
    inputs rounded to their dtype for the tensor cores."""
    if st.exact:
        return lax.dot_general(a, b_t, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)
    return lax.dot_general(a.astype(dtype), b_t.astype(dtype), (((1,), (1,)), ((), ())),
                           preferred_element_type=jnp.float32)


def rows_dot(a, b, st: BlockStatic, dtype):
    """`a [m, n] @ b [n, d]` in float32 (operands as `scores_dot`)."""
    if st.exact:
        return jnp.dot(a, b.astype(jnp.float32), precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return jnp.dot(a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)


def transposed_dot(a, b, st: BlockStatic, dtype):
    """`a [m, n]^T @ b [m, d]` in float32 (operands as `merge.scores_dot`)."""
    dims = (((0,), (0,)), ((), ()))
    if st.exact:
        return lax.dot_general(a, b, dims, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return lax.dot_general(a.astype(dtype), b.astype(dtype), dims, preferred_element_type=jnp.float32)


def rotate_halves(lo, hi, cos, sin):
    """Rotate-half RoPE on split halves (`htree_jax.core.rope.apply_rope`)."""
    return lo * cos - hi * sin, lo * sin + hi * cos


def rotate_back(lo, hi, cos, sin):
    """The transpose of `rotate_halves` (a rotation by the opposite angle): what a gradient in
    the rotated frame is in the stored one."""
    return lo * cos + hi * sin, hi * cos - lo * sin


@dataclasses.dataclass(frozen=True)
class LayerWalk:
    """One layer of a program's walk: `parents` the ref of this layer's parent list (None
    at the top, whose position `p` holds node `p`), `refined` the ref of the nodes it
    refines (None at the bottom), each row's `n` and the most of them, and each row's
    query angle `n - 1` (SPEC 2.1-2.2); `first`, on the top layer of packed rows, the
    block's document's first node there (the positions before it hold other documents'
    nodes: not merged), else None."""

    parents: object
    refined: object
    n_row: object
    n_max: object
    angle: object
    first: object = None


def layer_walk(l: int, sel_refs, st: BlockStatic, first=None, offset=None) -> LayerWalk:
    """Layer `l` of the program's rows (`st.queries` positions of one block from
    `program_id(1) * st.queries`, plus `offset`: a context shard's first position). Above
    layer 0 every row of the block has the same `n`; at layer 0 each row counts its own
    tokens of its own (last) node. `first`: packed rows laid out virtually
    (`htree_jax.core.packing`), the block's document's first top node; RoPE is relative,
    so its `n` and positions counted from the row's start score as those counted from
    the document's."""
    L, r = st.num_layers, st.r
    t_first = pl.program_id(1) * st.queries
    if offset is not None:
        t_first = t_first + offset
    t0 = t_first - t_first % r  # the block's first position
    t_row = t_first + jnp.arange(st.rows, dtype=jnp.int32) // st.group  # [rows]
    if l == L - 1:  # SPEC 2: virtual parents 0 .. floor(i*/r)
        parents, n_parents = None, num_top_parents(t0, r, L)
    else:
        parents = sel_refs[L - 2 - l]  # the selection of layer l + 1
        n_parents = jnp.sum((parents[pl.ds(0, st.top_k)] < PAST_NODES).astype(jnp.int32))
    bottom = l == 0
    n_row = candidate_count(n_parents, t_row if bottom else t0, r, l)
    n_max = candidate_count(n_parents, t_first + st.queries - 1 if bottom else t0, r, l)
    return LayerWalk(parents, None if bottom else sel_refs[L - 1 - l], n_row, n_max,
                     jnp.broadcast_to(n_row - 1, (st.rows,)), first if l == L - 1 else None)


def walk_tiles(walk: LayerWalk, st: BlockStatic):
    """`(start, stop, seen)`: the layer's candidate tiles `start .. stop - 1` and the
    entries of its refined list before tile `start`. Packed rows (`walk.first`) start
    at the tile of the document's first node: the tiles wholly before it hold other
    documents' nodes only, and walking them masked made a row of 8 documents 1.4x the
    time of 8 rows (journal, 2026-12-02 (4))."""
    stop = (walk.n_max + st.tile - 1) // st.tile
    if walk.first is None:
        return 0, stop, jnp.int32(0)
    start = jnp.minimum(walk.first // st.tile, stop)
    seen = jnp.int32(0) if walk.refined is None else jnp.sum(
        (walk.refined[pl.ds(0, st.top_k)] < start * st.tile).astype(jnp.int32))
    return start, stop, seen


def rotated_rows(q_ref, cos_ref, sin_ref, angle, st: BlockStatic):
    """The program's rows `[rows, half]` x 2, float32, rotated by `angle [rows]`. Read
    again at each layer rather than held across them: registers go to the accumulators."""
    h = st.half
    lo = q_ref[:, :, pl.ds(0, h)].reshape(st.rows, h).astype(jnp.float32)
    hi = q_ref[:, :, pl.ds(h, h)].reshape(st.rows, h).astype(jnp.float32)
    return rotate_halves(lo, hi, cos_ref[angle, :], sin_ref[angle, :])


def tile_nodes(i, walk: LayerWalk, st: BlockStatic):
    """`(p, valid, nodes)` `[tile]` of the layer's candidate tile `i`: buffer positions,
    `p < n_max`, the node each holds (0 where not valid). Position `s*r + c` holds child
    `c` of parent slot `s`: `tile / r` contiguous node tiles."""
    p = i * st.tile + jnp.arange(st.tile, dtype=jnp.int32)
    valid = p < walk.n_max
    nodes = p if walk.parents is None else walk.parents[jnp.minimum(p // st.r, st.top_k - 1)] * st.r + p % st.r
    return p, valid, jnp.where(valid, nodes, 0)


def rotated_keys(k_ref, nodes, cos_ref, sin_ref, i, st: BlockStatic):
    """The tile's keys `[tile, half]` x 2, float32, rotated by their buffer positions."""
    h, C = st.half, st.tile
    lo = k_ref[nodes, pl.ds(0, h)].astype(jnp.float32)
    hi = k_ref[nodes, pl.ds(h, h)].astype(jnp.float32)
    return rotate_halves(lo, hi, cos_ref[pl.ds(i * C, C), :], sin_ref[pl.ds(i * C, C), :])


def merged_mask(p, valid, nodes, seen, walk: LayerWalk, st: BlockStatic):
    """`(merged [rows, tile], seen)`: the candidates each row folds in. At the bottom every
    valid one its `n` reaches; above it those the layer does not refine: they are the
    next entries of the sorted selection, at most `tile` of them from `seen` on (the
    count of entries up to the tile's last node is added to `seen`)."""
    if walk.first is not None:  # packed: the document's own nodes only
        valid = valid & (p >= walk.first)
    if walk.refined is None:
        below = p[None, :] < walk.n_row[:, None]
        return below if walk.first is None else below & valid[None, :], seen
    window = walk.refined[pl.ds(seen, st.tile)]
    hits = jnp.sum((nodes[:, None] == window[None, :]).astype(jnp.int32), axis=1)
    last = jnp.max(jnp.where(valid, nodes, -1))
    seen = seen + jnp.sum((window <= last).astype(jnp.int32))
    return jnp.broadcast_to((valid & (hits == 0))[None, :], (st.rows, st.tile)), seen


def operand(x, st: BlockStatic, dtype):
    """A dot's operand: float32 as it is where the dots are exact, else in `dtype`."""
    return x if st.exact else x.astype(dtype)


def block_first(first_ref):
    """A program's block's first top node, or a context shard's first position
    (`firsts_layout`), or None."""
    return None if first_ref is None else jnp.min(first_ref[...])


def block_scalars(refs, packed: bool, shifted: bool):
    """`(first, offset, refs)`: the kernel's per-block inputs that lead `refs`, each read
    (`block_first`) or None: packed rows' first top nodes, a context shard's offset."""
    first_ref, refs = (refs[0], refs[1:]) if packed else (None, refs)
    offset_ref, refs = (refs[0], refs[1:]) if shifted else (None, refs)
    return block_first(first_ref), block_first(offset_ref), refs


def _block_merge_kernel(q_ref, cos_ref, sin_ref, *refs, st: BlockStatic, packed: bool = False,
                        shifted: bool = False):
    L, C = st.num_layers, st.tile
    first, offset, refs = block_scalars(refs, packed, shifted)
    sel_refs = refs[: L - 1]  # layer L-1 first: node lists, sorted, PAST_NODES after the real ones
    layer_refs = refs[L - 1: L - 1 + 2 * L]  # bottom first: keys, values
    o_ref, lse_ref = refs[L - 1 + 2 * L:]
    rows, dtype = st.rows, q_ref.dtype
    state = (jnp.full((rows,), NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32),
             jnp.zeros((rows, st.vp), jnp.float32))

    for l in reversed(range(L)):
        k_ref, v_ref = layer_refs[2 * l], layer_refs[2 * l + 1]
        walk = layer_walk(l, sel_refs, st, first, offset)
        qr = [operand(x, st, dtype) for x in rotated_rows(q_ref, cos_ref, sin_ref, walk.angle, st)]

        def merge_tile(i, carry, k_ref=k_ref, v_ref=v_ref, walk=walk, qr=qr):
            state, seen = carry
            p, valid, nodes = tile_nodes(i, walk, st)
            kr = rotated_keys(k_ref, nodes, cos_ref, sin_ref, i, st)
            s = st.alpha * (scores_dot(qr[0], kr[0], st, dtype) + scores_dot(qr[1], kr[1], st, dtype))  # [rows, C]
            merged, seen = merged_mask(p, valid, nodes, seen, walk, st)
            weighted = lambda w: rows_dot(w, v_ref[nodes, :], st, dtype)
            return fold(state, [(jnp.where(merged, s, NEG_INF), weighted)]), seen

        start, stop, seen = walk_tiles(walk, st)
        state, _ = lax.fori_loop(start, stop, merge_tile, (state, seen))

    o_ref[...] = normalized(state).reshape(o_ref.shape).astype(o_ref.dtype)
    lse_ref[...] = log_sum_exp(state).reshape(lse_ref.shape)


def layer_parent_counts(selections, st: BlockStatic, T0, blocks: tuple[int, int, int]):
    """`n_P` of each layer (bottom first) for each block: `[B, NB, H_kv, Lp]` int32
    (`blocks` is `(B, NB, H_kv)`; `Lp` a power of two of at least 4, zeros after `L`).
    The top layer's virtual parents count from the block's first position `T0 [NB]`;
    the others are the lengths of the lists of the layer above (`selections`, top layer
    first)."""
    L = st.num_layers
    counts = [jnp.sum(selections[L - 2 - l][..., : st.top_k] < PAST_NODES, axis=-1) for l in range(L - 1)]
    counts.append(num_top_parents(T0, st.r, L)[None, :, None])
    stacked = jnp.stack([jnp.broadcast_to(c, blocks) for c in counts], axis=-1).astype(jnp.int32)
    lp = max(4, 1 << (L - 1).bit_length())
    return jnp.pad(stacked, [(0, 0)] * 3 + [(0, lp - L)])


def selection_lists(selections, st: BlockStatic):
    """The block's selections `[B, NB, H_kv, top_k]` (`-1` padded, top layer first) as
    the kernel reads them: int32, `PAST_NODES` for `-1` and after, `st.width` long."""
    out = []
    for s in selections:
        s = jnp.where(s < 0, PAST_NODES, s).astype(jnp.int32)
        out.append(jnp.pad(s, ((0, 0), (0, 0), (0, 0), (0, st.width - s.shape[-1])), constant_values=PAST_NODES))
    return out


def layer_arrays(layers, st: BlockStatic):
    """Tree layers `[(K_l [B, N_l, H_kv, K], V_l [B, N_l, H_kv, V])]` bottom first ->
    `[K_l, V_l]` as `[B, H_kv, Np, 2 * half]`, `[B, H_kv, Np, vp]` (each node's rows
    contiguous, `Np` a power of two: a program's block spans the layer)."""
    out = []
    for kl, vl in layers:
        n = next_power_of_two(kl.shape[1], 16)
        kl = pad_axis(pad_rope_halves(kl, st.half), 1, n)
        vl = pad_axis(pad_axis(vl, -1, st.vp), 1, n)
        out += [jnp.swapaxes(kl, 1, 2), jnp.swapaxes(vl, 1, 2)]
    return out


def rope_tables(config: HTreeConfig, K: int, positions: int, st: BlockStatic):
    """`(cos, sin)` float32 `[positions, half]` of SPEC 2.2 (`rope_table`), each half
    padded with the identity rotation past `K / 2`."""
    cos, sin = rope_table(positions, K, float(config.rope_base), config.partial_rope(K))
    pad = ((0, 0), (0, st.half - K // 2))
    return jnp.asarray(np.pad(cos, pad, constant_values=1.0)), jnp.asarray(np.pad(sin, pad))


FIRST_LANES = 16  # a block's first top node, repeated: a load of a power of two of lanes


def firsts_layout(firsts, num_kv_heads: int):
    """Each block's document's first top node `[B, NB]` int32 -> `[B, NB, H_kv, 16]`, as
    the block kernels read it (`first_spec`)."""
    B, NB = firsts.shape
    return jnp.broadcast_to(firsts.astype(jnp.int32)[:, :, None, None], (B, NB, num_kv_heads, FIRST_LANES))


def block_inputs(firsts, offset, blocks: tuple[int, int], num_kv_heads: int) -> list:
    """The kernels' per-block inputs (`block_scalars` reads them), those given: packed
    rows' `firsts [B, NB]`, then a context shard's first position `offset` (int32
    scalar, a multiple of `b`), each as `firsts_layout`."""
    out = [] if firsts is None else [firsts_layout(firsts, num_kv_heads)]
    if offset is not None:
        out.append(firsts_layout(jnp.broadcast_to(jnp.asarray(offset, jnp.int32), blocks), num_kv_heads))
    return out


def first_spec(st: BlockStatic):
    """The `BlockSpec` of `firsts_layout`'s array: a program reads its block's."""
    return pl.BlockSpec((None, None, None, FIRST_LANES), lambda i, j, h: (i, j // (st.r // st.queries), h, 0))


@functools.partial(jax.jit, static_argnames=("launch",))
def block_merge_pallas(q5, layers, selections, launch: BlockLaunch, firsts=None, offset=None):
    """Every layer's merge for queries `q5 [B, Tp, H_kv, Gp, 2 * half]` (rope layout,
    halves padded; `Tp` a multiple of `b`) given the tree `layers` (`layer_arrays`) and
    the blocks' selections (`selection_lists`, `[B, Tp / b, H_kv, width]` each, top
    layer first), launched as `launch` says (`BlockLaunch`). Returns `(o [B, Tp, H_kv,
    Gp, vp]` in q's dtype, `lse [B, Tp, H_kv, Gp]` float32)`: each row's output and the
    log-sum-exp of its merged scores. `firsts [B, Tp / b]` int32: packed rows laid out virtually,
    each block's document's first top node (`layer_walk`); None: a document a row.
    `offset` int32: the rows are a context shard's, from that position (a multiple of
    `b`) of the tree's sequence; None: from 0."""
    st, table_rows = launch.st, launch.table_rows
    B, Tp, H_kv, gp, kp = q5.shape
    b, qb = st.r, st.queries
    cos, sin = launch.tables
    per_block = b // qb
    q_spec = pl.BlockSpec((None, qb, None, gp, kp), lambda i, j, h: (i, j, h, 0, 0))
    table_spec = pl.BlockSpec((table_rows, st.half), lambda i, j, h: (0, 0))
    sel_spec = pl.BlockSpec((None, None, None, st.width), lambda i, j, h: (i, j // per_block, h, 0))
    layer_specs = [pl.BlockSpec((None, None) + x.shape[2:], lambda i, j, h: (i, h, 0, 0)) for x in layers]
    scalars = block_inputs(firsts, offset, (B, Tp // b), H_kv)
    return pl.pallas_call(
        functools.partial(_block_merge_kernel, st=st, packed=firsts is not None, shifted=offset is not None),
        grid=(B, Tp // qb, H_kv),
        in_specs=[q_spec, table_spec, table_spec] + [first_spec(st)] * len(scalars) + [sel_spec] * len(selections)
        + layer_specs,
        out_specs=[pl.BlockSpec((None, qb, None, gp, st.vp), lambda i, j, h: (i, j, h, 0, 0)),
                   pl.BlockSpec((None, qb, None, gp), lambda i, j, h: (i, j, h, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, Tp, H_kv, gp, st.vp), q5.dtype),
                   jax.ShapeDtypeStruct((B, Tp, H_kv, gp), jnp.float32)],
        compiler_params=compiler_params(st.num_warps, st.num_stages),
        interpret=launch.interpret,
    )(q5, cos, sin, *scalars, *selections, *layers)
