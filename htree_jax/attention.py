"""`htree_attention`: the public entry point (validation, then backend dispatch)."""

from __future__ import annotations

import jax.numpy as jnp

from htree_jax.config import HTreeConfig
from htree_jax.reference import htree_attention_reference
from htree_jax.validation import check_config, check_qkv

# Backends that exist today. "auto" picks the best one for the default device; the
# Pallas backend (GPU, issue 3) will join this table.
BACKENDS = ("auto", "reference")


def resolve_backend(backend: str) -> str:
    """The concrete backend that `backend` names on this platform."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "reference"
    return backend


def htree_attention(
    q,
    k,
    v,
    config: HTreeConfig | None = None,
    *,
    backend: str = "auto",
    return_selected: bool = False,
):
    """Hierarchical sparse (htree) attention, causal, with RoPE applied inside.

    Args:
      q: `[B, T, H, K]` queries, un-rotated.
      k: `[B, T, H_kv, K]` keys, un-rotated; `H % H_kv == 0`, `K` even.
      v: `[B, T, H_kv, V]` values.
        q, k, v share one dtype: float32, bfloat16 or float16.
      config: an `HTreeConfig` (default `HTreeConfig()`), static under `jax.jit`.
      backend: `"auto"` (the best backend for the platform) or `"reference"` (the
        jittable JAX reference).
      return_selected: also return the nodes selected for refinement at every layer
        `l >= 1` (the parent lists of the layer below), top layer first: a list of
        `L - 1` int32 arrays `[B, T, H_kv, top_k]`, ascending, `-1` padded (empty
        when `T <= top_k * compression_rate`, where htree is exact attention).

    Returns:
      `o [B, T, H, V]` in the input dtype, or `(o, selected)` with `return_selected`.
    """
    config = check_config(config)
    check_qkv(q, k, v)
    impl = resolve_backend(backend)
    if not isinstance(return_selected, bool):
        raise TypeError(f"return_selected must be a bool, got {return_selected!r}")
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if impl == "reference":
        o, selected = htree_attention_reference(q, k, v, config)
    else:  # pragma: no cover - resolve_backend only returns known names
        raise AssertionError(impl)
    return (o, selected) if return_selected else o
