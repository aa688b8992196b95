"""What every Pallas backward shares (`gqa/backward.py`, `wide/backward.py`): the nodes a
layer kept, marked from the forward's saved selections, and gradients pushed down the
tree (the transpose of mean pooling)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from htree_jax.core.packing import virtual_exists


def push_down(grad_parent, N: int, r: int, counts=None):
    """A parent layer's gradient `[B, H_kv, ceil(N/r), D]` shared equally by each
    parent's children: `[B, H_kv, N, D]` (the transpose of mean pooling). `counts [B,
    ceil(N/r)]`: each parent's existing children (packed rows; parents with none get 0),
    else every parent has `r` but the ragged last."""
    parents = grad_parent.shape[2]
    if counts is None:
        children = jnp.minimum(r, N - r * jnp.arange(parents)).astype(jnp.float32)
        return jnp.repeat(grad_parent / children[:, None], r, axis=2)[:, :, :N]
    share = jnp.where(counts > 0, 1.0 / jnp.maximum(counts, 1).astype(jnp.float32), 0.0)[:, None, :, None]
    return jnp.repeat(grad_parent * share, r, axis=2)[:, :, :N]


def child_counts_by_layer(packing, r: int, num_layers: int):
    """Packed rows: each node's existing children, per layer `l >= 1` (`[B, N_l]` int32,
    index `l - 1`), from the tokens present in the virtual layout."""
    exists, counts = virtual_exists(packing), []
    for _ in range(1, num_layers):
        c = jnp.sum(exists.reshape(exists.shape[0], -1, r), axis=-1)
        counts.append(c)
        exists = (c > 0).astype(jnp.int32)
    return counts


def pad_nodes_list(selected, width: int):
    """Node lists `[..., top_k]` (`-1` padded) padded with `-1` to `width`."""
    return jnp.pad(selected, [(0, 0)] * (selected.ndim - 1) + [(0, width - selected.shape[-1])], constant_values=-1)


def kept_keys(parents, selected, width: int, r: int):
    """Keys `[B, Q, H_kv, width]` int32 marking the candidates a layer kept, for the
    kernels' `keys < tau` test with `tau = 1`: 1 at the buffer position of each node of
    `selected [B, Q, H_kv, top_k]` (ascending, `-1` padded), 0 elsewhere. A node
    `j = parents[s]*r + c` sits at `s*r + c`; `parents=None`: the top layer, position = node."""
    if parents is None:
        positions = selected
    else:
        ordered = jnp.where(parents >= 0, parents, jnp.iinfo(jnp.int32).max)  # `-1` padding sorts last
        search = jax.vmap(lambda row, x: jnp.searchsorted(row, x).astype(jnp.int32))
        flat = lambda x: x.reshape(-1, x.shape[-1])
        slots = search(flat(ordered), flat(selected // r)).reshape(selected.shape)
        positions = slots * r + selected % r
    positions = jnp.where(selected >= 0, positions, width)  # out of range: dropped

    def mark(row):
        return jnp.zeros((width,), jnp.int32).at[row].set(1, mode="drop")

    return jax.vmap(mark)(positions.reshape(-1, positions.shape[-1])).reshape(selected.shape[:-1] + (width,))


__all__ = ["child_counts_by_layer", "kept_keys", "pad_nodes_list", "push_down"]
