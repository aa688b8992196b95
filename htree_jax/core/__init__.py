"""The core of htree-jax: what every implementation stands on, importing only JAX and
NumPy (and each other): the static configuration (`config`), the input checks
(`validation`), the index arithmetic of the spec (`indexing`: candidate buffers, virtual
parents, packed keys), the softmax arithmetic of a layer (`softmax`), RoPE tables
(`rope`), the mean-pooling tree (`tree`), the packed-documents layout (`packing`), the
guard for non-finite inputs (`non_finite`) and the score bounds of `selection="bound"`
(`bounds`). "SPEC n" cites section n of `docs/SPEC.md`.
"""
