"""Block selection's differentiable call once the blocks' selections are known
(`attention` over `block_operands`, SPEC 12): the block merge and the block backward as
SPEC 10's guard calls them, paired as one `jax.custom_vjp` (`shared/guarded.py`). The
selections come from the per-query families run on each block's ranking rows
(`htree_jax.routes` composes the two).

Determinism follows `BlockKernels.sums` (`backward.chosen_sum`): on a GPU, by
default, each block's key and value gradients are written as partial sums and summed by
node in block order (bitwise the same run to run); interpreted, or with `"atomics"`,
they are added into the nodes with float32 atomics, in no fixed order, so `dk` and `dv`
may differ in their last bits run to run. `dq` is summed in a fixed order either way.
"""

from __future__ import annotations

from pallas_kernels.block.backward import block_backward_pallas
from pallas_kernels.block.forward import forward
from pallas_kernels.block.layout import PackedLayout, row_layout
from pallas_kernels.shared.guarded import KernelCall, Saved, guarded_vjp


def backward(q, k, v, saved: Saved, call: KernelCall):
    """`block_backward_pallas` over `saved.operands["layout"]`, as the guard calls it: `(dq, dk, dv)`."""
    operands = saved.operands
    return block_backward_pallas(q, k, v, saved.o, saved.lse, saved.do, operands["selections"], operands["layout"],
                                 config=call.config, block=call.tuning.block, kernels=call.kernels,
                                 interpret=call.interpret,
                                 dead_rows=saved.dead)


attention = guarded_vjp(forward, backward)


def block_operands(q, k, selections, config, *, layout: PackedLayout | None = None, positions=None) -> dict:
    """`attention`'s operands: htree attention with block selection given the blocks'
    `selections` (layers `L-1 .. 1`, each `[B, ceil(T / b), H_kv, top_k]` int32, `-1`
    padded; constant under autodiff) for `q [B, T, H, K]`, `k [B, T, H_kv, K]` in
    `rope_layout` order, validated by the caller. `attention(q, k, v, operands, call)`
    then returns `(o [B, T, H, V],)` in q's dtype, `call.kernels` the kernels
    (`forward.MERGES`, the plan's walk and sums), `call.tuning.block` the launches.

    One document a row (`layout` None): `positions [S]` int32, a context shard's `q [B,
    S, H, K]` at those positions of the `T` tokens, consecutive from a multiple of `b`
    (`layout.row_layout`'s `offset`; SPEC 10's guard reads them); `dk`, `dv` are its
    share of every token's. Packed rows: `layout` their `PackedLayout` (the `Packing`
    and `firsts [B, T_v / b]`, each block's document's first top node), `selections`
    the virtual blocks' lists (virtual tree rows, `[B, T_v / b, H_kv, top_k]`)."""
    if layout is not None:
        return {"selections": list(selections), "layout": layout}
    offset = None if positions is None else positions[0].astype("int32")
    return {"selections": list(selections), "layout": row_layout(q, k, config, offset),
            **({} if positions is None else {"positions": positions})}


__all__ = ["attention", "backward", "block_operands", "forward"]
