"""What the kernel families share (`pallas_kernels.gqa`, `.wide`, `.block`, `.decode`); imports no family.

- `configs`: each family's launch parameters as data (`BlockSizes`, `KernelConfigs`,
  `TUNED`, `BlockConfig`, `DecodeBlockSizes`).
- `softmax`: the online softmax every Pallas kernel folds its candidates with.
- `guarded`: a family's forward and backward paired as one `custom_vjp` under SPEC 10's
  guard.
- `common`: `LayerStatic` (a launch's static parameters), the kernels' limits, padding,
  candidate geometry, BlockSpecs, virtual heads for groups above 16, `Bound`.
- `precision`: the dots' operand precision (3xTF32, `BF16X3`, input-dtype operands).
- `shared_memory`: each kernel's shared-memory footprint, the stages and program shapes
  that fit.
- `rope`: RoPE tables and the layers' keys rotated in the layouts the kernels read.
- `importance`: candidate scores and packed importance keys (SPEC 2.2-2.3).
- `top_k`: the sort-free shared top-K (bitwise threshold search + compaction, SPEC 2.3).
- `tree_build`, `tree_backward`: mean pooling one layer up per launch (SPEC 1), and its
  gradients pushed down.
- `node_index`: which queries merged each node, the units the node-gradient programs own.
- `dead_rows`: SPEC 10's NaN rows written in place.
"""
