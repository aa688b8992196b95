"""Pallas (Triton lowering) kernels for htree attention on NVIDIA GPUs.

They stand on `htree_jax.core` (configuration, index arithmetic, RoPE tables, the tree,
the packing layout) and on each other, nothing else: `import pallas_kernels.gqa.forward`
loads neither Flax nor the public API. "SPEC n" cites section n of `docs/SPEC.md`.

One folder per kernel family, each its forward and backward side by side; a family
imports only `shared/` and `htree_jax.core`, never another family, and which family
runs a call is chosen once, in `htree_jax.backends` (`tests/test_layout.py`):
- `gqa/`: the per-query passes for groups of up to 16 query heads per kv head (and
  multiples of 16 up to 128 as virtual kv heads): the top layer, the layers below, the
  forward and the backward.
- `wide/`: latent attention's wide groups (32 or more heads per kv head; the values may
  be the keys' latent features): forward and backward.
- `decode/`: the walk over a decode cache and the append of a token to it.
- `shared/`: what the families share: configs (each family's launch parameters as
  data), launch statics and limits (`common`), the shared-memory model, precision, RoPE
  tables, importance keys, the sort-free top-K, the tree build and its backward, the
  inverse node index the backward families sum gradients over, the poisoned rows.

Every kernel runs with `interpret=True` on any platform; CI tests them that way.
"""
