"""Input checks shared by every entry point.

They read only shapes and dtypes, so they work on tracers under `jax.jit` and run
before any heavy work. Every error names the argument and the rule it broke.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from htree_jax.core.config import HTreeConfig

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class Dims:
    """The named sizes of one call: `q [B,T,H,K]`, `k [B,T,H_kv,K]`, `v [B,T,H_kv,V]`."""

    batch: int
    seq_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    value_dim: int

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


def _shape_and_dtype(name: str, x):
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(f"{name} must be an array with .shape and .dtype, got {type(x).__name__}")
    return tuple(shape), np.dtype(dtype)


def as_jax_takes_it(x):
    """`x` as a JAX function takes it: a float64 array becomes float32 where JAX's 64-bit
    types are off (its default; `jnp.asarray` does the same); anything else unchanged."""
    dtype = getattr(x, "dtype", None)
    if dtype is not None and np.dtype(dtype) == np.float64 and jax.dtypes.canonicalize_dtype(np.float64) != np.float64:
        return jnp.asarray(x)
    return x


def check_dtype(name: str, dtype) -> None:
    if not any(dtype == np.dtype(d) for d in SUPPORTED_DTYPES):
        names = ", ".join(np.dtype(d).name for d in SUPPORTED_DTYPES)
        hint = f" (cast it: {name}.astype(jnp.float32))" if np.issubdtype(dtype, np.floating) else ""
        raise TypeError(f"{name} must have a floating dtype ({names}), got {dtype.name}{hint}")


def check_config(config) -> HTreeConfig:
    if config is None:
        return HTreeConfig()
    if not isinstance(config, HTreeConfig):
        raise TypeError(f"config must be an HTreeConfig or None, got {type(config).__name__}")
    return config


def check_kv(k, v) -> Dims:
    """Checks `k [B,T,H_kv,K]` and `v [B,T,H_kv,V]` alone (what `build_tree` needs)."""
    k_shape, k_dtype = _shape_and_dtype("k", k)
    v_shape, v_dtype = _shape_and_dtype("v", v)
    for name, shape in (("k", k_shape), ("v", v_shape)):
        if len(shape) != 4:
            raise ValueError(f"{name} must have rank 4 [B, T, H_kv, D], got shape {shape}")
    check_dtype("k", k_dtype)
    check_dtype("v", v_dtype)
    if k_dtype != v_dtype:
        raise TypeError(f"k and v must have the same dtype, got k {k_dtype.name}, v {v_dtype.name}")
    B, T, H_kv, K = k_shape
    if v_shape[:3] != (B, T, H_kv):
        raise ValueError(
            f"v must have shape [B, T, H_kv, V] = [{B}, {T}, {H_kv}, V] matching k {k_shape}, "
            f"got {v_shape}"
        )
    if T == 0:
        raise ValueError("sequence length T (axis 1 of q, k, v) must be >= 1, got T = 0")
    if B == 0:
        raise ValueError("batch size B (axis 0 of q, k, v) must be >= 1, got B = 0")
    if H_kv == 0:
        raise ValueError("k and v must have at least one head (H_kv >= 1), got 0")
    if K == 0 or K % 2:
        raise ValueError(f"head dim K (last axis of q and k) must be even and >= 2 for RoPE, got {K}")
    if v_shape[3] == 0:
        raise ValueError("value dim V (last axis of v) must be >= 1, got 0")
    return Dims(B, T, H_kv, H_kv, K, v_shape[3])


def check_batch_and_length(shapes: dict) -> None:
    """`[B, T]` (axes 0 and 1) must agree across the named arrays' shapes; where one
    differs from the others, the error names that one."""
    for axis, what in ((0, "batch size B (axis 0)"), (1, "sequence length T (axis 1)")):
        sizes = {name: shape[axis] for name, shape in shapes.items() if len(shape) > axis}
        if len(set(sizes.values())) <= 1:
            continue
        counts = {}
        for size in sizes.values():
            counts[size] = counts.get(size, 0) + 1
        common = max(counts, key=counts.get)
        odd = [name for name, size in sizes.items() if size != common]
        others = [name for name in sizes if name not in odd]
        if len(others) > 1 or len(odd) == 1:
            raise ValueError(f"{', '.join(odd)} must have the {what} of {' and '.join(others)}: "
                             f"{', '.join(f'{n} has {sizes[n]}' for n in sizes)}")
        raise ValueError(f"q, k and v must agree on the {what}: "
                         f"{', '.join(f'{n} has {sizes[n]}' for n in sizes)}")


def check_qkv(q, k, v) -> Dims:
    """Checks `q [B,T,H,K]`, `k [B,T,H_kv,K]`, `v [B,T,H_kv,V]`; returns their sizes."""
    q_shape, q_dtype = _shape_and_dtype("q", q)
    if len(q_shape) != 4:
        raise ValueError(f"q must have rank 4 [B, T, H, K], got shape {q_shape}")
    check_dtype("q", q_dtype)
    kv_shapes = {"k": _shape_and_dtype("k", k)[0], "v": _shape_and_dtype("v", v)[0]}
    for name, shape in kv_shapes.items():  # each array's rank before what the arrays share
        if len(shape) != 4:
            raise ValueError(f"{name} must have rank 4 [B, T, H_kv, D], got shape {shape}")
    check_batch_and_length({"q": q_shape, **kv_shapes})
    kv = check_kv(k, v)
    k_dtype = np.dtype(k.dtype)
    if q_dtype != k_dtype:
        raise TypeError(f"q, k and v must have the same dtype, got q {q_dtype.name}, k {k_dtype.name}")
    B, T, H, K = q_shape
    if (B, T) != (kv.batch, kv.seq_len):
        raise ValueError(
            f"q, k and v must agree on [B, T]: q has {(B, T)}, k and v have "
            f"{(kv.batch, kv.seq_len)}"
        )
    if K != kv.head_dim:
        raise ValueError(f"q and k must have the same head dim K (last axis): q {K}, k {kv.head_dim}")
    if H == 0 or H % kv.num_kv_heads:
        raise ValueError(
            f"query heads H (axis 2 of q) must be a positive multiple of H_kv (axis 2 of k), "
            f"got H = {H}, H_kv = {kv.num_kv_heads}"
        )
    return Dims(B, T, H, kv.num_kv_heads, K, kv.value_dim)


def check_latent_value_dim(value_dim, K: int, config: HTreeConfig) -> int:
    """Values read from the keys (DeepSeek's absorbed form): `value_dim` a positive int,
    at most the features of `K` that do not rotate, `K - rope_dim`."""
    if isinstance(value_dim, bool) or not isinstance(value_dim, (int, np.integer)) or value_dim < 1:
        raise ValueError(f"values read from the keys: value_dim must be a positive int, got {value_dim!r}")
    unrotated = K - (config.partial_rope(K) or K)
    if value_dim > unrotated:
        raise ValueError(f"value_dim must be at most the unrotated features of k, K - rope_dim = {unrotated} "
                         f"(K = {K}, rope_dim = {config.rope_dim}), got {value_dim}")
    return int(value_dim)
