"""A kernel family's forward and backward paired as one `jax.custom_vjp`, under SPEC 10's
guard (`htree_jax.core.non_finite`). Each family's `attention.py` builds its own with
`guarded_vjp` at its bottom, as JAX's Pallas attention defines its `custom_vjp` last.

The guard, in the forward: the non-finite entries of `k`, `v` zeroed before the family's
forward sees them (they feed the forward's own padded copies, so no input-sized copy is
kept), and the output rows from each kv head's first non-finite position on set to NaN;
the output the backward saves is the one returned, so the guard adds no output-sized
buffer either. In the backward: the NaN rows have no cotangent (`dead_rows`, applied
inside the copies of `do` and `o` the family's backward makes anyway), and the tokens
at and after the first non-finite position get no gradient (`zero_late_tokens`). With
the values inside the keys (`v=None`) a non-finite key row is a non-finite value row.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from htree_jax.core.config import HTreeConfig
from htree_jax.core.non_finite import dead_rows, first_non_finite, poison_rows, zero_late_tokens, zero_non_finite
from pallas_kernels.shared.configs import KernelConfigs
from pallas_kernels.shared.kernels import BlockKernels


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """What a family's call is compiled for (static under `jit`): the function
    (`config`), the launches (`tuning`), interpret mode, the importance export (SPEC 8),
    values read from the keys' first `value_dim` latent features (`v=None`; the wide
    family), the queries' feature order (`q_layout`, `"given"`: the wide family's), and
    block selection's kernels (`kernels`, each named: the plan's choices)."""

    config: HTreeConfig
    tuning: KernelConfigs
    interpret: bool = False
    export: bool = False
    value_dim: int | None = None
    q_layout: str = "rope_layout"
    kernels: BlockKernels = BlockKernels()


class Saved(NamedTuple):
    """What a family's backward reads besides `q, k, v` (the guarded copies): the
    forward's output `o [B, S, H, V]` and `lse [B, S, H]` float32, the cotangent `do`,
    `dead [B, S, H]` bool the rows without a cotangent, the forward's `residual` (the
    selections it kept, or None) and the call's `operands`."""

    o: Any
    lse: Any
    do: Any
    dead: Any
    residual: Any
    operands: dict


def query_positions(positions, q):
    """The queries' token positions `[S]`: `positions`, or `0 .. S-1`."""
    return jnp.arange(q.shape[1], dtype=jnp.int32) if positions is None else positions


def guarded_vjp(forward, backward):
    """`attention(q, k, v, operands, call) -> (o, *results)`: `forward` and `backward`
    as one `jax.custom_vjp` under SPEC 10's guard. `operands`: a dict of arrays that are
    not differentiated (`"positions"`, the queries' `[S]`, read by the guard too; a
    family's own, e.g. packing or block selections); `call`: a `KernelCall`.

    - `forward(q, k, v, operands, call) -> (o, lse, results, residual)` on `k`, `v` with
      their non-finite entries zeroed: `o [B, S, H, V]`, `lse [B, S, H]` float32, the
      `results` returned after `o` (a tuple: selections, importance), and `residual`,
      what the backward reads besides (e.g. the selections; None for nothing).
    - `backward(q, k, v, saved, call) -> (dq, dk, dv)`, `saved` a `Saved` (the output,
      its cotangent, the rows without one, the residual, the operands; `dv` None where
      `v` is)."""

    # One function is both the primal (`(o, *results)`) and, with `save`, the forward
    # rule (and what the backward reads).
    def guarded_forward(q, k, v, operands, call, *, save=False):
        first = first_non_finite(k, k[..., :0] if v is None else v, jnp.arange(k.shape[1], dtype=jnp.int32))
        o, lse, results, residual = forward(q, zero_non_finite(k), None if v is None else zero_non_finite(v),
                                            operands, call)
        o = poison_rows(o, query_positions(operands.get("positions"), q), first)
        return ((o, *results), (q, k, v, operands, o, lse, first, residual)) if save else (o, *results)

    def guarded_backward(call, saved, cotangents):
        q, k, v, operands, o, lse, first, residual = saved
        # Rows set to NaN depend on nothing: no cotangent flows from them (and their NaN
        # `o` must not reach `delta`); entries of k, v zeroed by the guard get no gradient.
        dead = dead_rows(query_positions(operands.get("positions"), q), first, q.shape[2])
        saved = Saved(o, lse, cotangents[0], dead, residual, operands)
        dq, dk, dv = backward(q, zero_non_finite(k), None if v is None else zero_non_finite(v), saved, call)
        return (dq, *zero_late_tokens(dk, dv, first), None)  # the selections and importance: no cotangent

    attention = jax.custom_vjp(guarded_forward, nondiff_argnums=(4,))
    attention.defvjp(functools.partial(guarded_forward, save=True), guarded_backward)
    return attention


__all__ = ["KernelCall", "Saved", "guarded_vjp", "query_positions"]
