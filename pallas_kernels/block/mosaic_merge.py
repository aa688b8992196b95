"""The block merge (`merge._block_merge_kernel`, SPEC 12) on Pallas's Mosaic GPU backend:
the other road JAX names off Pallas's Triton lowering (`docs/backends.md`). One
program per `(b, queries, h_kv)`, one warpgroup holding the block's rows (64 or 128,
padded), the walk and the online softmax as in the Triton-lowered kernel; the two
differ where Mosaic GPU works differently:

- Gathers: Mosaic GPU has no gather of single rows into registers. Each node tile (`r`
  contiguous rows of a layer, the child block of one kept parent) is its own TMA copy
  into the tile's shared-memory buffer, at a row offset read from the parent list in
  shared memory.
- Operands: WGMMA reads both sides from shared memory, so a tile's keys are loaded,
  rotated by their buffer positions in registers and stored back before the score dot.
- Queries: rotated by their row's angle in XLA, once per layer (`rotated_queries`),
  because a row's angle is a gather of table rows by a per-row index.
- Masks: the set a layer refines is a bitmap over buffer positions built in XLA
  (`refined_bitmaps`: a scatter of `top_k` bits a block), read one word of 32
  positions at a time, instead of comparing each tile with a window of the sorted list.

Inputs in bfloat16 or float16 only (WGMMA takes float32 operands as TF32: the float32
path's exact dots have no Mosaic GPU form here). Needs a Hopper GPU; Mosaic GPU's CPU
interpret mode (jax 0.10-0.11) cannot run a transposed WGMMA operand, so the tests that
run this kernel are GPU-marked (`tests/test_block_routes.py`, the gate's route cases).
"""

from __future__ import annotations

import functools
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from htree_jax.core.config import HTreeConfig
from htree_jax.core.indexing import candidate_count, num_top_parents
from pallas_kernels.block.merge import PAST_NODES, BlockStatic, rope_tables
from pallas_kernels.shared.common import next_power_of_two

TILE = 64  # candidates a step: a WGMMA N and two bitmap words
WORD = 32  # positions a bitmap word holds
TMA_ROWS = 256  # the most elements a TMA copy moves along a dimension
DTYPES = (jnp.bfloat16, jnp.float16)


def check_mosaic_dims(r: int, rows: int, K: int, V: int, dtype) -> None:
    """What this kernel takes; a ValueError naming the rule otherwise: bfloat16 or
    float16, `compression_rate` 8, 16, 32 or 64 (a node tile is whole 8-row tiles of
    shared memory, and `TILE` whole node tiles), at most 128 rows a program, `K / 2` 32
    or 64 and `V` 64 or 128 (padded to powers of two: a half is one WGMMA operand of
    whole 64-byte swizzles; at K = V = 256 the buffers pass the 227 KiB of shared
    memory a block has)."""
    rules = []
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES]:
        rules.append(f"bfloat16 or float16 inputs (got {jnp.dtype(dtype).name})")
    if r not in (8, 16, 32, 64):
        rules.append(f"compression_rate 8, 16, 32 or 64 (got {r})")
    if rows > 128:
        rules.append(f"at most 128 rows a program (got {rows})")
    half, vp = next_power_of_two(K // 2, 16), next_power_of_two(V, 16)
    if half not in (32, 64) or vp not in (64, 128):
        rules.append(f"K / 2 of 32 or 64 and V of 64 or 128, padded to powers of two (got K = {K}, V = {V})")
    if rules:
        raise ValueError("block_merge='mosaic_gpu' takes " + "; ".join(rules) + ": use block_merge='pallas_triton'")


def program_rows(st: BlockStatic) -> int:
    """A program's rows as the warpgroup holds them: 64 or 128 (WGMMA's M is 64 a
    step); `st.rows` real, the rest zero queries whose outputs are dropped."""
    return 64 if st.rows <= 64 else 128


def _transforms(minor: int, dtype) -> tuple:
    """Shared-memory tiling and swizzle for a `[rows, minor]` operand of `dtype`."""
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor * bits)
    return plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle)


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


def refined_bitmaps(selections, st: BlockStatic, words: int):
    """Each layer above 0 (top first, as `selections`): bit `p` set where buffer
    position `p` holds a node the layer refines. `[L - 1, B, NB, H_kv, words]` int32.
    A refined node `n` of layer `l` sits at `p = n` in the top layer, else at `s * r + n
    % r` with `s` its parent's slot in the list of layer `l + 1` (the lists are sorted).
    One scatter of `top_k` bits a list (each position once: the add is an OR)."""
    r = st.r
    maps = []
    for index, refined in enumerate(selections):  # index 0: layer L - 1
        refined = refined[..., : st.top_k]
        if index == 0:
            p = refined
        else:
            parents = selections[index - 1][..., : st.top_k]
            slot = jnp.vectorize(jnp.searchsorted, signature="(k),(k)->(k)")(parents, refined // r)
            p = slot * r + refined % r
        listed = refined < PAST_NODES
        p = jnp.where(listed, p, 0)
        bit = jnp.where(listed, jnp.left_shift(jnp.uint32(1), (p % WORD).astype(jnp.uint32)), jnp.uint32(0))
        lead = refined.shape[:-1]
        flat_p, flat_bit = p.reshape(-1, st.top_k) // WORD, bit.reshape(-1, st.top_k)
        lists = jnp.arange(flat_p.shape[0])[:, None]
        bits = jnp.zeros((flat_p.shape[0], words), jnp.uint32).at[lists, flat_p].add(flat_bit)
        maps.append(lax.bitcast_convert_type(bits, jnp.int32).reshape(lead + (words,)))
    return jnp.stack(maps)


def rotated_queries(q5, counts, cos, sin, st: BlockStatic, rows: int):
    """Each layer's queries rotated by their row's angle `n - 1` (SPEC 2.2), laid out a
    program's rows together: `q5 [B, Tp, H_kv, Gp, 2 * half]` -> `(lo, hi)` each `[L, B,
    Tp / queries, H_kv, rows, half]` in q's dtype."""
    B, Tp, H_kv, gp, _ = q5.shape
    L, r, h = st.num_layers, st.r, st.half
    t = jnp.arange(Tp, dtype=jnp.int32)
    block_of = t // r
    lo, hi = q5[..., :h].astype(jnp.float32), q5[..., h:].astype(jnp.float32)
    out_lo, out_hi = [], []
    for l in range(L):
        n_p = counts[..., l][:, block_of]  # [B, Tp, H_kv]
        n = candidate_count(n_p, t[None, :, None] if l == 0 else (block_of * r)[None, :, None], r, l)
        c, s = cos[n - 1][:, :, :, None, :], sin[n - 1][:, :, :, None, :]
        out_lo.append(lo * c - hi * s)
        out_hi.append(lo * s + hi * c)

    def lay_out(x):  # [L, B, Tp, H_kv, gp, h] -> [L, B, NJ, H_kv, rows, h]
        x = x.reshape(L, B, Tp // st.queries, st.queries, H_kv, gp, h)
        x = jnp.moveaxis(x, 3, 4).reshape(L, B, Tp // st.queries, H_kv, st.queries * gp, h)
        return jnp.pad(x, [(0, 0)] * 4 + [(0, rows - st.queries * gp), (0, 0)]).astype(q5.dtype)

    return lay_out(jnp.stack(out_lo)), lay_out(jnp.stack(out_hi))


def _merge_kernel(*refs, st: BlockStatic, rows: int, words: int, dtype):
    L, r, C, h, vp = st.num_layers, st.r, TILE, st.half, st.vp
    q_lo_ref, q_hi_ref, cos_ref, sin_ref, sel_ref, count_ref, bits_ref = refs[:7]
    layer_refs = refs[7: 7 + 3 * L]  # bottom first: keys' halves, values
    o_ref, lse_ref = refs[7 + 3 * L: 9 + 3 * L]
    (q_lo_s, q_hi_s, k_lo_s, k_hi_s, v_s, rot_lo_s, rot_hi_s, cos_s, sin_s, par_s, bits_s, count_s, o_s,
     lse_s), bars = refs[9 + 3 * L:]
    b, j, hk = lax.axis_index("b"), lax.axis_index("j"), lax.axis_index("h")
    t_first = j * st.queries
    t0 = t_first - t_first % r
    blk = t_first // r
    node_tiles = C // r
    wgmma_layout, row_layout = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)

    def fetch(src, dst, bar):
        """`src` into `dst` and wait: 1-D lists in pieces of `TMA_ROWS` (a TMA copy's most)."""
        if len(dst.shape) > 1 or dst.shape[0] <= TMA_ROWS:
            plgpu.copy_gmem_to_smem(src, dst, bar)
            plgpu.barrier_wait(bar)
            return
        for c in range(0, dst.shape[0], TMA_ROWS):
            plgpu.copy_gmem_to_smem(src.at[pl.ds(c, TMA_ROWS)], dst.at[pl.ds(c, TMA_ROWS)], bar)
            plgpu.barrier_wait(bar)

    fetch(count_ref.at[b, blk, hk], count_s, bars.at[0])
    m = plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), row_layout)
    total = plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), row_layout)
    acc = plgpu.layout_cast(jnp.zeros((rows, vp), jnp.float32), wgmma_layout)
    row = plgpu.broadcasted_iota(jnp.int32, (rows, C), 0, layout=wgmma_layout)
    col = plgpu.broadcasted_iota(jnp.int32, (rows, C), 1, layout=wgmma_layout)

    for l in reversed(range(L)):
        k_lo_ref, k_hi_ref, v_ref = layer_refs[3 * l: 3 * l + 3]
        plgpu.commit_smem()  # every read of the last layer's buffers is done before they are refilled
        fetch(q_lo_ref.at[l, b, j, hk], q_lo_s, bars.at[0])
        fetch(q_hi_ref.at[l, b, j, hk], q_hi_s, bars.at[0])
        top = l == L - 1
        if not top:
            fetch(sel_ref.at[L - 2 - l, b, blk, hk], par_s, bars.at[0])
        if l > 0:
            fetch(bits_ref.at[L - 1 - l, b, blk, hk], bits_s, bars.at[0])
        n_parents = count_s[l]
        n_max = candidate_count(n_parents, t_first + st.queries - 1 if l == 0 else t0, r, l)
        if l == 0:
            n_row = candidate_count(n_parents, t_first + row // st.group, r, 0)

        def merge_tile(i, carry, l=l, top=top, n_parents=n_parents, n_max=n_max,
                       k_lo_ref=k_lo_ref, k_hi_ref=k_hi_ref, v_ref=v_ref):
            m, total, acc = carry
            plgpu.commit_smem()  # the last tile's reads are done before its buffers are refilled
            for jn in range(node_tiles):
                slot = i * node_tiles + jn
                start = slot * r if top else par_s[jnp.minimum(slot, st.top_k - 1)] * r
                start = jnp.where(slot * r < n_max, start, 0)
                rows_at = pl.ds(jn * r, r)
                plgpu.copy_gmem_to_smem(k_lo_ref.at[b, hk, pl.ds(start, r)], k_lo_s.at[rows_at], bars.at[1 + 3 * jn])
                plgpu.copy_gmem_to_smem(k_hi_ref.at[b, hk, pl.ds(start, r)], k_hi_s.at[rows_at], bars.at[2 + 3 * jn])
                plgpu.copy_gmem_to_smem(v_ref.at[b, hk, pl.ds(start, r)], v_s.at[rows_at], bars.at[3 + 3 * jn])
            plgpu.copy_gmem_to_smem(cos_ref.at[pl.ds(i * C, C)], cos_s, bars.at[1 + 3 * node_tiles])
            plgpu.copy_gmem_to_smem(sin_ref.at[pl.ds(i * C, C)], sin_s, bars.at[2 + 3 * node_tiles])
            for k in range(1, 3 + 3 * node_tiles):
                plgpu.barrier_wait(bars.at[k])
            k_lo, k_hi = k_lo_s[...].astype(jnp.float32), k_hi_s[...].astype(jnp.float32)
            c, s_ = cos_s[...], sin_s[...]
            rot_lo_s[...] = (k_lo * c - k_hi * s_).astype(dtype)
            rot_hi_s[...] = (k_lo * s_ + k_hi * c).astype(dtype)
            plgpu.commit_smem()

            def scores(acc_ref):
                plgpu.wgmma(acc_ref, q_lo_s, plgpu.transpose_ref(rot_lo_s, (1, 0)))
                plgpu.wgmma(acc_ref, q_hi_s, plgpu.transpose_ref(rot_hi_s, (1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(scores, plgpu.ACC((rows, C), jnp.float32)) * st.alpha
            p = i * C + col
            if l == 0:
                merged = p < n_row
            else:
                zero = col * 0  # a scalar word as an array in the scores' layout
                word = zero + bits_s[i * (C // WORD)]
                for w in range(1, C // WORD):
                    word = jnp.where(col >= w * WORD, zero + bits_s[i * (C // WORD) + w], word)
                refined = lax.shift_right_logical(word, col % WORD) & 1
                merged = (p < n_max) & (refined == 0)
            # `pallas_kernels.shared.softmax.fold` of one tile, transcribed (WGMMA's product,
            # broadcasts Mosaic GPU's layouts take).
            s = jnp.where(merged, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            decay = jnp.exp(m - m_safe)
            w_ = jnp.exp(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
            total = total * decay + w_.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(decay, acc.shape, [0])
            acc = pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, w_.astype(dtype), v_s))(plgpu.ACC.init(acc))
            return m_new, total, acc

        m, total, acc = lax.fori_loop(0, (n_max + C - 1) // C, merge_tile, (m, total, acc))

    # `softmax.normalized` and `softmax.log_sum_exp`, transcribed.
    o_s[...] = (acc / lax.broadcast_in_dim(total, acc.shape, [0])).astype(dtype)
    lse_s[...] = m + jnp.log(total)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s, o_ref.at[b, j, hk])
    plgpu.copy_smem_to_gmem(lse_s, lse_ref.at[b, j, hk])
    plgpu.wait_smem_to_gmem(0)


def split_layers(layers, st: BlockStatic):
    """`layer_arrays`' `[K_l, V_l, ...]` -> `[K_l lo half, K_l hi half, V_l, ...]`: WGMMA
    reads each half as its own operand."""
    out = []
    for kl, vl in zip(layers[0::2], layers[1::2]):
        out += [kl[..., : st.half], kl[..., st.half:], vl]
    return out


@functools.partial(jax.jit, static_argnames=("config", "st", "head_dim", "table_rows", "interpret"))
def block_merge_mosaic(q5, layers, selections, config: HTreeConfig, st: BlockStatic, head_dim: int, table_rows: int,
                       interpret: bool = False):
    """`merge.block_merge_pallas` (same arguments and results, `st.tile` is `TILE` and
    `table_rows` a multiple of it, no interpret mode: `interpret=True` is refused) on the
    Mosaic GPU kernel above."""
    if interpret:
        raise ValueError("block_merge='mosaic_gpu' has no interpret mode; interpreted runs take 'pallas_triton'")
    B, Tp, H_kv, gp, _ = q5.shape
    dtype = q5.dtype
    table_rows = max(table_rows, 4 * WORD)  # a bitmap a TMA copy of at least 16 bytes
    rows, nj, nb = program_rows(st), Tp // st.queries, Tp // st.r
    words = table_rows // WORD
    cos, sin = rope_tables(config, head_dim, table_rows, st)
    T0 = jnp.arange(nb, dtype=jnp.int32) * st.r
    counts = layer_parent_counts(selections, st, T0, (B, nb, H_kv))
    if selections:
        sel = jnp.stack(selections)
        bits = refined_bitmaps(selections, st, words)
    else:  # a one-layer tree: nothing refined, no list read
        sel = jnp.zeros((1, B, nb, H_kv, st.width), jnp.int32)
        bits = jnp.zeros((1, B, nb, H_kv, words), jnp.int32)
    q_lo, q_hi = rotated_queries(q5, counts, cos, sin, st, rows)
    scratch = (
        plgpu.SMEM((rows, st.half), dtype, transforms=_transforms(st.half, dtype)),  # q lo
        plgpu.SMEM((rows, st.half), dtype, transforms=_transforms(st.half, dtype)),  # q hi
        plgpu.SMEM((TILE, st.half), dtype, transforms=_transforms(st.half, dtype)),  # keys lo, as gathered
        plgpu.SMEM((TILE, st.half), dtype, transforms=_transforms(st.half, dtype)),  # keys hi
        plgpu.SMEM((TILE, st.vp), dtype, transforms=_transforms(st.vp, dtype)),  # values
        plgpu.SMEM((TILE, st.half), dtype, transforms=_transforms(st.half, dtype)),  # keys lo, rotated
        plgpu.SMEM((TILE, st.half), dtype, transforms=_transforms(st.half, dtype)),  # keys hi, rotated
        plgpu.SMEM((TILE, st.half), jnp.float32, transforms=_transforms(st.half, jnp.float32)),  # cos
        plgpu.SMEM((TILE, st.half), jnp.float32, transforms=_transforms(st.half, jnp.float32)),  # sin
        plgpu.SMEM((st.width,), jnp.int32),  # the parent list
        plgpu.SMEM((words,), jnp.int32),  # the refined bitmap
        plgpu.SMEM((counts.shape[-1],), jnp.int32),  # n_P of each layer
        plgpu.SMEM((rows, st.vp), dtype, transforms=_transforms(st.vp, dtype)),  # output
        plgpu.SMEM((rows,), jnp.float32),  # lse
    )
    n_bars = 3 + 3 * (TILE // st.r)

    def body(*refs):
        pl.run_scoped(lambda *scoped: _merge_kernel(*refs, scoped[:-1], scoped[-1], st=st, rows=rows, words=words,
                                                    dtype=dtype),
                      *scratch, plgpu.Barrier(num_barriers=n_bars))

    kernel = plgpu.kernel(
        body,
        out_type=[jax.ShapeDtypeStruct((B, nj, H_kv, rows, st.vp), dtype),
                  jax.ShapeDtypeStruct((B, nj, H_kv, rows), jnp.float32)],
        grid=(B, nj, H_kv), grid_names=("b", "j", "h"),
        compiler_params=plgpu.CompilerParams(approx_math=True))
    o, lse = kernel(q_lo, q_hi, cos, sin, sel, counts, bits, *split_layers(layers, st))
    real = st.queries * gp
    o = o[:, :, :, :real].reshape(B, nj, H_kv, st.queries, gp, st.vp)
    lse = lse[:, :, :, :real].reshape(B, nj, H_kv, st.queries, gp)
    o = jnp.moveaxis(o, 3, 2).reshape(B, Tp, H_kv, gp, st.vp)
    lse = jnp.moveaxis(lse, 3, 2).reshape(B, Tp, H_kv, gp)
    return o, lse
