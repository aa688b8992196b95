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
from htree_jax.core.tree import build_tree
from pallas_kernels.block import mosaic_merge
from pallas_kernels.block.merge import (
    BlockStatic,
    block_merge_pallas,
    block_queries,
    layer_arrays,
    selection_lists,
)
from pallas_kernels.shared.common import next_power_of_two, pad_axis, pad_rope_halves
from pallas_kernels.shared.configs import MERGE_ROUTES, BlockConfig


@dataclasses.dataclass(frozen=True)
class Merge:
    """One kernel of the block merge (`KernelConfigs.block_merge` names it): its launch,
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
assert tuple(MERGES) == MERGE_ROUTES, "configs.MERGE_ROUTES names the merges here"


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


def table_positions(config: HTreeConfig, T: int, st: BlockStatic) -> int:
    """RoPE positions the merge reads: every layer's `n` (at most `top_k * r` below the
    top, the top layer's node count there), rounded up to the tile."""
    most = max(config.max_candidates, config.layer_sizes(T)[-1])
    return next_power_of_two(most, st.tile)


def block_layout(x, num_kv_heads: int, st: BlockStatic, Tp: int):
    """Per-row arrays as the block kernels read them: `[B, T, H, ...]` -> `[B, Tp, H_kv,
    Gp, ...]`, the positions padded to `Tp` (a multiple of `b`), each kv head's heads to
    `st.group`."""
    B, T, H = x.shape[:3]
    x = x.reshape((B, T, num_kv_heads, H // num_kv_heads) + x.shape[3:])
    return pad_axis(pad_axis(x, 1, Tp), 3, st.group)


def check_shard_offset(S: int, b: int, offset):
    """A context shard's rows: whole blocks (`S` a multiple of `b`); a ValueError naming
    the rule otherwise. Returns `offset` as int32."""
    if S % b:
        raise ValueError(f"block selection's kernels take a context shard of whole blocks: its {S} queries must be "
                         f"a multiple of selection_block = {b}")
    return jnp.asarray(offset, jnp.int32)


def on_hopper() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.x), where
    Mosaic GPU's WGMMA and TMA run."""
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9")


def chosen_merge(route: str, config: HTreeConfig, T: int, G: int, K: int, V: int, dtype, block: BlockConfig,
                 interpret: bool) -> str:
    """The merge `KernelConfigs.block_merge = route` names for a launch; `"auto"`: Mosaic
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
        raise ValueError(f"block_merge must be one of {MERGE_ROUTES}, got {route!r}")
    merge = MERGES[route]
    if interpret and not merge.interprets:
        raise ValueError(f"block_merge={route!r} has no interpret mode; interpreted runs take 'pallas_triton'")
    if merge.check is not None:
        merge.check(st, K, V, dtype)


@functools.partial(jax.jit, static_argnames=("config", "block", "merge", "interpret"))
def block_forward_pallas(q, k, v, selections, *, config: HTreeConfig, block: BlockConfig = BlockConfig(),
                         merge: str = "pallas_triton", interpret: bool = False, offset=None):
    """htree attention with block selection (SPEC 12, `config.selection_block =
    compression_rate`) given the blocks' selections: `q [B, T, H, K]`, `k [B, T, H_kv,
    K]`, `v [B, T, H_kv, V]` (rope layout), `selections` the node lists of layers `L-1 ..
    1`, each `[B, ceil(T / b), H_kv, top_k]` int32 (`-1` padded), one per block.
    Returns `(o [B, T, H, V]` in q's dtype, `lse [B, T, H]` float32)`. Inputs validated
    by the caller; one document per row. `merge` names the merge's kernel (`MERGES`),
    `block` its launch (`BlockConfig.merge_tile`, `merge_num_warps`). A context shard:
    `q [B, S, H, K]` the queries at positions `offset .. offset + S - 1` (`offset` int32,
    a multiple of `b`; `S` too) of the `T` tokens of `k`, `v`, `selections` its blocks'
    (`[B, S / b, H_kv, top_k]`)."""
    B, S, H, K = q.shape
    T, H_kv, V = k.shape[1], k.shape[2], v.shape[-1]
    G, b = H // H_kv, config.selection_block
    st = merge_static(config, T, G, K, V, q.dtype, block, merge)
    check_merge_route(merge, st, K, V, q.dtype, interpret)
    if len(selections) != st.num_layers - 1:
        raise ValueError(f"selections: {st.num_layers - 1} layers' lists expected, got {len(selections)}")
    Tp = -(-S // b) * b
    q5 = block_layout(pad_rope_halves(q, st.half), H_kv, st, Tp)
    layers = layer_arrays(build_tree(k, v, config), st)
    shard = {} if offset is None else dict(offset=check_shard_offset(S, b, offset))
    o, lse = MERGES[merge].launch(q5, layers, selection_lists(selections, st), config, st, K,
                                  table_positions(config, T, st), interpret=interpret, **shard)
    o = o[:, :S, :, :G, :V].reshape(B, S, H, V)
    return o, lse[:, :S, :, :G].reshape(B, S, H)
