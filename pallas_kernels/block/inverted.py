"""The blocks' selections inverted (SPEC 12): for every node tile of every layer, the
blocks whose candidate buffer holds it, so that a key and value gradient can be summed
by the node that owns it instead of added by every block that merged it.

A block's buffer at layer `l` holds the children of each parent in its list (the
selection of layer `l + 1`; at the top, the virtual parents `0 .. n_P - 1`): parent `u`
at slot `s` puts node tile `u` (nodes `u * r .. u * r + r - 1` of layer `l`) at buffer
positions `s * r .. s * r + r - 1`. So the inversion of layer `l` is, for each tile `u`,
the `(block, slot)` pairs of the blocks that listed `u`, and which of its children each
such block refines (they are in the block's selection of layer `l`, so the block does
not merge them there). The pairs are in block order inside each tile (a stable sort by
tile), so a sum over them is the same sum every call.

Memory a layer, int32: `offsets [B, H_kv, U + 1]` and three arrays of `B * H_kv * E`
entries (`blocks`, `slots`, and `refined`: `ceil(r / 32)` words an entry), `E = NB *
width` with `NB = ceil(T / b)` blocks and `width` the layer's longest list (`top_k`
below the top). At the benchmark shape (T=131072, `top_k=512`, 8192 blocks, 4 kv heads)
that is 4.2M entries a kv head at each of the two lower layers: about 400 MB in all.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from htree_jax.core.indexing import num_top_parents

WORD = 32  # children a `refined` word holds


class InvertedLayer(NamedTuple):
    """One layer's inversion (see the module): entries of tile `u` are `offsets[..., u]
    .. offsets[..., u + 1] - 1`; `blocks`, `slots [B, H_kv, E]` int32 and `refined [B,
    H_kv, E, W]` int32 (bit `c % 32` of word `c // 32`: the block refines child `c`;
    zero at layer 0, which refines nothing). Entries past `offsets[..., -1]` are
    padding."""

    offsets: jax.Array
    blocks: jax.Array
    slots: jax.Array
    refined: jax.Array


def refined_children(parents, refined, r: int):
    """`[..., P, W]` int32: for each parent slot of `parents [..., P]` (sorted, `-1` after
    the real ones), the bits of its children that `refined [..., S]` (sorted node
    indices of the layer below, `-1` padded) holds. One scatter of distinct bits a list
    (each node once: the add is an OR)."""
    words = -(-r // WORD)
    parent_of = jnp.where(refined >= 0, refined // r, -1)
    slot = jnp.vectorize(jnp.searchsorted, signature="(k),(m)->(m)")(
        jnp.where(parents >= 0, parents, jnp.iinfo(jnp.int32).max), parent_of)
    child = jnp.where(refined >= 0, refined % r, 0)
    bit = jnp.where(refined >= 0, jnp.left_shift(jnp.uint32(1), (child % WORD).astype(jnp.uint32)), jnp.uint32(0))
    lead, P = parents.shape[:-1], parents.shape[-1]
    flat_slot = jnp.clip(slot, 0, P - 1).reshape(-1, refined.shape[-1])
    flat_word = (child // WORD).reshape(flat_slot.shape)
    lists = jnp.arange(flat_slot.shape[0])[:, None]
    bits = jnp.zeros((flat_slot.shape[0], P, words), jnp.uint32)
    bits = bits.at[lists, flat_slot, flat_word].add(bit.reshape(flat_slot.shape))
    return jax.lax.bitcast_convert_type(bits, jnp.int32).reshape(lead + (P, words))


def layer_parents(selections, l: int, num_layers: int, r: int, b: int, T: int, num_blocks: int | None = None,
                  offset=None):
    """The parent lists of layer `l`'s buffers, one a block: `[B, NB, H_kv, width]`
    int32, `-1` after the real ones. Below the top, the blocks' selection of layer `l +
    1` (`selections` top layer first, `-1` padded); at the top, the virtual parents `0
    .. num_top_parents(t0) - 1` of each block's first position `t0` (`offset + j * b`
    for block `j` of `num_blocks`, by default all of `T`'s from position 0)."""
    if l < num_layers - 1:
        return selections[num_layers - 2 - l]
    t0 = jnp.arange(-(-T // b) if num_blocks is None else num_blocks, dtype=jnp.int32) * b
    if offset is not None:
        t0 = t0 + jnp.asarray(offset, jnp.int32)
    count = num_top_parents(t0, r, num_layers)  # [NB]
    width = int(num_top_parents((-(-T // b) - 1) * b, r, num_layers))
    slot = jnp.arange(width, dtype=jnp.int32)
    return jnp.where(slot[None, :] < count[:, None], slot[None, :], -1)[None, :, None, :]


def invert_layer(parents, refined, num_tiles: int, r: int, shape: tuple[int, int, int]) -> InvertedLayer:
    """`parents [B | 1, NB, H_kv | 1, width]` (as `layer_parents`), `refined` the
    layer's own selection `[B, NB, H_kv, S]` (None at layer 0), `num_tiles` the layer's
    node tiles (the nodes of the layer above), `shape` `(B, NB, H_kv)`. See
    `InvertedLayer`."""
    B, NB, H_kv = shape
    parents = jnp.broadcast_to(parents, shape + parents.shape[-1:]).astype(jnp.int32)
    width = parents.shape[-1]
    words = -(-r // WORD)
    bits = (jnp.zeros(shape + (width, words), jnp.int32) if refined is None
            else refined_children(parents, refined.astype(jnp.int32), r))
    # Per (b, h_kv): entries in block-major order, then a stable sort by tile.
    tile = jnp.where(parents >= 0, parents, num_tiles)  # padding sorts last
    tile = jnp.moveaxis(tile, 2, 1).reshape(B, H_kv, NB * width)
    bits = jnp.moveaxis(bits, 2, 1).reshape(B, H_kv, NB * width, words)
    order = jnp.argsort(tile, axis=-1, stable=True).astype(jnp.int32)
    sorted_tile = jnp.take_along_axis(tile, order, axis=-1)
    edges = jnp.arange(num_tiles + 1, dtype=jnp.int32)
    offsets = jnp.vectorize(lambda t: jnp.searchsorted(t, edges, side="left"), signature="(e)->(u)")(sorted_tile)
    return InvertedLayer(offsets=offsets.astype(jnp.int32), blocks=order // width, slots=order % width,
                         refined=jnp.take_along_axis(bits, order[..., None], axis=2))


def inverted_index(selections, *, r: int, b: int, T: int, num_layers: int, layer_sizes, shape=None,
                   offset=None) -> list[InvertedLayer]:
    """Every layer's inversion, bottom first: `selections` the blocks' lists of layers
    `L - 1 .. 1` (top first, `[B, NB, H_kv, top_k]` int32, `-1` padded, sorted, as the
    ranking passes return them), `layer_sizes` the nodes of each layer (bottom first).
    Blocks counted from position `offset` (a context shard's first; 0 by default);
    `shape` `(B, NB, H_kv)`, needed only where a one-layer tree has no selections."""
    if selections:
        shape = tuple(selections[0].shape[:3])
    elif shape is None:
        raise ValueError("inverted_index: a one-layer tree's index needs shape=(B, NB, H_kv) (it has no selections)")
    out = []
    for l in range(num_layers):
        parents = layer_parents(selections, l, num_layers, r, b, T, shape[1], offset)
        refined = selections[num_layers - 1 - l] if l > 0 else None
        num_tiles = -(-layer_sizes[l] // r)
        out.append(invert_layer(parents, refined, num_tiles, r, shape))
    return out
