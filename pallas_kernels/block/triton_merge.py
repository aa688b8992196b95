"""The block merge (`merge._block_merge_kernel`, SPEC 12) written in Triton itself and
called through `jax_triton.triton_call`: one of the two roads JAX names off Pallas's
Triton lowering (`docs/backends.md`). Same launch (one program per `(b, queries,
h_kv)`), same walk, same gathers of contiguous node tiles, same online softmax; what
Pallas did for us is written out: pointer arithmetic instead of refs and BlockSpecs,
the program's rows padded to a power of two of at least 16 (a Triton dot's least
side) and masked, the tree's layers one array with each layer's first node given.

Needs the optional extra `htree-jax[triton]` (jax-triton) and a CUDA GPU: jax-triton
has no interpret mode inside JAX. `tests/test_block_routes.py` and the gate's `via`
cases check it against the Pallas kernel on the GPU. (The raw kernel also runs under
Triton's own interpreter, `TRITON_INTERPRET=1` with torch tensors, and compiles to a
cubin with `triton.compile` on a machine without a GPU: `tests/test_block_routes.py` does that
where triton is installed, which CI is not.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

try:  # the optional extra: without it the module loads and the route says how to get it
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

from htree_jax.core.config import HTreeConfig
from pallas_kernels.block.merge import PAST_NODES, BlockStatic, rope_tables
from pallas_kernels.shared.common import next_power_of_two

_PAST = tl.constexpr(PAST_NODES) if tl else PAST_NODES  # Triton reads globals only as constexprs


def _block_merge_kernel(q_ptr, cos_ptr, sin_ptr, sel_ptr, k_ptr, v_ptr, start_ptr, power_ptr,
                       Tp, H_kv, n_total, sel_layer_stride,
                       o_ptr, lse_ptr,
                       R: tl.constexpr, TOP_K: tl.constexpr, L: tl.constexpr, QUERIES: tl.constexpr,
                       GROUP: tl.constexpr, ROWS: tl.constexpr, HALF: tl.constexpr, VP: tl.constexpr,
                       TILE: tl.constexpr, WIDTH: tl.constexpr, ALPHA: tl.constexpr, EXACT: tl.constexpr):
    """Every layer's merge of one program's rows. `q [B, Tp, H_kv, GROUP, 2 * HALF]`,
    `cos`, `sin [table_rows, HALF]` float32, `sel [L - 1, B, Tp / R, H_kv, WIDTH]` int32
    (top layer first, `PAST_NODES` padded), `k [B, H_kv, n_total, 2 * HALF]`, `v [B,
    H_kv, n_total, VP]` (the layers bottom first, layer `l` from node `start[l]`),
    `power [L]` = `R ** l`; writes `o [B, Tp, H_kv, GROUP, VP]`, `lse [B, Tp, H_kv,
    GROUP]`. Rows from `QUERIES * GROUP` to `ROWS` are padding (masked)."""
    bi = tl.program_id(0)
    j = tl.program_id(1)
    h = tl.program_id(2)
    real_rows: tl.constexpr = QUERIES * GROUP
    rows = tl.arange(0, ROWS)
    row_ok = rows < real_rows
    t_first = j * QUERIES
    t0 = t_first - t_first % R  # the block's first position
    t_row = t_first + tl.minimum(rows, real_rows - 1) // GROUP
    g_row = rows % GROUP
    q_row = ((bi * Tp + t_row) * H_kv + h) * GROUP + g_row  # [ROWS] row index in q, o, lse
    blk = t_first // R
    sel_base = sel_ptr + ((bi * (Tp // R) + blk) * H_kv + h) * WIDTH
    kv_row0 = (bi * H_kv + h) * n_total
    d = tl.arange(0, HALF)
    dv = tl.arange(0, VP)
    slot = tl.arange(0, TILE)

    m = tl.full((ROWS,), float("-inf"), tl.float32)
    total = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, VP), tl.float32)
    dtype = q_ptr.dtype.element_ty

    for l in tl.static_range(L - 1, -1, -1):  # top layer first
        power = tl.load(power_ptr + l)
        first_node = tl.load(start_ptr + l)
        if l == L - 1:  # SPEC 2: virtual parents 0 .. floor(i*/r)
            n_parents = t0 // power // R + 1
        else:
            parents_base = sel_base + (L - 2 - l) * sel_layer_stride  # the selection of layer l + 1
            listed = tl.load(parents_base + tl.arange(0, WIDTH))
            n_parents = tl.sum(((tl.arange(0, WIDTH) < TOP_K) & (listed < _PAST)).to(tl.int32), axis=0)
        if l == 0:  # SPEC 2.1: each row counts its own tokens of its own node
            n_row = (n_parents - 1) * R + t_row % R + 1
            n_max = (n_parents - 1) * R + (t_first + QUERIES - 1) % R + 1
        else:
            n_max = (n_parents - 1) * R + (t0 // power) % R + 1
            n_row = tl.zeros((ROWS,), tl.int32) + n_max
        angle = n_row - 1
        q_lo = tl.load(q_ptr + q_row[:, None] * (2 * HALF) + d[None, :], mask=row_ok[:, None], other=0.0)
        q_hi = tl.load(q_ptr + q_row[:, None] * (2 * HALF) + HALF + d[None, :], mask=row_ok[:, None], other=0.0)
        cos_q = tl.load(cos_ptr + angle[:, None] * HALF + d[None, :])
        sin_q = tl.load(sin_ptr + angle[:, None] * HALF + d[None, :])
        q_lo, q_hi = q_lo.to(tl.float32), q_hi.to(tl.float32)
        q_lo, q_hi = q_lo * cos_q - q_hi * sin_q, q_lo * sin_q + q_hi * cos_q  # rotate-half RoPE
        if not EXACT:
            q_lo = q_lo.to(dtype)
            q_hi = q_hi.to(dtype)
        seen = tl.zeros((), tl.int32)
        refined_base = sel_base + (L - 1 - l) * sel_layer_stride  # the nodes layer l refines (l > 0)
        for i in range(0, tl.cdiv(n_max, TILE)):
            p = i * TILE + slot
            valid = p < n_max
            if l == L - 1:
                nodes = p
            else:
                parent = tl.load(parents_base + tl.minimum(p // R, TOP_K - 1))
                nodes = parent * R + p % R
            nodes = tl.where(valid, nodes, 0)
            key_row = kv_row0 + first_node + nodes  # [TILE]
            k_lo = tl.load(k_ptr + key_row[:, None] * (2 * HALF) + d[None, :]).to(tl.float32)
            k_hi = tl.load(k_ptr + key_row[:, None] * (2 * HALF) + HALF + d[None, :]).to(tl.float32)
            cos_k = tl.load(cos_ptr + p[:, None] * HALF + d[None, :])
            sin_k = tl.load(sin_ptr + p[:, None] * HALF + d[None, :])
            k_lo, k_hi = k_lo * cos_k - k_hi * sin_k, k_lo * sin_k + k_hi * cos_k
            if not EXACT:
                k_lo = k_lo.to(dtype)
                k_hi = k_hi.to(dtype)
            if EXACT:  # [ROWS, TILE]
                s = tl.dot(q_lo, tl.trans(k_lo), input_precision="ieee")
                s = tl.dot(q_hi, tl.trans(k_hi), s, input_precision="ieee")
            else:
                s = tl.dot(q_hi, tl.trans(k_hi), tl.dot(q_lo, tl.trans(k_lo)))
            s = ALPHA * s
            if l == 0:
                merged = p[None, :] < n_row[:, None]
            else:
                window = tl.load(refined_base + seen + slot)
                hits = tl.sum((nodes[:, None] == window[None, :]).to(tl.int32), axis=1)
                last = tl.max(tl.where(valid, nodes, -1), axis=0)
                seen += tl.sum((window <= last).to(tl.int32), axis=0)
                merged = (valid & (hits == 0))[None, :] & (rows >= 0)[:, None]
            # `pallas_kernels.shared.softmax.fold` of one tile, transcribed.
            s = tl.where(merged, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            decay = tl.exp(m - m_safe)
            w = tl.exp(s - m_safe[:, None])
            total = total * decay + tl.sum(w, axis=1)
            vals = tl.load(v_ptr + key_row[:, None] * VP + dv[None, :])
            if EXACT:
                acc = tl.dot(w, vals.to(tl.float32), acc * decay[:, None], input_precision="ieee")
            else:
                acc = tl.dot(w.to(dtype), vals.to(dtype), acc * decay[:, None])
            m = m_new

    out = acc / total[:, None]  # `softmax.normalized` and `softmax.log_sum_exp`, transcribed
    tl.store(o_ptr + q_row[:, None] * VP + dv[None, :], out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + q_row, m + tl.log(total), mask=row_ok)


block_merge_kernel = triton.jit(_block_merge_kernel) if triton else None


def program_rows(st: BlockStatic) -> int:
    """A program's rows as the Triton kernel holds them: `queries * group` padded to a
    power of two of at least 16 (a dot's least side)."""
    return next_power_of_two(max(st.rows, 16))


def flat_tree(layers):
    """`layer_arrays`' `[K_0, V_0, K_1, V_1, ...]` (`[B, H_kv, Np_l, ...]`) -> `(K [B,
    H_kv, sum Np, 2 * half], V [B, H_kv, sum Np, vp], starts [L] int32)`: one array a
    side, layer `l` from node `starts[l]` (XLA writes it in the copy that lays the tree
    out)."""
    keys, values = layers[0::2], layers[1::2]
    starts = np.cumsum([0] + [x.shape[2] for x in keys[:-1]]).astype(np.int32)
    return jnp.concatenate(keys, axis=2), jnp.concatenate(values, axis=2), jnp.asarray(starts)


def kernel_arguments(q5, layers, selections, config: HTreeConfig, st: BlockStatic, head_dim: int, table_rows: int):
    """The raw kernel's arrays and scalars (what `block_merge_triton` passes; the CPU test
    passes them under Triton's interpreter): `(arrays, scalars, constexprs)`."""
    cos, sin = rope_tables(config, head_dim, table_rows, st)
    keys, values, starts = flat_tree(layers)
    sel = jnp.stack(selections) if selections else jnp.full((1, 1, 1, 1, st.width), PAST_NODES, jnp.int32)
    powers = jnp.asarray([st.r ** l for l in range(st.num_layers)], jnp.int32)
    Tp, H_kv = q5.shape[1], q5.shape[2]
    arrays = (q5, cos, sin, sel, keys, values, starts, powers)
    scalars = (Tp, H_kv, keys.shape[2], int(np.prod(sel.shape[1:])))
    return arrays, scalars, kernel_constexprs(st)


def kernel_constexprs(st: BlockStatic) -> dict:
    """The kernel's compile-time arguments for the launch `st`."""
    return dict(R=st.r, TOP_K=st.top_k, L=st.num_layers, QUERIES=st.queries, GROUP=st.group,
                ROWS=program_rows(st), HALF=st.half, VP=st.vp, TILE=st.tile, WIDTH=st.width,
                ALPHA=float(st.alpha), EXACT=st.exact)


@functools.partial(jax.jit, static_argnames=("config", "st", "head_dim", "table_rows", "interpret"))
def block_merge_triton(q5, layers, selections, config: HTreeConfig, st: BlockStatic, head_dim: int, table_rows: int,
                       interpret: bool = False):
    """`merge.block_merge_pallas` (same arguments and results, no interpret mode:
    `interpret=True` is refused) on the Triton kernel above through `jax_triton.triton_call`."""
    if interpret:
        raise ValueError("block_merge='triton' has no interpret mode; interpreted runs take 'pallas_triton'")
    import jax_triton  # the optional extra (`check_merge_route` checked it is installed)

    B, Tp, H_kv, gp, _ = q5.shape
    arrays, scalars, constexprs = kernel_arguments(q5, layers, selections, config, st, head_dim, table_rows)
    return jax_triton.triton_call(
        *arrays, *scalars, kernel=block_merge_kernel,
        out_shape=[jax.ShapeDtypeStruct((B, Tp, H_kv, gp, st.vp), q5.dtype),
                   jax.ShapeDtypeStruct((B, Tp, H_kv, gp), jnp.float32)],
        grid=(B, Tp // st.queries, H_kv), num_warps=st.num_warps, num_stages=st.num_stages, **constexprs)
