"""Packed sequences (SPEC 6): `segment_ids [B, T]`, one tree per document.

A row of documents is laid out for the tree in a *virtual* sequence where every document
starts at a multiple of `A = r^(L-1)` tokens (`L` the layer count of the longest
document the row may hold, `max_document_len`, by default `T`: SPEC 6 lets every
document take more layers than its own, and fewer layers are less work): document `d`
of length `n_d` occupies `[V_d, V_d + n_d)`, `V_d` a multiple of `A`, then zeros up to the
next multiple of `A`. No node of any layer then straddles two documents, node `(l, i)`
of document `d` is node `V_d / r^l + i` of the virtual layer, and its children are
nodes `r*j .. r*j + r-1` of the layer below as in an unpacked row: every layer below the
top is walked exactly as without packing. Only the top layer needs to know where a
document's nodes begin (`top_first`): a query's candidates there are its document's top
nodes, counted from that document's first one. Queries stay where they are (`[B, T]`);
only the tree is laid out virtually.

Means divide by the children that exist (a document's ragged last node has fewer), so
each document's nodes are exactly those of its own tree (`pool_counted`, bit for bit
`tree.pool_layer`'s arithmetic).

Static shapes. The virtual length is `T_v = roundup(T + max_documents * (A - 1), A)`:
a row fits when `sum_d roundup(n_d, A) <= T_v`, which `max_documents` documents always
do. The tree then costs `T_v / T` times an unpacked one's memory (its bottom layer is a
copy of `k`, `v` in the virtual layout, `B * T_v * H_kv * (K + V)` elements); the top layer has
`T_v / A <= ceil(T / A) + max_documents` nodes. `max_documents=None` takes `T // A`
(at least 1): at most `2T` virtual tokens. With `L = 1` (`T <= top_k * r`) `A = 1`: no
padding, any number of documents. A row that does not fit raises `ValueError` when
`segment_ids` is concrete; under `jit` its outputs are NaN (nothing is checked on the
host there).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from htree_jax.core.config import HTreeConfig
from htree_jax.core.tree import child_reciprocals, round_to_storage


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["position", "doc_start", "fits"], meta_fields=["virtual_len", "num_layers"])
@dataclasses.dataclass(frozen=True)
class Packing:
    """Where each token sits in the virtual layout.

    position:  int32 `[B, T]`, the token's virtual position (`doc_start` + its offset in
               its document).
    doc_start: int32 `[B, T]`, the virtual start `V_d` of the token's document (a multiple
               of `r^(L-1)`).
    fits:      bool `[B]`, whether the row's documents fit `virtual_len` (rows that do
               not are laid out unpacked, and their outputs made NaN).
    """

    position: jax.Array
    doc_start: jax.Array
    fits: jax.Array
    virtual_len: int
    num_layers: int

    def offset(self):
        """Each token's position inside its document `[B, T]`."""
        return self.position - self.doc_start

    def node_base(self, layer: int, r: int):
        """The first node of each token's document on `layer`: `doc_start / r^layer`."""
        return self.doc_start // r**layer


def alignment(config: HTreeConfig, longest: int) -> int:
    """`A = r^(L-1)`, `L` the layer count of the longest document: where documents start
    in the virtual layout."""
    return config.compression_rate ** (config.num_layers(longest) - 1)


def virtual_length(config: HTreeConfig, T: int, max_documents: int | None, max_document_len: int | None = None) -> int:
    """`T_v = roundup(T + max_documents * (A - 1), A)` (module docstring)."""
    A = alignment(config, max_document_len or T)
    docs = max(1, T // A) if max_documents is None else max_documents
    return -(-(T + docs * (A - 1)) // A) * A


def check_max_documents(max_documents, max_document_len=None, seq_len=None) -> None:
    for name, x in (("max_documents", max_documents), ("max_document_len", max_document_len)):
        if x is not None and (isinstance(x, bool) or not isinstance(x, int) or x < 1):
            raise ValueError(f"{name} must be a positive int or None, got {x!r}")
    if max_document_len is not None and seq_len is not None and max_document_len > seq_len:
        raise ValueError(f"max_document_len must be at most T = {seq_len}, got {max_document_len}")


def check_segment_ids(segment_ids, batch: int, seq_len: int):
    """`segment_ids` int32 `[B, T]` (any integer dtype that fits int32 is taken)."""
    shape = getattr(segment_ids, "shape", None)
    dtype = getattr(segment_ids, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(f"segment_ids must be an integer array [B, T], got {type(segment_ids).__name__}")
    if tuple(shape) != (batch, seq_len):
        raise ValueError(f"segment_ids must have shape [B, T] = {(batch, seq_len)}, got {tuple(shape)}")
    if not jnp.issubdtype(dtype, jnp.integer) or jnp.dtype(dtype).itemsize > 4:
        raise TypeError(f"segment_ids must be int32 (an integer dtype of at most 32 bits), got {dtype}")
    return jnp.asarray(segment_ids).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "virtual_len", "max_document_len"))
def pack_layout(segment_ids, config: HTreeConfig, virtual_len: int, max_document_len: int | None = None) -> Packing:
    """The virtual layout of rows `segment_ids [B, T]` (a document: a maximal run of
    equal consecutive ids), with the layer count of `max_document_len` tokens (`None`:
    `T`); a row with a longer document does not fit."""
    B, T = segment_ids.shape
    L = config.num_layers(max_document_len or T)
    A = config.compression_rate ** (L - 1)
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    is_start = jnp.concatenate([jnp.ones((B, 1), bool), change], axis=1)
    is_end = jnp.concatenate([change, jnp.ones((B, 1), bool)], axis=1)
    start = lax.cummax(jnp.where(is_start, t, 0), axis=1)
    end = lax.cummin(jnp.where(is_end, t + 1, T), axis=1, reverse=True)
    aligned = jnp.where(is_start, -(-(end - start) // A) * A, 0)
    inclusive = jnp.cumsum(aligned, axis=1, dtype=jnp.int32)
    doc_start = jnp.take_along_axis(inclusive - aligned, start, axis=1)
    fits = (inclusive[:, -1] <= virtual_len) & (jnp.max(end - start, axis=1) <= (max_document_len or T))
    # A row that does not fit is laid out unpacked (every index in range); it answers NaN.
    doc_start = jnp.where(fits[:, None], doc_start, 0)
    position = jnp.where(fits[:, None], doc_start + t - start, jnp.broadcast_to(t, (B, T)))
    return Packing(position.astype(jnp.int32), doc_start.astype(jnp.int32), fits, virtual_len, L)


def check_fits(packing: Packing, segment_ids, max_documents, align: int, max_document_len=None) -> None:
    """Eager calls: a row whose documents do not fit the static layout is an error
    (`align`: the `r^(L-1)` tokens each document's layout starts at a multiple of)."""
    try:
        fits = np.asarray(packing.fits)
    except jax.errors.TracerArrayConversionError:
        return  # under jit: such rows answer NaN
    if not fits.all():
        row = int(np.argmin(fits))
        ids = np.asarray(segment_ids[row])
        cuts = np.flatnonzero(ids[1:] != ids[:-1]) + 1
        lengths = np.diff(np.concatenate([[0], cuts, [len(ids)]]))
        docs, longest = len(lengths), int(np.max(lengths))
        if max_document_len is not None and longest > max_document_len:
            raise ValueError(f"segment_ids: row {row} has a document of {longest} tokens, longer than "
                             f"max_document_len={max_document_len}")
        needed = int(np.sum(-(-lengths // align) * align))
        raise ValueError(
            f"segment_ids: row {row}'s {docs} documents, each laid out from a multiple of {align} "
            f"tokens, take {needed} tokens of the packed layout, which holds {packing.virtual_len} "
            f"(T plus max_documents={max_documents} documents' alignment): pass a larger max_documents")


def tokens_to_virtual(x, packing: Packing):
    """`x [B, T, ...]` -> `[B, T_v, ...]`, token `t` at `packing.position[t]`, zeros
    elsewhere (a gather from `x` with a zero row appended, so the gradient is a gather
    back)."""
    B, T = x.shape[:2]
    source = jnp.full((B, packing.virtual_len), T, jnp.int32)
    source = jax.vmap(lambda s, p: s.at[p].set(jnp.arange(T, dtype=jnp.int32)))(source, packing.position)
    padded = jnp.concatenate([x, jnp.zeros((B, 1) + x.shape[2:], x.dtype)], axis=1)
    return jax.vmap(lambda row, s: row[s])(padded, source)


def virtual_to_tokens(x, packing: Packing):
    """`x [B, T_v, ...]` in the virtual layout -> `[B, T, ...]`, each token's entry (the
    inverse of `tokens_to_virtual` on the tokens' positions)."""
    index = packing.position.reshape(packing.position.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, index, axis=1)


def virtual_doc_starts(packing: Packing):
    """int32 `[B, T_v]`: the virtual start `V_d` of the document at each virtual position,
    padding after a document taking that document's (starts only grow along a row)."""
    starts = tokens_to_virtual(packing.doc_start[..., None], packing)[..., 0]  # 0 where no token
    return lax.cummax(starts, axis=1)


def virtual_exists(packing: Packing):
    """int32 `[B, T_v]`: 1 where a token sits."""
    B = packing.position.shape[0]
    ones = jnp.zeros((B, packing.virtual_len), jnp.int32)
    return jax.vmap(lambda o, p: o.at[p].set(1))(ones, packing.position)


def pool_counted(x, exists, compression_rate: int):
    """`tree.pool_layer` with each parent's divisor its existing children: `x [B, N,
    H_kv, D]` (`N` a multiple of `r`), `exists [B, N]` int32 -> `([B, N/r, H_kv, D],
    [B, N/r] int32)`; parents with no child are 0 and do not exist."""
    B, N, H, D = x.shape
    r = compression_rate
    children = x.astype(jnp.float32).reshape(B, N // r, r, H, D)
    sums = children[:, :, 0]
    for c in range(1, r):  # child by child, in tree.pool_layer's order
        sums = sums + children[:, :, c]
    counts = jnp.sum(exists.reshape(B, N // r, r), axis=-1)
    scale = jnp.asarray(np.concatenate([[0.0], child_reciprocals(r)]).astype(np.float32))[counts]
    return round_to_storage(sums * scale[:, :, None, None], x.dtype), (counts > 0).astype(jnp.int32)


def layer_exists(exists, num_layers: int, compression_rate: int) -> list:
    """Each layer's occupancy of a packed tree, bottom first: `exists [B, T_v]` int32 (1
    where a token sits, `virtual_exists`) -> `[[B, N_l]]`, a node existing where any of
    its children does (as `pool_counted` decides)."""
    layers = [exists]
    for _ in range(1, num_layers):
        below = layers[-1]
        B, N = below.shape
        layers.append((jnp.sum(below.reshape(B, N // compression_rate, compression_rate), axis=-1) > 0)
                      .astype(jnp.int32))
    return layers


def build_packed_tree(k_v, v_v, exists, config: HTreeConfig, num_layers: int):
    """The tree of virtual-layout `k_v [B, T_v, H_kv, K]`, `v_v`: `[(K_l, V_l), ...]`
    bottom first, `N_l = T_v / r^l`, each document's nodes those of its own tree."""
    layers = [(k_v, v_v)]
    for _ in range(1, num_layers):
        k_up, e_up = pool_counted(layers[-1][0], exists, config.compression_rate)
        v_up, _ = pool_counted(layers[-1][1], exists, config.compression_rate)
        layers.append((k_up, v_up))
        exists = e_up
    return layers


def local_selections(selections, packing: Packing, r: int):
    """Selections of layers `L-1 .. 1` (top first) as virtual node indices -> indices
    inside each token's document (`-1` kept)."""
    L = packing.num_layers
    return [jnp.where(s >= 0, s - packing.node_base(L - 1 - i, r)[..., None, None], -1)
            for i, s in enumerate(selections)]
