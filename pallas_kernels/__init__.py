"""Pallas kernels for htree attention on NVIDIA GPUs (most on Pallas's Triton lowering;
block selection's merge and backward walk also on Pallas Mosaic GPU).

They stand on `htree_jax.core` (configuration, index arithmetic, RoPE tables, the tree,
the packing layout) and on each other, nothing else: `import pallas_kernels.gqa.forward`
loads neither Flax nor the public API. "SPEC n" cites section n of `docs/SPEC.md`.

One folder per kernel family, each its forward and backward side by side and, in
`attention.py`, the two paired as one `jax.custom_vjp` (`shared/guarded.py`); a family
imports only `shared/` and `htree_jax.core`, never another family. Which family runs a
call is the route table's (`htree_jax.routes`, chosen by `htree_jax.backends.choose_route`;
`tests/test_layout.py`, `tests/test_routes.py`):
- `gqa/`: the per-query passes for groups of up to 16 query heads per kv head (and
  multiples of 16 up to 128 as virtual kv heads): the top layer, the layers below, the
  forward and the backward.
- `wide/`: latent attention's wide groups (32 or more heads per kv head; the values may
  be the keys' latent features): forward and backward.
- `block/`: block selection (SPEC 12): every layer's merge of a block's rows given the
  blocks' selections (three kernels of it: Pallas-Triton, Triton, Mosaic GPU) and its
  backward.
- `decode/`: the walk over a decode cache, block selection's one-launch step inside a
  block, and the append of a token to the cache.
- `shared/`: what the families share: configs (each family's launch parameters as
  data), launch statics and limits (`common`), the online softmax (`softmax`), SPEC 10's
  guard around a family's passes (`guarded`), the shared-memory model, precision, RoPE
  tables, importance keys, the sort-free top-K, the tree build and its backward, the
  inverse node index the backward families sum gradients over, the poisoned rows.

Every Pallas-Triton kernel runs with `interpret=True` on any platform; CI tests them that
way. The Triton and Mosaic GPU merges have no interpret mode: the GPU gate compares them
with their Pallas-Triton twin (`tools/gpu_gate.py`).
"""
