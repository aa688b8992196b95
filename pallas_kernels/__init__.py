"""Pallas (Triton lowering) kernels for htree attention on NVIDIA GPUs.

Empty for now: the kernels (tree build, per-layer scoring, shared top-K, online-softmax
accumulation) arrive with the Pallas backend, each beside a pure-JAX twin.
"""
