"""The per-query family: groups of up to 16 query heads per kv head (more, up to 128 in
multiples of 16, as virtual kv heads), forward and backward.

- `plan`: `prepare` (the padded tree, its rotated keys, launch statics), `check_pallas_dims`.
- `chunks`: a chunk of queries' top layer and selections below it.
- `top_layer`: the top layer's importance and merge over blocks of queries (flash-attention shaped).
- `merge`: the online-softmax merge below the top and the bottom's normalisation (SPEC 2.4).
- `forward`: `htree_forward_pallas`.
- `layer_backward`: `dq` per query; `node_backward`: `dk`, `dv` per node (no atomics);
  `top_backward`: the top layer's gradients, flash attention's two loops.
- `backward`: `htree_backward_pallas` (gradients pushed down the tree).
- `attention`: `gqa_attention`, the two paired as a `custom_vjp`.
"""
