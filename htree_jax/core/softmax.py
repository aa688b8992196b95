"""The arithmetic of a layer's softmax (docs/SPEC.md sections 2.3 and 2.4): the group
importance of the candidates, and the online-softmax fold of the merged ones into each
head's state `(m, S, U)`. Plain JAX on `[C, ...]` batches of queries: the reference's
walk and the kernels' plain-JAX twins use the same functions.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def importance(scores, in_norm, mode):
    """Group importance (SPEC 2.3). `scores [C, G, M]` float32, `in_norm [C, M]` (the
    set R) -> `[C, M]`; 0 where R is empty. The normaliser comes from R; every position
    gets its formula value (the rightmost too, which SPEC 8 exports); the caller forces
    the rightmost for the selection and masks invalid positions."""
    has_norm = jnp.any(in_norm, axis=-1, keepdims=True)  # [C, 1]
    s_r = jnp.where(in_norm[:, None, :], scores, -jnp.inf)
    if mode == "softmax":
        mx = jnp.max(s_r, axis=-1, keepdims=True)  # [C, G, 1]
        mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
        lse = mx + jnp.log(jnp.sum(jnp.exp(s_r - mx), axis=-1, keepdims=True))
        imp = jnp.sum(jnp.exp(scores - lse), axis=1)
    elif mode == "shared_max":
        mx = jnp.max(s_r, axis=(1, 2), keepdims=True)  # [C, 1, 1]
        mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
        imp = jnp.sum(jnp.exp(scores - mx), axis=1)
    else:
        raise ValueError(f"unknown importance mode {mode!r}")
    return jnp.where(has_norm, imp, 0.0)


def merge(state, scores, values, merged):
    """SPEC 2.4: online-softmax fold of the merged candidates into `(m, S, U)`.

    `state`: `m, S [C, G]`, `U [C, G, V]`; `scores [C, G, M]`; `values [C, M, V]`;
    `merged [C, M]`. A layer with nothing merged leaves the state as it is. Values of
    candidates not merged are zeroed before the product: a weight of 0 times a NaN or
    infinite value would still be NaN (SPEC 10).
    """
    m, S, U = state
    s_m = jnp.where(merged[:, None, :], scores, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s_m, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    w = jnp.exp(s_m - m_safe[..., None])
    decay = jnp.exp(m - m_safe)
    S = S * decay + jnp.sum(w, axis=-1)
    values = jnp.where(merged[..., None], values, 0.0)
    U = U * decay[..., None] + jnp.einsum("cgm,cmv->cgv", w, values, precision=lax.Precision.HIGHEST)
    return m_new, S, U


def normalize(state):
    """The output `o = U / S` of a softmax state `(m, S [..., G], U [..., G, V])`."""
    _, S, U = state
    return U / S[..., None]
