"""SPEC 10: a NaN or infinity at position `p` of `k` or `v` changes no output at `t < p`.

Full-sequence attention (`htree_attention`, every backend, forward and gradients): the
non-finite entries of `k` and `v` are replaced by 0 before the tree is built, and every
output row at or after the first position that held one (per batch row and kv head) is
set to NaN afterwards, as dense causal attention gives: every later query weighs the bad
token. Why around the kernels, not inside them: a product `w @ values` with `w = 0` and
a NaN value is NaN, and the top layer's block kernels serve queries on both sides of `p`
with one product (rows `t < p` must ignore a value row that rows `t >= p` merge), which
no mask on the value tile can fix. With finite inputs the replacement is the identity,
and by strict causality (SPEC 3) the outputs before `p` do not depend on the replaced
values. The Pallas backend applies it inside its `custom_vjp`, fused into copies it makes
anyway (no measurable time at the benchmark shape: journal, 2026-11-23, clean base).

Decoding does without: its kernels serve one query per program, so zeroing the values a
query does not merge is exact (`htree_jax.reference.merge`, the decode merge kernel), and
the NaN stays in the cache's tree, reaching later outputs as in dense attention.
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


def dead_rows(positions, first, num_heads: int):
    """`[B, S, H]` bool: the rows whose position `positions[s]` is at or after
    `first[b, h // G]` (`first_non_finite`, `[B, H_kv]`), `G = H / H_kv`."""
    first_per_head = jnp.repeat(first, num_heads // first.shape[1], axis=1)  # [B, H]
    return positions[None, :, None] >= first_per_head[:, None, :]


def poison_rows(o, positions, first):
    """`o [B, S, H, V]` with NaN in every `dead_rows` row."""
    dead = dead_rows(positions, first, o.shape[2])
    return jnp.where(dead[..., None], jnp.asarray(jnp.nan, o.dtype), o)


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
