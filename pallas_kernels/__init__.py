"""Pallas (Triton lowering) kernels for htree attention on NVIDIA GPUs.

- `tree_build`: mean pooling, one layer up per launch.
- `top_k`: the sort-free top-K building block (bitwise threshold search + compaction).
- `layer_forward`: per-layer kernels (importance keys, shared top-K, online-softmax
  merge), each beside a pure-JAX twin with the same contract.
- `forward`: their composition, `htree_forward_pallas`.
- `layer_backward`: per-layer `dq` kernels (one program per query, in registers),
  beside an autodiff twin; `node_backward`: their transpose, `dk`/`dv` by node from an
  inverse index (no atomics, bitwise deterministic); `backward`: `htree_backward_pallas`
  (selections recomputed, gradients pushed down the tree).
- `decode`: decoding over a `htree_jax.HTreeCache` (keys gathered as stored and rotated in
  the kernel, candidates split over programs), `attend_cache_pallas`; its twin is the JAX
  reference walk `htree_jax.reference.attend_tree(..., keys_rotated=False)`.

Every kernel runs with `interpret=True` on any platform; CI tests them that way.
"""
