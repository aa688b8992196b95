"""Score bounds (docs/SPEC.md section 11, `selection="bound"`): the feature groups whose
norms RoPE leaves unchanged, each node's radii around its mean key, and the bound a
query's score at a node cannot exceed under it.

Features are in `rope_layout` order, as every implementation holds q and k: the first
half `lo` and the second half `hi` of the feature axis, rotate-half pairing `lo[j]` with
`hi[j]`; the first `(K - R) / 2` pairs are unrotated (`R = rope_dim`), so each of their
features is a group of its own, and each rotated pair is one group: `n_groups = (K - R)
+ R / 2`, in the order `[lo unrotated, hi unrotated, rotated pairs]`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def num_groups(head_dim: int, rope_dim: int | None) -> int:
    """`(K - R) + R / 2`: the feature groups of SPEC 11 (`rope_dim=None`: `R = K`)."""
    R = head_dim if rope_dim is None else rope_dim
    return head_dim - R + R // 2


def group_count(K: int, rope_dim: int | None) -> int:
    """How many feature groups `group_norms` gives for `K` features: each unrotated
    feature alone, each rotated pair together."""
    unrotated = (K - (K if rope_dim is None else rope_dim)) // 2
    return K // 2 + unrotated


def group_norms(x, rope_dim: int | None):
    """The L2 norm of each feature group of `x [..., K]` (`rope_layout` order), float32
    `[..., n_groups]`."""
    x = x.astype(jnp.float32)
    K = x.shape[-1]
    half, unrotated = K // 2, (K - (K if rope_dim is None else rope_dim)) // 2
    lo, hi = x[..., :half], x[..., half:]
    pairs = jnp.sqrt(lo[..., unrotated:] ** 2 + hi[..., unrotated:] ** 2)
    return jnp.concatenate([jnp.abs(lo[..., :unrotated]), jnp.abs(hi[..., :unrotated]), pairs], axis=-1)


def children_radii(child_keys, child_radii, parent_keys, exists, rope_dim: int | None):
    """SPEC 11 for a batch of parents: `rho = max over the existing children j of (rho_j +
    ||K_j - K_parent||)` per feature group, in float32. `child_keys [..., r, H_kv, K]`
    (stored), `child_radii [..., r, H_kv, n_groups]` (or 0: the children are tokens),
    `parent_keys [..., H_kv, K]` (stored), `exists [..., r]` -> `[..., H_kv, n_groups]`, 0
    for a parent without children. The one arithmetic of the whole tree's radii
    (`layer_radii`) and the decode cache's (`htree_jax.decode`), so the two agree bit for bit."""
    reach = child_radii + group_norms(child_keys.astype(jnp.float32)
                                      - parent_keys.astype(jnp.float32)[..., None, :, :], rope_dim)
    return jnp.max(jnp.where(exists[..., None, None], reach, 0.0), axis=-3)


def layer_radii(keys_below, radii_below, keys_up, compression_rate: int, rope_dim: int | None, exists_below=None):
    """One layer up: `children_radii` of every parent, from the stored keys.

    `keys_below [B, N, H_kv, K]` and their radii `radii_below [B, N, H_kv, n_groups]`;
    `keys_up [B, ceil(N/r), H_kv, K]` (their parents' stored means); `exists_below [B, N]`
    (packed trees: 0 where no token sits; `None`: all `N` exist). Returns float32 `[B,
    ceil(N/r), H_kv, n_groups]`."""
    B, N, H, K = keys_below.shape
    r = compression_rate
    P = keys_up.shape[1]
    pad = P * r - N
    children = jnp.pad(keys_below, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(B, P, r, H, K)
    rho = jnp.pad(radii_below, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(B, P, r, H, -1)
    exists = np.arange(P * r) < N if exists_below is None else jnp.pad(exists_below, ((0, 0), (0, pad))) > 0
    exists = jnp.broadcast_to(jnp.asarray(exists).reshape(-1, P, r), (B, P, r))
    return children_radii(children, rho, keys_up, exists, rope_dim)


def tree_radii(keys, compression_rate: int, rope_dim: int | None, exists=None):
    """Radii of every layer of a tree, bottom first: `keys` the stored layers' keys
    `[B, N_l, H_kv, K]`; `exists` (packed trees) each layer's `[B, N_l]` occupancy, or
    None. Layer 0's radii are 0."""
    radii = [jnp.zeros(keys[0].shape[:3] + (num_groups(keys[0].shape[-1], rope_dim),), jnp.float32)]
    for l in range(1, len(keys)):
        radii.append(layer_radii(keys[l - 1], radii[-1], keys[l], compression_rate, rope_dim,
                                 None if exists is None else exists[l - 1]))
    return radii


def bound_scores(scores, q, radii, alpha: float, rope_dim: int | None):
    """SPEC 11's bound `b[g, p] = s[g, p] + alpha * sum_π ||q_g[π]|| rho_p[π]`: `scores
    [C, G, M]`, `q [C, G, K]` (`rope_layout` order), `radii [C, M, n_groups]` -> `[C, G, M]`."""
    reach = jnp.einsum("cgn,cmn->cgm", group_norms(q, rope_dim), radii, precision="highest")
    return scores + alpha * reach
