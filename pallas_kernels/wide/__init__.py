"""The wide family: latent attention's groups of 32 or more query heads per kv head
(DeepSeek's absorbed MLA), the values read from the keys' latent features where given so.

- `kernels`: the wide importance and merge kernels, a program holding many heads' rows.
- `forward`: `wide_forward_pallas`, `wide_eligible` (which calls this family takes).
- `backward`: `wide_backward_pallas`.
- `attention`: `wide_attention`, the two paired as a `custom_vjp`.
"""
