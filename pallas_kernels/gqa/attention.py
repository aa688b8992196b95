"""The GQA family's differentiable call (`gqa_attention`): its forward and backward passes
as SPEC 10's guard calls them, paired as one `jax.custom_vjp` at the bottom
(`shared/guarded.py`).

The backward reads the forward's selections where `KernelConfigs.save_selections`
(the default: 8-10% faster forward+backward for `(L-1) * B*T*H_kv*top_k` int32 kept,
journal, 2026-11-23 (session 2)) or the rows are packed (its backward needs them), and
otherwise selects again with the forward's own kernels (the same selections, the same
gradient bits). Deterministic: the backward sums every gradient in a fixed order.
"""

from __future__ import annotations

from pallas_kernels.gqa.backward import htree_backward_pallas
from pallas_kernels.gqa.forward import htree_forward_pallas
from pallas_kernels.shared.guarded import KernelCall, Saved, guarded_vjp


def forward(q, k, v, operands, call: KernelCall):
    """`htree_forward_pallas` as the guard calls it: `(o, lse, (selections, *importance),
    the selections the backward keeps or None)`."""
    o, selected, lse, *exported = htree_forward_pallas(
        q, k, v, config=call.config, block_sizes=call.tuning, interpret=call.interpret, return_lse=True,
        packing=operands["packing"], positions=operands["positions"], return_importance=call.export)
    kept = selected if call.tuning.save_selections or operands["packing"] is not None else None
    return o, lse, (selected, *exported), kept


def backward(q, k, v, saved: Saved, call: KernelCall):
    """`htree_backward_pallas` as the guard calls it: `(dq, dk, dv)`."""
    return htree_backward_pallas(q, k, v, saved.o, saved.lse, saved.do, config=call.config, block_sizes=call.tuning,
                                 interpret=call.interpret, dead_rows=saved.dead, selections=saved.residual,
                                 packing=saved.operands["packing"], positions=saved.operands["positions"])


attention = guarded_vjp(forward, backward)


def gqa_attention(q, k, v, call: KernelCall, *, positions=None, packing=None):
    """htree attention on the GQA family, differentiable (its backward is
    `htree_backward_pallas`): `q [B, S, H, K]`, `k [B, T, H_kv, K]`, `v [B, T, H_kv, V]`
    in `rope_layout` order, validated by the caller; `call` what it is compiled for
    (`KernelCall`: the function, the kernels' configs, interpret mode, the export);
    `positions [S]` the queries' positions among `k`'s
    tokens (None: `S = T`); `packing` packed rows (`htree_jax.core.packing.Packing`; the
    selections returned are then rows of the virtual tree). Returns `(o [B, S, H, V],
    selections, *importance)` (the importance with `call.export`, SPEC 8)."""
    return attention(q, k, v, {"positions": positions, "packing": packing}, call)


__all__ = ["attention", "backward", "forward", "gqa_attention"]
