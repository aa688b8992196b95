"""The decode family: queries over a decode cache (`htree_jax.HTreeCache`), keys gathered
as stored and rotated in the kernel, each query's candidates split over programs.

- `scores`: a layer's candidate scores over the cache; `merge`: their merge and the fold
  of the split programs' partial states.
- `walk`: `attend_cache_pallas`, the whole walk (its twin: the JAX reference's
  `htree_jax.reference.attend_tree` with `TreeWalk(..., keys_rotated=False)`).
- `append`: one token a row and every layer's changed node, in one launch.
"""
