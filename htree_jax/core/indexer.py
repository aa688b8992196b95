"""SPEC 13, selection by a learned indexer: the index scores of a layer's candidates, their
packed keys, and the training target's KL divergence. The JAX reference's walk
(`htree_jax.reference`) reads them from here; the float64 oracle has its own.

The caller gives the indexer's inputs as an `Index`: queries `q [B, T, H_I, D_I]`, keys
`k [B, T, H_ik, D_I]` (`H_ik` 1, shared by every kv head, or `H_kv`) and head weights
`w [B, T, H_I]`. Index head `i` reads key head `i // (H_I / H_ik)`; kv head `h` ranks with
key head `h // (H_kv / H_ik)` and the index heads that read it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from htree_jax.core.softmax import importance
from htree_jax.core.tree import pool_layer

FORCED_INDEX_KEY = 0x7FFFFFFF  # the rightmost position's key before its position bits


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
    """A module's indexer (SPEC 13; `HTreeAttention(..., indexer=...)`): `heads` index
    heads (`H_I`) of `head_dim` features (`D_I`), and one index key shared by every kv
    head (`shared_key=True`, DeepSeek's form) or one a kv head. Small on purpose: the
    index is scored on every candidate of every layer."""

    heads: int = 4
    head_dim: int = 32
    shared_key: bool = True

    def __post_init__(self):
        for name in ("heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"IndexerConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.shared_key, bool):
            raise ValueError(f"IndexerConfig.shared_key must be a bool, got {self.shared_key!r}")

    def key_heads(self, num_kv_heads: int) -> int:
        """`H_ik`: 1 with a shared key, else the attention's kv heads."""
        return 1 if self.shared_key else num_kv_heads

    def weight_scale(self) -> float:
        """What the head weights are multiplied by (`(H_I * D_I) ** -0.5`, DeepSeek's
        `n_heads ** -0.5 * softmax_scale`): index scores of order one at initialisation."""
        return (self.heads * self.head_dim) ** -0.5


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q", "k", "w"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Index:
    """The indexer's inputs (SPEC 13): `q [B, T, H_I, D_I]`, `k [B, T, H_ik, D_I]`, `w [B,
    T, H_I]`, any float dtype; `H_ik` is 1 or the attention's `H_kv`, `H_I` a multiple of
    `H_ik`. A pytree: it passes through `jax.jit`, `vmap` and `grad` as its arrays."""

    q: jax.Array
    k: jax.Array
    w: jax.Array


def check_index(index: Index, q, k) -> None:
    """A ValueError naming the argument and the rule where `index` does not fit the
    attention's `q [B, T, H, K]`, `k [B, T, H_kv, K]`."""
    if not isinstance(index, Index):
        raise ValueError(f"index must be an htree_jax.Index(q, k, w), got {type(index).__name__}")
    B, T = q.shape[:2]
    H_kv = k.shape[2]
    for name, x, ndim in (("index.q", index.q, 4), ("index.k", index.k, 4), ("index.w", index.w, 3)):
        if getattr(x, "ndim", None) != ndim or tuple(x.shape[:2]) != (B, T):
            raise ValueError(f"{name} must be [B, T, ...] with {ndim} axes, B = {B} and T = {T} as q's, got "
                             f"{getattr(x, 'shape', None)}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got {x.dtype}")
    H_I, D_I = index.q.shape[2:]
    H_ik = index.k.shape[2]
    if index.k.shape[3] != D_I:
        raise ValueError(f"index.k's features ({index.k.shape[3]}) must equal index.q's ({D_I})")
    if H_ik not in (1, H_kv):
        raise ValueError(f"index.k's heads must be 1 (shared) or H_kv = {H_kv}, got {H_ik}")
    if H_I % H_ik:
        raise ValueError(f"index.q's heads ({H_I}) must be a multiple of index.k's ({H_ik})")
    if index.w.shape[2] != H_I:
        raise ValueError(f"index.w must be [B, T, H_I] with H_I = {H_I} as index.q's, got {index.w.shape}")


def key_head_of(num_kv_heads: int, num_key_heads: int):
    """`[H_kv]` int: the index key head each kv head ranks with (SPEC 13)."""
    return jnp.arange(num_kv_heads) // (num_kv_heads // num_key_heads)


def per_kv_head(index: Index, num_kv_heads: int):
    """`(q [B, T, H_kv, n_i, D_I], w [B, T, H_kv, n_i], key_head [H_kv])`: each kv head's
    index heads (`n_i = H_I / H_ik` of them) and the index key head it ranks with."""
    B, T, H_I, D_I = index.q.shape
    H_ik = index.k.shape[2]
    n_i = H_I // H_ik
    key_head = key_head_of(num_kv_heads, H_ik)
    q = jnp.take(index.q.reshape(B, T, H_ik, n_i, D_I), key_head, axis=2)
    w = jnp.take(index.w.reshape(B, T, H_ik, n_i), key_head, axis=2)
    return q, w, key_head


def index_tree(index: Index, config, num_kv_heads: int):
    """The index keys' tree (SPEC 13: `k`'s pooling, section 1, in `index.k`'s dtype),
    each layer `[B, N_l, H_kv, D_I]`: kv head `h`'s key head's."""
    layers = [index.k]
    for _ in config.layer_sizes(index.k.shape[1])[1:]:
        layers.append(pool_layer(layers[-1], config.compression_rate))
    key_head = key_head_of(num_kv_heads, index.k.shape[2])
    return [jnp.take(x, key_head, axis=2) for x in layers]


def index_scores(iq, iw, gathered):
    """`x [C, M] = sum_i iw[c, i] * relu(<iq[c, i], gathered[c, m]>)` in float32:
    `iq [C, n_i, D_I]`, `iw [C, n_i]`, `gathered [C, M, D_I]` (the candidates' index keys)."""
    dots = jnp.einsum("cid,cmd->cim", iq.astype(jnp.float32), gathered.astype(jnp.float32),
                      precision=lax.Precision.HIGHEST)
    return jnp.einsum("ci,cim->cm", iw.astype(jnp.float32), jax.nn.relu(dots), precision=lax.Precision.HIGHEST)


def pack_index_scores(x, positions, log_n: int):
    """SPEC 13's keys: float32 `x` as an order-preserving non-negative int32 (`u = bits ^
    0x80000000` for `x >= 0`, `~bits` below, as uint32, then `u >> 1`; -0 as +0, NaN as 0),
    the low `log_n` bits replaced by `~p`."""
    mask = (1 << log_n) - 1
    x = x.astype(jnp.float32)
    x = jnp.where(x == 0, jnp.float32(0), x)
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    u = jnp.where(bits >= jnp.uint32(1 << 31), ~bits, bits ^ jnp.uint32(1 << 31))
    u = jnp.where(jnp.isnan(x), jnp.uint32(0), u >> 1)
    return (u.astype(jnp.int32) & ~mask) | (mask - positions)


def forced_index_key(positions, log_n: int):
    """The rightmost position's key: above every other (SPEC 13)."""
    mask = (1 << log_n) - 1
    return (FORCED_INDEX_KEY & ~mask) | (mask - positions)


def index_kl(ranked_scores, x, in_norm):
    """SPEC 13's loss at one layer, `[C]`: `KL(P || softmax_R(x))`, `P` the group-summed
    softmax importance of `ranked_scores [C, G, M]` over `R = in_norm [C, M]`, normalised
    (a constant: no gradient); 0 where `R` is empty. The gradient reaches `x` only."""
    imp = importance(lax.stop_gradient(ranked_scores), in_norm, "softmax")
    imp = jnp.where(in_norm, imp, 0.0)
    total = jnp.sum(imp, axis=-1, keepdims=True)
    P = imp / jnp.where(total > 0, total, 1.0)
    xr = jnp.where(in_norm, x, -jnp.inf)
    mx = jnp.max(xr, axis=-1, keepdims=True)
    mx = lax.stop_gradient(jnp.where(jnp.isfinite(mx), mx, 0.0))
    z = jnp.sum(jnp.where(in_norm, jnp.exp(xr - mx), 0.0), axis=-1, keepdims=True)
    log_q = x - mx - jnp.log(jnp.where(z > 0, z, 1.0))  # an empty R: 0, and no NaN in the gradient
    live = in_norm & (P > 0)
    terms = jnp.where(live, P * (jnp.log(jnp.where(live, P, 1.0)) - jnp.where(live, log_q, 0.0)), 0.0)
    return jnp.sum(terms, axis=-1)


__all__ = ["Index", "IndexerConfig", "check_index", "forced_index_key", "index_kl", "index_scores", "index_tree", "pack_index_scores",
           "per_kv_head"]
