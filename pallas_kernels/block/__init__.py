"""Block selection's family (SPEC 12, `selection_block = compression_rate`): the queries
of one bottom node share each layer's selection, so one gathered node tile feeds all
their `b * G` rows.

- `merge`: every layer's merge of a block's rows once its selections are known (one
  program per `(block, kv head)`), and the walk's pieces the backward shares;
  `mosaic_merge`: the same merge on Mosaic GPU.
- `layout`: where the rows and the tree come from, one value the forward and the
  backward take: `RowLayout` (one document a row, or a context shard of one) and
  `PackedLayout` (packed rows, `segment_ids`: the queries laid out as the tree and each
  block's top layer from its document's first node).
- `forward`: `block_forward_pallas` (the tree and queries laid out, one launch, over any
  layout) and `MERGES`, the merge's kernels by name (`BlockKernels.merge`).
- `backward`: `block_backward_pallas` (over any layout; `dq` per program; `dk`, `dv` added per node with
  float32 atomics, or written as partial sums and summed by node, then pushed down the
  tree); `inverted`: the blocks' selections inverted, for each node tile the blocks
  that merged it; `partials`: the partial sums' chunks and their sum
  by node (Pallas-Triton); `mosaic_backward`: the walk that writes the partial sums on
  Mosaic GPU; `mosaic_sums`: their sum by node on Mosaic GPU.
- `attention`: the pair as one `custom_vjp` (`attention`), its operands for one
  document a row, a context shard or packed rows (`block_operands`).
The blocks' selections come from the per-query families run on the ranking rows
(`htree_jax.routes.block_selections`).
"""
