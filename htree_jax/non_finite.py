"""SPEC 10: a NaN or infinity at position `p` of `k` or `v` changes no output at `t < p`.

Every backend gets this the same way, around the attention rather than inside each
kernel: the non-finite entries of `k` and `v` are replaced by 0 before the tree is built,
and every output row at or after the first position that held one (per batch row and kv
head) is set to NaN afterwards.

Why not inside the kernels: a product `w @ values` with `w = 0` and a NaN value is NaN,
and the top layer's block kernels serve queries on both sides of `p` with one product
(rows `t < p` must ignore the value row that rows `t >= p` merge), which masking cannot
fix without a per-row test in every step. With finite inputs the replacement is the
identity, so nothing changes; by strict causality (SPEC 3) the outputs at `t < p` do not
depend on the replaced values; and the rows `t >= p` read NaN, as they would in dense
causal attention, where every later query weighs the bad token. The cost is one pass
over `k`, `v` (the first position) and a select fused into the output's last copy.
"""

from __future__ import annotations

import jax.numpy as jnp


def first_non_finite(k, v, positions):
    """`[B, H_kv]` int32: the smallest `positions[s]` whose `k[b, s, h]` or `v[b, s, h]`
    row holds a NaN or infinity, or the int32 maximum where none does.
    `k [B, S, H_kv, K]`, `v [B, S, H_kv, V]`, `positions [S]` int32."""
    bad = jnp.any(~jnp.isfinite(k), axis=-1) | jnp.any(~jnp.isfinite(v), axis=-1)  # [B, S, H_kv]
    never = jnp.iinfo(jnp.int32).max
    return jnp.min(jnp.where(bad, positions[None, :, None], never), axis=1).astype(jnp.int32)


def zero_non_finite(x):
    """`x` with every NaN and infinity replaced by 0 (the identity on finite inputs)."""
    return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


def poison_rows(o, positions, first, num_kv_heads: int):
    """`o [B, S, H, V]` with NaN in every row whose position `positions[s]` is at or after
    `first[b, h // G]` (`first_non_finite`), `G = H / H_kv`."""
    B, S, H, _ = o.shape
    first_per_head = jnp.repeat(first, H // num_kv_heads, axis=1)  # [B, H]
    poisoned = positions[None, :, None] >= first_per_head[:, None, :]  # [B, S, H]
    return jnp.where(poisoned[..., None], jnp.asarray(jnp.nan, o.dtype), o)
