"""Pallas (Triton lowering) kernels for htree attention on NVIDIA GPUs.

They stand on `htree_jax.core` (configuration, index arithmetic, RoPE tables, the tree,
the packing layout) and on each other, nothing else: `import pallas_kernels.forward`
loads neither Flax nor the public API. "SPEC n" cites section n of `docs/SPEC.md`.

Building blocks, one SPEC step each, every kernel beside its pure-JAX twin:
- `precision`: the dots' operand precision (3xTF32, `BF16X3`, input-dtype operands), `Precisions`.
- `rope`: RoPE tables and the layers' keys rotated in the layouts the kernels read.
- `common`: `LayerStatic` (a launch's static parameters), the kernels' limits, padding,
  candidate geometry, BlockSpecs, virtual heads for groups above 16.
- `tree_build`: mean pooling, one layer up per launch (SPEC 1).
- `importance`: candidate scores and packed importance keys below the top (SPEC 2.2-2.3);
  the decode walk's scores over a cache (`decode_scores_pallas`).
- `top_k`: the sort-free shared top-K (bitwise threshold search + compaction, SPEC 2.3).
- `merge`: the online-softmax merge below the top and the bottom's normalisation (SPEC 2.4);
  the decode walk's merges (`decode_merge_pallas`).
- `top_layer`: the top layer's importance and merge over blocks of queries, flash-attention shaped.
- `layer_backward`: `dq` per query (in registers); `node_backward`: `dk`, `dv` per node from
  an inverse index (no atomics, bitwise deterministic); `top_backward`: the top layer's
  `dq` and `dk`, `dv`, flash attention's two backward loops.

What the passes share: `plan` (`BlockSizes`, the padded tree and keys, each chunk's top
layer and selections).

Compositions of those, nothing else:
- `forward`: `htree_forward_pallas`.
- `backward`: `htree_backward_pallas` (gradients pushed down the tree).
- `decode`: `attend_cache_pallas`, decoding over a `htree_jax.HTreeCache` (keys gathered as
  stored and rotated in the kernel, candidates split over programs); its twin is the JAX
  reference walk `htree_jax.reference.attend_tree(..., keys_rotated=False)`.

Every kernel runs with `interpret=True` on any platform; CI tests them that way.
"""
