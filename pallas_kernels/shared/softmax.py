"""The online softmax (SPEC 2.4) that every Pallas kernel folds its candidates with.

A row's state is `(m, S, U)`: `m [rows]` the largest merged score so far, `S [rows]` the
sum of the merged scores' exponentials shifted by `m`, `U` their weighted values, `[rows,
Vp]` or a tuple of pieces `[rows, size]` (kernels that read the values in power-of-two
pieces), all float32. Scores are `NEG_INF` where a candidate is not merged; a row that has
merged nothing keeps `m = NEG_INF` and is shifted by 0 (`_shift`), so no `inf - inf`
arises and its weights are 0.

- `fold`: tiles of scores into the state, one rescale for all of them;
- `fold_max_sum`: the same for `(m, S)` alone (the importance's normaliser, SPEC 2.3);
- `combine`, `combine_max_sum`: partial states of splits (`[..., splits, rows]`) folded
  into one (the decode walk's split programs);
- `normalized`, `log_sum_exp`: the output `U / S` and the rows' `m + log S` (what the
  backward reads).

`exp=jnp.exp2` (and `log=jnp.log2`): scores and `m` in base 2, `log2(e)` times the
natural ones, which the top layer's kernels fold in. The kernels that are not
Pallas-Triton transcribe `fold` and `normalized` / `log_sum_exp` into their own language
(`pallas_kernels/block/mosaic_merge.py`).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.shared.common import NEG_INF


def _shift(m, tiles):
    """`(m_new, m_safe)`: the running max after `tiles` (each `[rows, n]`) and what the
    exponentials subtract (0 for a row that has merged nothing)."""
    m_new = m
    for scores in tiles:
        m_new = jnp.maximum(m_new, jnp.max(scores, axis=1))
    return m_new, jnp.where(m_new == NEG_INF, 0.0, m_new)


def _each(acc, f):
    return tuple(f(u) for u in acc) if isinstance(acc, tuple) else f(acc)


def _add(acc, products):
    return tuple(u + p for u, p in zip(acc, products)) if isinstance(acc, tuple) else acc + products


def fold(state, tiles, exp=jnp.exp):
    """`state` with `tiles` merged: a list of `(scores [rows, n], weighted)`, scores
    `NEG_INF` where not merged, `weighted(w)` the tile's values weighted by `w [rows, n]`
    (`w @ values`, shaped as `U`: an array or its tuple of pieces). Called once a tile,
    after the tile's weights exist, so a kernel may read its values there."""
    m, total, acc = state
    m_new, m_safe = _shift(m, [scores for scores, _ in tiles])
    decay = exp(m - m_safe)
    total, acc = total * decay, _each(acc, lambda u: u * decay[:, None])
    for scores, weighted in tiles:
        w = exp(scores - m_safe[:, None])
        total = total + jnp.sum(w, axis=1)
        acc = _add(acc, weighted(w))
    return m_new, total, acc


def fold_max_sum(m, total, scores, exp=jnp.exp):
    """`fold` of `scores [rows, n]` (`NEG_INF` where excluded) into a running max and sum
    alone: `(m, S)`."""
    m_new, m_safe = _shift(m, [scores])
    total = total * exp(m - m_safe) + jnp.sum(exp(scores - m_safe[:, None]), axis=1)
    return m_new, total


def combine(state, partials):
    """The running state `(m, S [..., rows], U [..., rows, V])` with partial states
    `(m, S [..., splits, rows], U [..., splits, rows, V])` folded in (an empty split:
    `m = NEG_INF`, `S = U = 0`)."""
    m, S, U = state
    pm, pS, pU = partials
    m_new = jnp.maximum(m, jnp.max(pm, axis=-2))
    m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
    decay = jnp.exp(m - m_safe)
    w = jnp.exp(pm - m_safe[..., None, :])  # [..., splits, rows]; 0 for empty splits
    S = S * decay + jnp.sum(pS * w, axis=-2)
    U = U * decay[..., None] + jnp.sum(pU * w[..., None], axis=-3)
    return m_new, S, U


def combine_max_sum(m, total):
    """Per-split running `(max, sum)` `[..., splits, rows]` -> the rows' `(max, sum)`."""
    m_all = jnp.max(m, axis=-2)
    m_safe = jnp.where(m_all == NEG_INF, 0.0, m_all)
    return m_all, jnp.sum(total * jnp.exp(m - m_safe[..., None, :]), axis=-2)


def normalized(state):
    """The output `U / S [rows, Vp]` (or its pieces) of a state."""
    _, total, acc = state
    return _each(acc, lambda u: u / total[:, None])


def log_sum_exp(state, log=jnp.log):
    """Each row's `m + log S` `[rows]`: the log-sum-exp of its merged scores."""
    m, total, _ = state
    return m + log(total)


__all__ = ["combine", "combine_max_sum", "fold", "fold_max_sum", "log_sum_exp", "normalized"]
