"""The block-selection backward (SPEC 5 with SPEC 12's selections constant): the
transpose of `merge.py`'s walk, one program per `(b, queries, h_kv)` as in the forward.

With the forward's per-row log-sum-exp `lse` and `delta = rowsum(do * o)`, a merged
candidate `j` of row `i` has weight `p = exp(s - lse)` and `ds = p * (do . v_j -
delta)`. A program gathers each candidate tile once for all its rows (as the forward
does), sums its rows' `dq` over the tile in the layer's rotated frame and adds it,
rotated back, to `dq` once a layer. The tile's `dk = alpha * ds^T q` (rotated back by
each candidate's position) and `dv = p^T do`, summed over the program's rows, are
summed over the blocks one of two ways (`BlockKernels.sums`): `"partials"`, the
default on a GPU, stores them in the program's slab and sums them by node in block
order afterwards (`partials.py`, `launch_by_partials`; bitwise reproducible); or
`"atomics"`, the default interpreted, adds them to the layer's float32 accumulators
with atomics (many blocks merge the same node; with `b * G` rows a gather the atomics
are a sixteenth of per-query ones), in no fixed order: not bitwise reproducible run to
run. The layers' gradients are pushed down the tree (`tree_backward.push_down`) to the
tokens.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from htree_jax.core.config import HTreeConfig
from pallas_kernels.block.inverted import inverted_index
from pallas_kernels.block.mosaic_backward import TILE as MOSAIC_TILE
from pallas_kernels.block.mosaic_backward import block_backward_mosaic, check_mosaic_backward_dims, walk_layers
from pallas_kernels.block.mosaic_sums import mosaic_sum_partials
from pallas_kernels.block.partials import (LANES, SumLaunch, chunk_blocks, chunk_edges, entry_keys, range_lanes,
                                         slab_widths, sum_partials, totals_by_node, zero_totals)
from pallas_kernels.block.forward import block_static, on_hopper
from pallas_kernels.block.layout import row_layout
from pallas_kernels.block.merge import (
    BlockLaunch,
    BlockStatic,
    block_inputs,
    block_scalars,
    first_spec,
    layer_walk,
    merged_mask,
    operand,
    rotate_back,
    rotated_keys,
    rotated_rows,
    rows_dot,
    transposed_dot,
    scores_dot,
    selection_lists,
    tile_nodes,
    walk_tiles,
)
from pallas_kernels.shared.common import (
    compiler_params,
    next_power_of_two,
    pad_axis,
    pad_rope_halves,
    unpad_rope_halves,
)
from pallas_kernels.shared.configs import BlockConfig
from pallas_kernels.shared.kernels import BlockKernels


def _block_backward_kernel(q_ref, do_ref, lse_ref, delta_ref, cos_ref, sin_ref, *refs, st: BlockStatic,
                           sums: str, packed: bool = False, shifted: bool = False):
    L, C, h = st.num_layers, st.tile, st.half
    first, offset, refs = block_scalars(refs, packed, shifted)
    sel_refs = refs[: L - 1]
    layer_refs = refs[L - 1: L - 1 + 2 * L]
    range_ref, walked = None, None
    if sums == "atomics":  # the accumulators, aliased to the gradients after `dq`
        dq_ref, *grad_refs = refs[L - 1 + 4 * L:]
    else:  # "partials": the program's slabs, then its walked ranges (`partials.py`)
        dq_ref, *grad_refs, range_ref = refs[L - 1 + 2 * L:]
        lanes = jnp.arange(range_ref.shape[0], dtype=jnp.int32)
        walked = jnp.zeros(range_ref.shape, jnp.int32)
    rows, dtype = st.rows, q_ref.dtype
    do = do_ref[...].reshape(rows, st.vp)
    lse = lse_ref[...].reshape(rows)
    delta = delta_ref[...].reshape(rows)
    dq_lo = jnp.zeros((rows, h), jnp.float32)
    dq_hi = jnp.zeros((rows, h), jnp.float32)

    for l in reversed(range(L)):
        k_ref, v_ref = layer_refs[2 * l], layer_refs[2 * l + 1]
        dk_ref, dv_ref = grad_refs[2 * l], grad_refs[2 * l + 1]
        walk = layer_walk(l, sel_refs, st, first, offset)
        q_rot = rotated_rows(q_ref, cos_ref, sin_ref, walk.angle, st)
        qr = [operand(x, st, dtype) for x in q_rot]

        def tile_grads(i, carry, k_ref=k_ref, v_ref=v_ref, dk_ref=dk_ref, dv_ref=dv_ref, walk=walk, qr=qr):
            (g_lo, g_hi), seen = carry
            p, valid, nodes = tile_nodes(i, walk, st)
            kr = rotated_keys(k_ref, nodes, cos_ref, sin_ref, i, st)
            s = st.alpha * (scores_dot(qr[0], kr[0], st, dtype) + scores_dot(qr[1], kr[1], st, dtype))
            merged, seen = merged_mask(p, valid, nodes, seen, walk, st)
            w = jnp.where(merged, jnp.exp(s - lse[:, None]), 0.0)  # [rows, C]
            v = v_ref[nodes, :]
            ds = w * (scores_dot(do, v, st, dtype) - delta[:, None]) * st.alpha
            g_lo = g_lo + rows_dot(ds, kr[0], st, dtype)
            g_hi = g_hi + rows_dot(ds, kr[1], st, dtype)
            dk_lo, dk_hi = rotate_back(transposed_dot(ds, qr[0], st, dtype), transposed_dot(ds, qr[1], st, dtype),
                                       cos_ref[pl.ds(i * C, C), :], sin_ref[pl.ds(i * C, C), :])
            if sums == "partials":  # the tile's sums at its buffer positions; masked ones are zero
                at = pl.ds(i * C, C)
                dk_ref[at, pl.ds(0, h)] = dk_lo
                dk_ref[at, pl.ds(h, h)] = dk_hi
                dv_ref[at, :] = transposed_dot(w, do, st, dtype)
                return (g_lo, g_hi), seen
            # Positions past `n` (nothing merged: their sums are zero) add to a spare row,
            # each valid node to its own: no two lanes of one add share a row but spare
            # ones (interpret mode's adds keep one of equal rows).
            target = jnp.where(valid, nodes, dk_ref.shape[0] - 1)[:, None]
            cols = jnp.arange(h, dtype=jnp.int32)[None, :]
            plgpu.atomic_add(dk_ref, (target, cols), dk_lo)
            plgpu.atomic_add(dk_ref, (target, cols + h), dk_hi)
            plgpu.atomic_add(dv_ref, (target, jnp.arange(st.vp, dtype=jnp.int32)[None, :]), transposed_dot(w, do, st, dtype))
            return (g_lo, g_hi), seen

        zero = jnp.zeros((rows, h), jnp.float32)
        start, stop, seen = walk_tiles(walk, st)
        if walked is not None:  # the positions this program's slab holds: the sums read no others
            walked = jnp.where(lanes == 2 * l, start * C, jnp.where(lanes == 2 * l + 1, stop * C, walked))
        (g_lo, g_hi), _ = lax.fori_loop(start, stop, tile_grads, ((zero, zero), seen))
        g_lo, g_hi = rotate_back(g_lo, g_hi, cos_ref[walk.angle, :], sin_ref[walk.angle, :])
        dq_lo, dq_hi = dq_lo + g_lo, dq_hi + g_hi

    shape = dq_ref.shape[:-1] + (h,)
    dq_ref[:, :, pl.ds(0, h)] = dq_lo.reshape(shape)
    dq_ref[:, :, pl.ds(h, h)] = dq_hi.reshape(shape)
    if range_ref is not None:
        range_ref[...] = walked


@functools.partial(jax.jit, static_argnames=("launch", "sums"))
def block_backward_launch(rows, layers, selections, launch: BlockLaunch, sums: str = "atomics", firsts=None,
                          offset=None):
    """`(dq [B, Tp, H_kv, Gp, 2 * half]` float32, `[dk_l, dv_l]` float32 as `layers`)`
    for `rows = (q5, do5, lse, delta)`: the queries `q5` (as `merge.block_merge_pallas`
    takes them) with cotangents `do5 [B, Tp, H_kv, Gp, vp]`, their log-sum-exp `lse` and
    `delta = rowsum(do * o)` `[B, Tp, H_kv, Gp]`; `launch.node_counts` each layer's nodes
    (the gradients have a spare row past them). `sums="partials"`: `(dq, [pk_l, pv_l],
    ranges)`, each program's slab of `launch.widths[l]` positions a layer (`[B, H_kv, NP
    * widths[l], D]`, program `p` at rows `p * widths[l] ..`) and the `[start, stop)`
    positions it walked (`ranges [B, H_kv, NP, partials.range_lanes(L)]` int32;
    `partials.py` sums them). `firsts` (packed rows) and `offset` (a context shard's
    rows) as `merge.block_merge_pallas` takes them."""
    q5, do5, lse, delta = rows
    st, table_rows, node_counts = launch.st, launch.table_rows, launch.node_counts
    B, Tp, H_kv, gp, kp = q5.shape
    qb = st.queries
    cos, sin = launch.tables
    per_block = st.r // qb
    rows_spec = lambda d: pl.BlockSpec((None, qb, None, gp, d), lambda i, j, h: (i, j, h, 0, 0))
    vec_spec = pl.BlockSpec((None, qb, None, gp), lambda i, j, h: (i, j, h, 0))
    table_spec = pl.BlockSpec((table_rows, st.half), lambda i, j, h: (0, 0))
    sel_spec = pl.BlockSpec((None, None, None, st.width), lambda i, j, h: (i, j // per_block, h, 0))
    whole = lambda x: pl.BlockSpec((None, None) + x.shape[2:], lambda i, j, h: (i, h, 0, 0))
    layer_specs = [whole(x) for x in layers]
    # The accumulators: a spare row past every node (`next_power_of_two(N + 1)` rows).
    zeros = [jnp.zeros(x.shape[:2] + (next_power_of_two(n + 1),) + x.shape[3:], jnp.float32)
             for x, n in zip(layers, [n for n in node_counts for _ in range(2)])] if sums == "atomics" else []
    acc_specs = [whole(x) for x in zeros]
    out_specs, out_shape = [rows_spec(kp)] + acc_specs, [jax.ShapeDtypeStruct(q5.shape, jnp.float32)] + [
        jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in zeros]
    if sums == "partials":
        NP = Tp // qb
        for W in launch.widths:
            for d in (kp, st.vp):
                out_specs.append(pl.BlockSpec((None, None, W, d), lambda i, j, h: (i, h, j, 0)))
                out_shape.append(jax.ShapeDtypeStruct((B, H_kv, NP * W, d), jnp.float32))
        lanes = range_lanes(st.num_layers)
        out_specs.append(pl.BlockSpec((None, None, None, lanes), lambda i, j, h: (i, h, j, 0)))
        out_shape.append(jax.ShapeDtypeStruct((B, H_kv, NP, lanes), jnp.int32))
    scalars = block_inputs(firsts, offset, (B, Tp // st.r), H_kv)
    first_zero = 6 + len(scalars) + len(selections) + len(layers)
    return pl.pallas_call(
        functools.partial(_block_backward_kernel, st=st, sums=sums, packed=firsts is not None,
                          shifted=offset is not None),
        grid=(B, Tp // qb, H_kv),
        in_specs=[rows_spec(kp), rows_spec(st.vp), vec_spec, vec_spec, table_spec, table_spec]
        + [first_spec(st)] * len(scalars) + [sel_spec] * len(selections) + layer_specs + acc_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={first_zero + i: 1 + i for i in range(len(zeros))},
        compiler_params=compiler_params(st.num_warps, st.num_stages),
        interpret=launch.interpret,
    )(q5, do5, lse, delta, cos, sin, *scalars, *selections, *layers, *zeros)


def launch_by_partials(rows, layers, selections, lists, *, launch: BlockLaunch, layout, block: BlockConfig,
                       walk: str = "pallas_triton", sum_kernel: str = "pallas_triton"):
    """`block_backward_launch`'s `(dq5, [dk_l, dv_l])` with the key and value gradients
    summed by node from partial sums (`partials.py`): chunks of blocks whose slabs fit
    `block.backward_partial_bytes`, each walked (`sums="partials"`) and then summed a
    layer, the totals added chunk after chunk in block order. `rows` `(q5, do5, lse,
    delta)`, `lists` and `selections` (as `block_backward_pallas` has them), `layout`
    the rows' (`layout.py`: the keys' length, a packed row's virtual one, and the
    launch's `firsts` or `offset`). `walk`: the kernel that walks the blocks,
    `"pallas_triton"` (`block_backward_launch`, float32 slabs of `dk` turned back) or
    `"mosaic_gpu"` (`mosaic_backward.block_backward_mosaic`, slabs in the inputs' dtype,
    `dk` turned back by the sums; `st.tile` its `TILE`); the sums' kernel `sum_kernel`
    (`"mosaic_gpu"`: `mosaic_sums.py`, with the Mosaic GPU walk only: a ValueError
    otherwise) and its `(warps, stages)` as `block` says."""
    if sum_kernel == "mosaic_gpu" and walk != "mosaic_gpu":
        raise ValueError(f"BlockKernels(sum_kernel='mosaic_gpu') sums the Mosaic GPU walk's slabs; this launch walks "
                         f"on {walk!r} (16-bit inputs, K and V up to 128: see BlockKernels.walk)")
    st, table_rows, node_counts = launch.st, launch.table_rows, launch.node_counts
    extras, T = layout.extras(), layout.length
    firsts, offset = extras.get("firsts"), extras.get("offset")
    q5 = rows[0]
    B, Tp, H_kv = q5.shape[:3]
    r, L = st.r, st.num_layers
    NB, per_block = Tp // r, r // st.queries
    mosaic = walk == "mosaic_gpu"
    widths = slab_widths(node_counts, table_rows, st)
    launch = dataclasses.replace(launch, widths=widths)
    walk_launch = block_backward_mosaic if mosaic else block_backward_launch
    itemsize = jnp.dtype(q5.dtype).itemsize if mosaic else 4
    per_program = B * H_kv * sum(widths) * (q5.shape[-1] + st.vp) * itemsize
    tables, prepared = None, {}
    if mosaic:  # each key's angle by its buffer position, to `max(widths)` (identity past the table)
        prepared = dict(prepared=walk_layers(layers, launch))  # once, not a chunk
        cos, sin = launch.tables
        pad = ((0, max(0, max(widths) - table_rows)), (0, 0))
        tables = (jnp.pad(cos, pad, constant_values=1.0), jnp.pad(sin, pad))
    count = chunk_blocks(NB, per_block, per_program, block.backward_partial_bytes)
    tiles = [-(-n // r) for n in node_counts]
    full, rest = divmod(NB, count)
    with jax.named_scope("htree_index"):
        index = inverted_index(selections, r=r, b=r, T=T, num_layers=L, layer_sizes=node_counts,
                               shape=(B, NB, H_kv), offset=offset)
        # Each tile's index entries of every chunk, found once: chunk `c` is blocks `c * count ..`.
        edges = [c * count for c in range(full + 1)] + ([NB] if rest else [])
        bounds = [chunk_edges(entry_keys(ix, NB), u, NB, edges) for ix, u in zip(index, tiles)]

    def chunk(c, n_blocks: int, totals):
        first_block = c * count
        cut = lambda x, per: lax.dynamic_slice_in_dim(x, first_block * per, n_blocks * per, axis=1)
        start = first_block * r if offset is None else offset + first_block * r
        with jax.named_scope("htree_walk"):
            dq5, *out = walk_launch(
                tuple(cut(x, r) for x in rows), layers, [cut(x, 1) for x in lists], launch, sums="partials",
                firsts=None if firsts is None else cut(firsts, 1), offset=jnp.asarray(start, jnp.int32), **prepared)
        slabs, ranges = (out[0], out[1]) if mosaic else (out[:-1], out[-1])
        first = jnp.full((LANES,), first_block, jnp.int32)
        new = []
        for l in range(L):
            span, layer_slabs = (bounds[l][c], bounds[l][c + 1]), (slabs[2 * l], slabs[2 * l + 1])
            sums = SumLaunch(r, widths[l], per_block, l, block.backward_sum_num_warps, block.backward_sum_num_stages,
                             launch.interpret)
            with jax.named_scope("htree_sums"):
                add = mosaic_sum_partials if sum_kernel == "mosaic_gpu" else sum_partials
                new.append(add(first, span, index[l], ranges, layer_slabs, launch=sums, tables=tables,
                               totals=totals[l]))
        return dq5, new

    totals = [zero_totals(B, H_kv, u, r, q5.shape[-1], st.vp) for u in tiles]
    dqs = []
    if full == 1:
        dq5, totals = chunk(jnp.int32(0), count, totals)
        dqs.append(dq5)
    else:
        def body(totals, c):
            dq5, totals = chunk(c, count, totals)
            return totals, dq5

        totals, stacked = lax.scan(body, totals, jnp.arange(full, dtype=jnp.int32))
        dqs.append(jnp.moveaxis(stacked, 0, 1).reshape((B, full * count * r) + q5.shape[2:]))
    if rest:
        dq5, totals = chunk(jnp.int32(full), rest, totals)
        dqs.append(dq5)
    with jax.named_scope("htree_sums"):
        grads = [g for layer in totals for g in totals_by_node(layer, r)]
    return jnp.concatenate(dqs, axis=1) if len(dqs) > 1 else dqs[0], grads


def chosen_sum(kernels: BlockKernels, interpret: bool) -> str:
    """How the key and value gradients are summed (`BlockKernels.sums`); `"auto"`: from
    partial sums on a GPU, by atomics interpreted (the reason in `BlockKernels`)."""
    if kernels.sums != "auto":
        return kernels.sums
    return "atomics" if interpret else "partials"


def chosen_walk(kernels: BlockKernels, st: BlockStatic, K: int, V: int, dtype, table_rows: int,
                interpret: bool) -> str:
    """The kernel that walks the blocks for partial sums (`BlockKernels.walk`):
    Pallas-Triton for the other sums; `"mosaic_gpu"` where asked (a ValueError naming
    the rule where it cannot take the launch `st`, whose tile is its `TILE`); `"auto"`:
    Mosaic GPU on a Hopper GPU wherever it takes the launch, else Pallas-Triton."""
    route = kernels.walk
    if chosen_sum(kernels, interpret) != "partials" or route == "pallas_triton":
        return "pallas_triton"
    if route == "mosaic_gpu":
        if interpret:
            raise ValueError("BlockKernels(walk='mosaic_gpu') has no interpret mode; interpreted runs take "
                             "'pallas_triton'")
        check_mosaic_backward_dims(st, K, V, dtype, table_rows)
        return route
    if interpret or not on_hopper():
        return "pallas_triton"
    try:
        check_mosaic_backward_dims(st, K, V, dtype, table_rows)
    except ValueError:
        return "pallas_triton"
    return "mosaic_gpu"


def backward_kernels(layout, config: HTreeConfig, *, G: int, K: int, V: int, dtype, block: BlockConfig,
                     kernels: BlockKernels, interpret: bool) -> BlockKernels:
    """`kernels` with the backward's walk and sums named (`chosen_walk`, `chosen_sum`) for
    a backward over `layout` (its static fields: the keys' length, the layer count, the
    RoPE table's rows; `layout.py`), `G` heads a kv head, head dims `K`, `V`, inputs in
    `dtype`, the launch `block`. `backends.plan_call` resolves `"auto"` with it once a
    call; `block_backward_pallas` resolves whatever is left the same way."""
    st = layout.static(block_static(config, layout.length, G, K, V, dtype, MOSAIC_TILE, block.backward_num_warps))
    return dataclasses.replace(kernels, walk=chosen_walk(kernels, st, K, V, dtype, layout.table_rows(config, st),
                                                         interpret),
                               sums=chosen_sum(kernels, interpret))


@functools.partial(jax.jit, static_argnames=("config", "block", "kernels", "interpret"))
def block_backward_pallas(q, k, v, o, lse, do, selections, layout=None, *, config: HTreeConfig,
                          block: BlockConfig = BlockConfig(), kernels: BlockKernels = BlockKernels(),
                          interpret: bool = False, dead_rows=None):
    """`(dq, dk, dv)` in the dtypes of `q, k, v` of `block_forward.block_forward_pallas`'s
    output `o [B, T, H, V]` with its `lse [B, T, H]`, cotangent `do`, and the blocks'
    `selections` and `layout` (`layout.py`; None: one document a row) it was given.
    `dead_rows [B, T, H]` bool (optional): rows whose output is a constant (SPEC 10's NaN
    rows), taken as having no cotangent. `block`: the launch (`BlockConfig.backward_tile`,
    `backward_num_warps`); `kernels`: the walk's and the sums' kernels and how the key
    and value gradients are summed (`BlockKernels.sums`, `"auto"` resolved here as the
    plan does): `"atomics"`, added by every block that merged a node with float32
    atomics, not bitwise reproducible run to run; or `"partials"` (`partials.py`), each
    block's sums written out and summed by node in block order, bitwise reproducible. A
    context shard (`row_layout(q, k, config, offset)`): `dq` of
    its queries, `dk`, `dv` its rows' share of every token's (atomics or partials)."""
    K, H_kv, V = q.shape[-1], k.shape[2], v.shape[-1]
    G = q.shape[2] // H_kv
    layout = row_layout(q, k, config) if layout is None else layout
    kernels = backward_kernels(layout, config, G=G, K=K, V=V, dtype=q.dtype, block=block, kernels=kernels,
                               interpret=interpret)
    walk, sums = kernels.walk, kernels.sums
    tile = MOSAIC_TILE if walk == "mosaic_gpu" else block.backward_tile
    st = layout.static(block_static(config, layout.length, G, K, V, q.dtype, tile, block.backward_num_warps))
    with jax.named_scope("htree_layout"):  # the rows, the tree and the lists as the walk reads them
        if dead_rows is not None:
            do = jnp.where(dead_rows[..., None], jnp.zeros((), do.dtype), do)
            o = jnp.where(dead_rows[..., None], jnp.zeros((), o.dtype), o)
        delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)  # [B, T, H]
        rows = tuple(layout.rows(x, H_kv, st) for x in (pad_rope_halves(q, st.half), pad_axis(do, -1, st.vp), lse,
                                                          delta))
        layers, table_rows = layout.layers(k, v, config, st), layout.table_rows(config, st)
        lists, node_counts = selection_lists(selections, st), layout.node_counts(config, st)
    launch = BlockLaunch(config, st, K, table_rows, node_counts, interpret)
    if sums == "partials":
        dq5, grads = launch_by_partials(rows, layers, selections, lists, launch=launch, layout=layout, block=block,
                                        walk=walk, sum_kernel=kernels.sum_kernel)
    else:
        dq5, *grads = block_backward_launch(rows, layers, lists, launch, sums="atomics", **layout.extras())
    with jax.named_scope("htree_dq"):
        dq = layout.tokens(unpad_rope_halves(dq5[:, :, :, :G], K)).astype(q.dtype)
    with jax.named_scope("htree_push_down"):
        dk, dv = layout.key_grads(grads, k, v, layers, config, st)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype)


__all__ = ["backward_kernels", "block_backward_launch", "block_backward_pallas", "launch_by_partials"]
