"""Where the block kernels' rows and tree come from (SPEC 12 on one document a row, on a
context shard of one, SPEC 6 on packed rows): a layout value that the one block forward
(`forward.block_forward_pallas`) and the one block backward
(`backward.block_backward_pallas`) take, so that each is written once for every layout.

A layout supplies the launch's layer count, the queries' positions as the kernels lay
them out (`rows`) and back (`tokens`), the tree (`layers`) and the transpose of it for
the key and value gradients (`key_grads`), the RoPE table's rows, each layer's node count
and what the launches take beside (`extras`: a shard's first position, packed rows'
first top nodes):

- `RowLayout`: one document a row, `queries` of the `keys` tokens from position `offset`
  (None: all of them, from 0; a context shard: a multiple of `b`, `queries` too);
- `PackedLayout`: packed rows (`htree_jax.core.packing`), the queries and the tree laid
  out virtually, each document's blocks from a multiple of `b`, `firsts [B, T_v / b]`
  each virtual block's document's first top node.

Packed rows (SPEC 6 with SPEC 12): the queries are laid out virtually as the tree is, so
that each document's blocks start at multiples of `b` (a document starts at a multiple
of `A = r^(L-1)`) and no block spans two documents. Every layer below the top is then
walked as in an unpacked row (`t0 mod r^(l+1)` does not change with a document's start);
on the top layer a block walks and merges only its document's nodes, from `firsts` (its
first top node) on (`merge.walk_tiles`: from the tile that holds it), and RoPE being
relative, the positions counted from the row's start score as those counted from the
document's (`merge.layer_walk`). The merge and the backward run on the virtual rows
(`T_v` of them, padding rows zero: their scores are 0 and their cotangents 0, so they
add nothing) and the tree is `build_packed_tree`'s; the key and value gradients come
back through the transpose of that tree and layout (`jax.vjp` of it, in float32).
Device memory beyond one document a row's: the virtual copies of `q`, `k`, `v` and of the
rows' outputs (`T_v / T` times theirs). The selections are the caller's
(`htree_jax.routes`): virtual tree rows, one list a virtual block.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from htree_jax.core.config import HTreeConfig
from htree_jax.core.packing import Packing, build_packed_tree, tokens_to_virtual, virtual_exists, virtual_to_tokens
from htree_jax.core.tree import build_tree
from pallas_kernels.block.merge import BlockStatic, layer_arrays
from pallas_kernels.shared.common import next_power_of_two, pad_axis, unpad_rope_halves
from pallas_kernels.shared.tree_backward import push_down


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


@functools.partial(jax.tree_util.register_dataclass, data_fields=["offset"], meta_fields=["keys", "queries", "b"])
@dataclasses.dataclass(frozen=True)
class RowLayout:
    """One document a row: `queries` query positions of the `keys` tokens, from `offset`
    (int32, a multiple of `b`; None: from 0); `b` the selection block."""

    keys: int
    queries: int
    b: int
    offset: jax.Array | None = None

    def static(self, st: BlockStatic) -> BlockStatic:
        return st

    @property
    def length(self) -> int:
        """The tokens the tree is built over (the inverted index's `T`)."""
        return self.keys

    def node_counts(self, config: HTreeConfig, st: BlockStatic) -> tuple:
        return tuple(config.layer_sizes(self.keys))

    def table_rows(self, config: HTreeConfig, st: BlockStatic) -> int:
        return table_positions(config, self.keys, st)

    def rows(self, x, num_kv_heads: int, st: BlockStatic):
        """`[B, S, H, ...]` -> the kernels' `[B, Sp, H_kv, Gp, ...]` (`block_layout`)."""
        return block_layout(x, num_kv_heads, st, -(-self.queries // self.b) * self.b)

    def tokens(self, y):
        """The kernels' `[B, Sp, H_kv, G, ...]` (heads already cut to `G`) -> `[B, S, H, ...]`."""
        B, _, H_kv, G = y.shape[:4]
        return y[:, : self.queries].reshape((B, self.queries, H_kv * G) + y.shape[4:])

    def layers(self, k, v, config: HTreeConfig, st: BlockStatic):
        """The tree of `k`, `v` as the kernels read it (`merge.layer_arrays`)."""
        return layer_arrays(build_tree(k, v, config), st)

    def extras(self) -> dict:
        """The launches' keyword arguments beside the arrays: a shard's `offset`."""
        return {} if self.offset is None else dict(offset=self.offset)

    def key_grads(self, grads, k, v, layers, config: HTreeConfig, st: BlockStatic):
        """`(dk, dv)` float32 in `k`'s and `v`'s layout of the layers' gradients `grads`
        (`[dk_0, dv_0, dk_1, ...]`, each `[B, H_kv, rows, D]` in the kernels' rope
        halves): each layer's, from the top, shared by the children of each node."""
        dk_up = dv_up = None
        for l in reversed(range(len(grads) // 2)):
            N = config.layer_sizes(self.keys)[l]
            dk_l, dv_l = grads[2 * l][:, :, :N], grads[2 * l + 1][:, :, :N]
            if dk_up is not None:
                dk_l = dk_l + push_down(dk_up, N, config.compression_rate)
                dv_l = dv_l + push_down(dv_up, N, config.compression_rate)
            dk_up, dv_up = dk_l, dv_l
        return jnp.swapaxes(unpad_rope_halves(dk_up, k.shape[-1]), 1, 2), jnp.swapaxes(dv_up[..., :v.shape[-1]], 1, 2)


def row_layout(q, k, config: HTreeConfig, offset=None) -> RowLayout:
    """The layout of `q [B, S, H, K]` over `k [B, T, H_kv, K]`, one document a row; a
    context shard's first position `offset` checked (`check_shard_offset`)."""
    S, b = q.shape[1], config.selection_block
    return RowLayout(keys=k.shape[1], queries=S, b=b,
                     offset=None if offset is None else check_shard_offset(S, b, offset))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["packing", "firsts"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Packed rows: `packing` (`htree_jax.core.packing.Packing`), `firsts [B, T_v / b]`
    int32 each virtual block's document's first top node (where its top layer's walk
    starts). The queries and outputs go through the virtual layout; the tree is
    `build_packed_tree`'s, its gradients back through the transpose of it (`jax.vjp`,
    float32)."""

    packing: Packing
    firsts: jax.Array

    def static(self, st: BlockStatic) -> BlockStatic:
        """The packing's layer count (that of its longest document, SPEC 6: `T_v` alone
        may count one more)."""
        return dataclasses.replace(st, num_layers=self.packing.num_layers)

    @property
    def length(self) -> int:
        return self.packing.virtual_len

    def node_counts(self, config: HTreeConfig, st: BlockStatic) -> tuple:
        return tuple(self.length // config.compression_rate**l for l in range(st.num_layers))

    def table_rows(self, config: HTreeConfig, st: BlockStatic) -> int:
        """Every layer's `n` (at most `top_k * r` below the top, the virtual top layer's
        node count there), rounded up to the tile."""
        top = self.length // config.compression_rate ** (self.packing.num_layers - 1)
        return next_power_of_two(max(config.max_candidates, top), st.tile)

    def rows(self, x, num_kv_heads: int, st: BlockStatic):
        return block_layout(tokens_to_virtual(x, self.packing), num_kv_heads, st, self.length)

    def tokens(self, y):
        B, Tv, H_kv, G = y.shape[:4]
        return virtual_to_tokens(y.reshape((B, Tv, H_kv * G) + y.shape[4:]), self.packing)

    def layers(self, k, v, config: HTreeConfig, st: BlockStatic):
        tree = build_packed_tree(tokens_to_virtual(k, self.packing), tokens_to_virtual(v, self.packing),
                                 virtual_exists(self.packing), config, self.packing.num_layers)
        return layer_arrays(tree, st)

    def extras(self) -> dict:
        return dict(firsts=self.firsts)

    def key_grads(self, grads, k, v, layers, config: HTreeConfig, st: BlockStatic):
        """The transpose of `layers` (linear), taken in float32. A layer's rows past its
        nodes (padding, and the spare row the atomics add to) get nothing back."""
        _, pull = jax.vjp(lambda k32, v32: self.layers(k32, v32, config, st), k.astype(jnp.float32),
                          v.astype(jnp.float32))
        return pull([pad_axis(g[:, :, : x.shape[2]], 2, x.shape[2]) for g, x in zip(grads, layers)])


__all__ = ["PackedLayout", "RowLayout", "block_layout", "check_shard_offset", "row_layout", "table_positions"]
