"""SPEC 12, block selection: the ranking rows that the queries of one bottom node share.

With `selection_block = b` the queries of a block (the `b` positions of one bottom node,
counted inside the query's document) rank the candidates of every layer above 0 with
the same rows: the block's first query, or the previous block's `b` queries. Every
backend reads them from here: the reference's walk (`htree_jax.reference.attend_tree`),
a context shard (whose first blocks reach into the shard before it) and the decode cache
(which keeps the last `recent_queries` queries of each row).
"""

from __future__ import annotations

import jax.numpy as jnp

from htree_jax.core.config import HTreeConfig


def block_rows(history5, own_rows, positions, config: HTreeConfig):
    """SPEC 12's ranking rows of every query: the queries so far `history5 [B, P, H_kv,
    G, K]`, each query's own row in it `own_rows [S]` or `[B, S]` (int32), `positions [B,
    S]` (inside each document) -> `[B, S, H_kv, R, K]`: the `G` heads of the block's
    first query (`block_source="first"`, `R = G`) or the `b * G` heads of the previous
    block's queries (`"previous"`, `R = b * G`; zeros for a first block). A document's
    tokens are consecutive rows, so a block's first query is `t mod b` rows above the
    query's own and the previous block `b` more: `history5` must hold the `2b - 1` rows
    above a query's own where its position reaches that far (`recent_queries`).
    Full sequences: `history5` is the queries themselves, `own_rows = 0 .. S-1`."""
    P = history5.shape[1]
    b = config.selection_block
    first = jnp.broadcast_to(own_rows, positions.shape) - positions % b  # [B, S]
    take = lambda rows: jnp.take_along_axis(history5, jnp.clip(rows, 0, P - 1)[:, :, None, None, None], axis=1)
    if config.block_source == "first":
        return take(first)
    has_previous = (positions - positions % b - b >= 0)[:, :, None, None, None]
    rows = [jnp.where(has_previous, take(first - b + j), 0.0) for j in range(b)]  # each [B, S, H_kv, G, K]
    return jnp.concatenate(rows, axis=3)  # [B, S, H_kv, b * G, K]


def recent_queries(config: HTreeConfig) -> int:
    """How many queries before a query SPEC 12's ranking rows may reach back: `2b - 1`
    (`"previous"`: the previous block's first, `b + t mod b` rows above), kept as `2b`
    (a decode cache's recent queries, a context shard's rows from the shard before); 0
    without block selection."""
    return 2 * config.selection_block if config.selects_by_block else 0


def with_recent(history5, counts, P: int):
    """The recent queries after appending: `history5 [B, P + S, H_kv, G, K]`, each row's
    `P` queries before the call (oldest first) then its `S` new ones, of which row `b`
    appends its first `counts[b]` -> the last `P` of each row's queries, oldest first."""
    rows = counts[:, None] + jnp.arange(P, dtype=jnp.int32)[None, :]  # [B, P]
    return jnp.take_along_axis(history5, rows[:, :, None, None, None], axis=1)
