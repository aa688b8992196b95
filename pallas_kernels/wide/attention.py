"""The wide family's differentiable call (`wide_attention`, groups of 32 or more heads per
kv head: latent attention): its forward and backward passes as SPEC 10's guard calls
them, paired as one `jax.custom_vjp` at the bottom (`shared/guarded.py`). The values
may be the keys' first `value_dim` latent features (`v=None`), read from the keys
without a copy in the forward; their gradient is then in `dk`. Deterministic, as the
GQA family's.
"""

from __future__ import annotations

from pallas_kernels.shared.guarded import KernelCall, Saved, guarded_vjp
from pallas_kernels.wide.backward import wide_backward_pallas
from pallas_kernels.wide.forward import wide_forward_pallas


def forward(q, k, v, operands, call: KernelCall):
    """`wide_forward_pallas` as the guard calls it: `(o, lse, (selections, *importance),
    the selections the backward keeps or None)`."""
    o, selected, lse, *exported = wide_forward_pallas(
        q, k, v, config=call.config, block_sizes=call.tuning, interpret=call.interpret, return_lse=True,
        positions=operands["positions"], return_importance=call.export, value_dim=call.value_dim,
        q_layout=call.q_layout)
    return o, lse, (selected, *exported), selected if call.tuning.save_selections else None


def backward(q, k, v, saved: Saved, call: KernelCall):
    """`wide_backward_pallas` as the guard calls it: `(dq, dk, dv)`, `dv` None for values
    read from the keys."""
    return wide_backward_pallas(q, k, v, saved.o, saved.lse, saved.do, config=call.config, block_sizes=call.tuning,
                                interpret=call.interpret, dead_rows=saved.dead, selections=saved.residual,
                                positions=saved.operands["positions"], value_dim=call.value_dim,
                                q_layout=call.q_layout)


attention = guarded_vjp(forward, backward)


def wide_attention(q, k, v, call: KernelCall, *, positions=None):
    """htree attention on the wide family, differentiable (its backward is
    `wide_backward_pallas`): `q [B, S, H, K]` (`call.q_layout`: `"rope_layout"`, or
    `"given"`, the caller's order, sliced as it is), `k [B, T, H_kv, K]` in `rope_layout`
    order, `v [B, T, H_kv, V]`, or None with `call.value_dim` (the values are the first
    `value_dim` latent features of `k`), validated by the caller; the rest as
    `gqa_attention` takes them. Returns `(o [B, S, H, V], selections, *importance)`."""
    return attention(q, k, v, {"positions": positions}, call)


__all__ = ["attention", "backward", "forward", "wide_attention"]
