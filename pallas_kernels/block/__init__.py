"""Block selection's family (SPEC 12, `selection_block = compression_rate`): the queries
of one bottom node share each layer's selection, so one gathered node tile feeds all
their `b * G` rows.

- `merge`: every layer's merge of a block's rows once its selections are known (one
  program per `(block, kv head)`), and the walk's pieces the backward shares.
- `forward`: `block_forward_pallas` (the tree and queries laid out, one launch).
- `backward`: `block_backward_pallas` (`dq` per program; `dk`, `dv` added per node with
  float32 atomics, then pushed down the tree).
The blocks' selections come from the per-query families run on the ranking rows
(`htree_jax.backends.block_selections`).
"""
