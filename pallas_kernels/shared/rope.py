"""RoPE for the kernels (SPEC 2.2): tables padded to the kernels' widths, and the layers'
keys rotated ahead of time in the layouts the kernels read.

Below the top layer a candidate's position is its slot in *this* query's parent list,
so keys cannot be rotated once for everyone; they are stored in `span / r` rotated copies
(`rotate_phases`) and each query is rotated once per span of candidates. On the top
layer, position = node, so keys and queries are each rotated once (`rotate_keys`,
`rotate_queries`).
"""

from __future__ import annotations

import jax.numpy as jnp

from htree_jax.core.rope import apply_rope, rope_table
from pallas_kernels.shared.common import LayerStatic, pad_axis, pad_nodes


def padded_rope_table(num_positions: int, head_dim: int, base: float, half: int, rope_dim: int | None = None):
    """`(cos, sin)` `[num_positions, half]` float32 (`htree_jax.core.rope.rope_table`, exactly
    rounded), zero-padded from `K/2` to `half` columns like `pad_rope_halves`."""
    return tuple(pad_axis(jnp.asarray(a), -1, half)
                 for a in rope_table(num_positions, head_dim, float(base), rope_dim))


def phase_versions(st: LayerStatic) -> int:
    """How many rotated copies of a layer's keys the kernels read: `span / r`."""
    return st.span // st.r


def rotate_phases(layer_k, cos, sin, st: LayerStatic):
    """The layer's keys in `span / r` rotated copies, `[B, H_kv, (span/r) * N, Kp]`
    float32 (the kernels read them through `key_operands`): row `m*N + j` is
    `rope(K[j], m*r + j mod r)`.

    Candidate position `p = s*r + c` (slot `s`, child `c`) of a product over the span
    `[p0, p0 + span)` (`p0` a multiple of the span) reads copy `m = (p - p0) / r`, so
    each key arrives rotated by `p - p0`, and one rotation of the query, by
    `n - 1 - p0`, serves the whole span (SPEC 2.2 is relative:
    `<rope(q, n-1), rope(K, p)> = <rope(q, n-1-p0), rope(K, p - p0)>`). The copies cost
    `span / r` times the layer's keys in memory and save a query rotation per slot,
    which in Pallas-Triton costs more than the gathers (journal, 2026-11-22 (later))."""
    return rotate_copies(layer_k, cos, sin, st.r, phase_versions(st))


def rotate_copies(layer_k, cos, sin, r: int, versions: int):
    """`rotate_phases` for `versions` copies: row `m*N + j` is `rope(K[j], m*r + j mod r)`."""
    N = layer_k.shape[2]
    child = jnp.arange(N) % r
    angle = (jnp.arange(versions)[:, None] * r + child[None, :]).reshape(-1)
    tiled = jnp.tile(layer_k.astype(jnp.float32), (1, 1, versions, 1))
    return apply_rope(tiled, cos[angle], sin[angle])


def rotate_half(q):
    """`[x_lo, x_hi] -> [-x_hi, x_lo]`: with it, RoPE at angle table row `a` is
    `q * [cos_a, cos_a] + rotate_half(q) * [sin_a, sin_a]`, full-width, no halves."""
    half = q.shape[-1] // 2
    return jnp.concatenate([-q[..., half:], q[..., :half]], axis=-1)


def full_width(table):
    """`[Mp, Kp/2]` angle table -> `[Mp, Kp]`, both halves the same."""
    return jnp.concatenate([table, table], axis=-1)


def full_width_inputs(q, cos, sin):
    """What the kernels read instead of `q, cos, sin`: `q, rotate_half(q)` and the
    full-width tables (`[Mp, Kp]`)."""
    half = q.shape[-1] // 2  # rotate_half, written out: one step less on q's way
    return (q, jnp.concatenate([-q[..., half:], q[..., :half]], axis=-1)), (full_width(cos), full_width(sin))



def rotate_keys(layer_k, cos, sin, tile: int):
    """`rope(K[j], j)` in float32 for every node `j` of a layer (`[B, H_kv, N, Kp]` ->
    `[B, H_kv, Np, Kp]`, zero rows up to `Np`, the next multiple of `tile`). The same
    products as rotating a gathered key tile in the per-query kernels."""
    N = layer_k.shape[2]
    return pad_nodes(apply_rope(layer_k.astype(jnp.float32), cos[:N], sin[:N]), tile)


def rotate_queries(q, n, cos, sin):
    """Each query rotated by its own `n - 1` in float32 (`q [B, Q, H_kv, Gt, Kp]`,
    `n [B, Q, H_kv, 1]`): the whole top layer is then plain dot products."""
    position = n - 1  # [B, Q, H_kv, 1]: one row of the tables per query, for all its heads
    return apply_rope(q.astype(jnp.float32), cos[position], sin[position])

