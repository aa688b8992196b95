"""The block-selection forward once the blocks' selections are known (SPEC 12): the tree,
the queries and the selections laid out for `merge.block_merge_pallas`, one launch for
every layer's merge. The selections themselves come from the per-query kernels run on
each block's ranking rows at its first position (`htree_jax.backends` composes them).

Device memory beyond inputs and output: the tree (`build_tree`, the input dtype), each
layer padded to a power of two of nodes with its `(b, h_kv)` rows contiguous (one copy
of the tree), the queries padded to a multiple of `b` positions and a power of two of
heads and features where they are not, the selection lists (`(L - 1) * B * T / b *
H_kv * width` int32) and the rows' log-sum-exp (`B * T * H` float32).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from htree_jax.core.config import HTreeConfig
from pallas_kernels.block import mosaic_merge
from pallas_kernels.block.layout import row_layout
from pallas_kernels.block.merge import BlockLaunch, BlockStatic, block_merge_pallas, block_queries, selection_lists
from pallas_kernels.shared.common import next_power_of_two, pad_rope_halves
from pallas_kernels.shared.configs import BlockConfig, KernelConfigs
from pallas_kernels.shared.guarded import KernelCall
from pallas_kernels.shared.kernels import MERGE_ROUTES, BlockKernels


@dataclasses.dataclass(frozen=True)
class Merge:
    """One kernel of the block merge (`BlockKernels.merge` names it): its launch,
    with `merge.block_merge_pallas`'s arguments and results; the candidates it steps
    (None: `BlockConfig.merge_tile`); whether it runs interpreted; and `check(st, K, V,
    dtype)`, raising a ValueError that names the rule where it cannot run the launch."""

    launch: Callable
    tile: int | None = None
    interprets: bool = False
    check: Callable | None = None


def _check_mosaic(st, K, V, dtype) -> None:
    mosaic_merge.check_mosaic_dims(st.r, st.rows, K, V, dtype)


# The merge's kernels (`docs/backends.md`): the Pallas-Triton one (CI runs it
# interpreted) and Pallas Mosaic GPU. Each takes packed rows (`firsts`) and a context
# shard's rows (`offset`). (A Triton one through jax-triton ran 0.93x Pallas-Triton's
# at 128K and left on 12-07: journal.)
MERGES = {
    "pallas_triton": Merge(block_merge_pallas, interprets=True),
    "mosaic_gpu": Merge(mosaic_merge.block_merge_mosaic, tile=mosaic_merge.TILE, check=_check_mosaic),
}
assert tuple(MERGES) == MERGE_ROUTES, "kernels.MERGE_ROUTES names the merges here"


def block_static(config: HTreeConfig, T: int, G: int, K: int, V: int, dtype, tile: int = BlockConfig.merge_tile,
                 num_warps: int = BlockConfig.merge_num_warps) -> BlockStatic:
    """The launch for `T` tokens, `G` heads per kv head, head dims `K, V` in `dtype`."""
    r = config.compression_rate
    gp, half, vp = next_power_of_two(G), next_power_of_two(K // 2, 16), next_power_of_two(V, 16)
    tile = max(next_power_of_two(tile), r, 16)
    return BlockStatic(r=r, top_k=config.top_k, num_layers=config.num_layers(T),
                       queries=block_queries(r, gp, max(2 * half, vp)), group=gp, half=half, vp=vp, tile=tile,
                       width=next_power_of_two(config.top_k + tile), alpha=config.score_scale(K),
                       exact=jnp.dtype(dtype) == jnp.float32, num_warps=num_warps)


def merge_static(config: HTreeConfig, T: int, G: int, K: int, V: int, dtype, block: BlockConfig,
                 merge: str) -> BlockStatic:
    """The merge's launch: `block_static` at the kernel's own step where it has one."""
    tile = MERGES[merge].tile if merge in MERGES and MERGES[merge].tile else block.merge_tile
    return block_static(config, T, G, K, V, dtype, tile, block.merge_num_warps)


def on_hopper() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.x), where
    Mosaic GPU's WGMMA and TMA run."""
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9")


def chosen_merge(route: str, config: HTreeConfig, T: int, G: int, K: int, V: int, dtype, block: BlockConfig,
                 interpret: bool) -> str:
    """The merge `BlockKernels.merge = route` names for a launch; `"auto"`: Mosaic
    GPU where it is the fastest measured (a Hopper GPU, not interpreted) and takes the
    shape (`check_mosaic_dims`: 16-bit inputs, the head dims and rows it holds), else
    Pallas-Triton. Any other name is itself (`check_merge_route` checks it)."""
    if route != "auto":
        return route
    if interpret or not on_hopper():
        return "pallas_triton"
    st = merge_static(config, T, G, K, V, dtype, block, "mosaic_gpu")
    try:
        _check_mosaic(st, K, V, dtype)
    except ValueError:
        return "pallas_triton"
    return "mosaic_gpu"


def check_merge_route(route: str, st: BlockStatic, K: int, V: int, dtype, interpret: bool) -> None:
    """`route` must be one of `MERGES` and able to run the launch `st` (head dims `K`, `V`,
    inputs in `dtype`) here: the kernels off Pallas-Triton have no interpret mode, the
    Mosaic GPU one takes only what
    `mosaic_merge.check_mosaic_dims` allows. Raises a ValueError naming the rule."""
    if route not in MERGES:
        raise ValueError(f"BlockKernels.merge must be one of {MERGE_ROUTES}, got {route!r}")
    merge = MERGES[route]
    if interpret and not merge.interprets:
        raise ValueError(f"BlockKernels(merge={route!r}) has no interpret mode; interpreted runs take "
                         "'pallas_triton'")
    if merge.check is not None:
        merge.check(st, K, V, dtype)


def forward(q, k, v, operands: dict, call: KernelCall):
    """`block_forward_pallas` as SPEC 10's guard calls it (`shared/guarded.py`):
    `operands["selections"]` over `operands["layout"]`, the merge `call.kernels.merge`, the
    launch `call.tuning.block`. Returns `(o, lse, (), None)` (the selections are the
    caller's)."""
    config, block, merge, interpret = call.config, call.tuning.block, call.kernels.merge, call.interpret
    selections, layout = operands["selections"], operands["layout"]
    K, H_kv, V = q.shape[-1], k.shape[2], v.shape[-1]
    G = q.shape[2] // H_kv
    st = layout.static(merge_static(config, layout.length, G, K, V, q.dtype, block, merge))
    check_merge_route(merge, st, K, V, q.dtype, interpret)
    if len(selections) != st.num_layers - 1:
        raise ValueError(f"selections: {st.num_layers - 1} layers' lists expected, got {len(selections)}")
    launch = BlockLaunch(config, st, K, layout.table_rows(config, st), interpret=interpret)
    o, lse = MERGES[merge].launch(layout.rows(pad_rope_halves(q, st.half), H_kv, st), layout.layers(k, v, config, st),
                                  selection_lists(selections, st), launch, **layout.extras())
    return layout.tokens(o[:, :, :, :G, :V]), layout.tokens(lse[:, :, :, :G]), (), None


@functools.partial(jax.jit, static_argnames=("config", "block", "merge", "interpret"))
def block_forward_pallas(q, k, v, selections, layout=None, *, config: HTreeConfig, block: BlockConfig = BlockConfig(),
                         merge: str = "pallas_triton", interpret: bool = False):
    """htree attention with block selection (SPEC 12, `config.selection_block =
    compression_rate`) given the blocks' selections: `q [B, T, H, K]`, `k [B, T, H_kv,
    K]`, `v [B, T, H_kv, V]` (rope layout), `selections` the node lists of layers `L-1 ..
    1`, each `[B, ceil(T / b), H_kv, top_k]` int32 (`-1` padded), one per block.
    Returns `(o [B, T, H, V]` in q's dtype, `lse [B, T, H]` float32)`. Inputs validated
    by the caller. `layout` (`layout.py`): where the rows and the tree come from; None,
    one document a row (`row_layout`). A context shard, `row_layout(q, k, config,
    offset)`: `q [B, S, H, K]` the queries at positions `offset .. offset + S - 1` of the
    `T` tokens of `k`, `v`, `selections` its blocks' (`[B, S / b, H_kv, top_k]`). Packed
    rows, `PackedLayout`: `selections` the virtual blocks' lists (virtual tree rows,
    `[B, T_v / b, H_kv, top_k]`). `merge` names the merge's kernel (`MERGES`; each takes
    every layout), `block` its launch (`BlockConfig.merge_tile`, `merge_num_warps`)."""
    operands = {"selections": selections, "layout": row_layout(q, k, config) if layout is None else layout}
    call = KernelCall(config, KernelConfigs(block=block), interpret, kernels=BlockKernels(merge=merge))
    return forward(q, k, v, operands, call)[:2]
