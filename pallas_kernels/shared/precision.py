"""Operand precision of the kernels' dot products (Pallas-Triton runs `f32` dots as TF32).

- Selection-deciding score dots (importance): exact float32 for float32 inputs; for
  bfloat16/float16 inputs `BF16X3` (float32-grade from bfloat16 pairs) or 3xTF32.
- Merge dots (which only weigh values): the input dtype's operands with float32
  accumulation, as flash attention does; exact float32 for float32 inputs.
`Precisions` bundles the four choices of one call; `Precisions.for_dtype` gives the
defaults. The left operand of a product is prepared by `split_rows`, the right one
(keys, in memory) by `key_operands`; `dot_rows` multiplies them.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax


def tf32_split(x):
    """`x = hi + lo` with `hi` exact in TF32 (low 13 mantissa bits cleared)."""
    hi = lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.int32) & jnp.int32(-8192), jnp.float32)
    return hi, x - hi


# `operands` value for float32-grade products on bfloat16 tensor cores: each float32
# operand is split into `hi + lo`, both bfloat16 (16 significant bits together), and
# hi*hi + hi*lo + lo*hi accumulate in float32: ~1e-5 relative, at bf16 tensor-core rate
# and half the bytes of a (hi, lo) float32 pair.
BF16X3 = "bf16x3"


def bf16_split(x):
    """`x = hi + lo` (float32 `x`), both bfloat16: ~2^-17 relative. `hi` is `x` rounded to
    8 significant bits on its bit pattern (exact in bfloat16), not by a round trip
    through bfloat16, which the GPU compiler folded away (then `lo = 0`: H200, 0.69 of
    parent lists agreed, as with plain bfloat16)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    hi = lax.bitcast_convert_type((bits + jnp.int32(0x8000)) & jnp.int32(-65536), jnp.float32)
    return hi.astype(jnp.bfloat16), (x - hi).astype(jnp.bfloat16)


def split_rows(a, precision, operands=None):
    """The left operand of `dot_rows`, prepared once (hoisted out of loops where it is
    loop-invariant): split `hi + lo` for 3xTF32 or `BF16X3`, or cast to the `operands`
    dtype."""
    if operands == BF16X3:
        return bf16_split(a.astype(jnp.float32))
    if operands is not None:
        return (a.astype(operands), None)
    return tf32_split(a) if precision == lax.Precision.HIGH else (a, None)


def key_parts(precision, operands=None) -> int:
    """How many arrays `key_operands` gives: 2 for 3xTF32 or `BF16X3` (`hi`, `lo`), else 1."""
    return 2 if operands == BF16X3 or (operands is None and precision == lax.Precision.HIGH) else 1


def key_operands(keys, precision, operands=None, split: bool = True) -> tuple:
    """The right operand of `dot_rows` as the kernels read it, prepared once in memory:
    `(hi, lo)` float32 for 3xTF32, `(keys in the operands dtype,)`, or `(float32,)`.
    A loaded tile then goes into the product as it is: any arithmetic on it in the
    kernel (a split, a cast, a rotation) puts it through registers and a layout change
    before every product, which cost more than the load in the per-query kernels (below
    the top, pre-split keys). `split=False` leaves the 3xTF32 split to the kernel: the
    top layer's importance pass, bound by its products, not its loads, ran faster that
    way (journal, 2026-11-22 (later))."""
    keys = keys.astype(jnp.float32)
    if operands == BF16X3:
        return bf16_split(keys)
    if operands is not None:
        return (keys.astype(operands),)
    return tf32_split(keys) if precision == lax.Precision.HIGH and split else (keys,)


def check_key_parts(k_parts, expected: tuple):
    """`k_parts` must be what `key_operands` gives: a tuple of one of the `expected` lengths."""
    if not isinstance(k_parts, tuple) or len(k_parts) not in expected:
        raise TypeError(f"keys must be a tuple of {' or '.join(map(str, expected))} array(s) from key_operands, "
                        f"got {type(k_parts).__name__}")


def dot_rows(a_parts, b_parts, precision, operands=None):
    """`a [m, k] @ b[n, k].T` in float32, `a` prepared by `split_rows`, `b` a tuple of
    tiles loaded from `key_operands` arrays (`operands`: both in that dtype, float32
    accumulation).

    `Precision.HIGH` is done here as 3xTF32 (hi*hi + hi*lo + lo*hi): ~1e-6 relative
    error on TF32 tensor cores. Pallas-Triton runs HIGH as plain TF32 (~5e-4), which is
    as coarse as the 10-bit buckets of the packed importance and flipped 7-16% of the
    selections at T=32768; HIGHEST (exact float32) ran several times slower.
    """
    dims = (((1,), (1,)), ((), ()))
    if operands == BF16X3:
        (a_hi, a_lo) = a_parts
        b_hi, b_lo = b_parts if len(b_parts) == 2 else bf16_split(b_parts[0].astype(jnp.float32))
        bf16 = lambda x, y: lax.dot_general(x, y, dims, preferred_element_type=jnp.float32)
        return bf16(a_hi, b_hi) + (bf16(a_hi, b_lo) + bf16(a_lo, b_hi))
    if operands is not None:
        return lax.dot_general(a_parts[0], b_parts[0].astype(operands), dims, preferred_element_type=jnp.float32)
    if precision == lax.Precision.HIGH:
        (a_hi, a_lo) = a_parts
        b_hi, b_lo = b_parts if len(b_parts) == 2 else tf32_split(b_parts[0].astype(jnp.float32))
        tf32 = lambda x, y: lax.dot_general(x, y, dims, preferred_element_type=jnp.float32,
                                            precision=lax.Precision.DEFAULT)
        return tf32(a_hi, b_hi) + (tf32(a_hi, b_lo) + tf32(a_lo, b_hi))
    return lax.dot_general(a_parts[0], b_parts[0].astype(jnp.float32), dims, preferred_element_type=jnp.float32,
                           precision=precision)


def score_dot(a, b_parts, precision, operands=None):
    """`dot_rows` with `a` prepared on the spot."""
    return dot_rows(split_rows(a, precision, operands), b_parts, precision, operands)


def stored_dot(a, b, precision, operands=None):
    """`a [m, k] @ b [n, k].T` in float32 of operands as loaded: exact products of
    stored 16-bit values of one dtype (float32 accumulation: what SPEC 7's unrotated
    features of bfloat16 queries and keys need, one product where `BF16X3` takes three),
    else `score_dot` at `precision` / `operands`."""
    if a.dtype == b.dtype and a.dtype != jnp.float32:
        return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return score_dot(a.astype(jnp.float32), (b.astype(jnp.float32),), precision, operands)


def weighted_values(w, values, score_precision, operands):
    """`w [R, tile] @ values [tile, Vp]` in float32. Values only need the output's
    precision: TF32 unless exact float32 is asked for, or `operands` (bf16/f16) dots."""
    dims = (((1,), (0,)), ((), ()))
    if operands is not None:
        return lax.dot_general(w.astype(operands), values.astype(operands), dims, preferred_element_type=jnp.float32)
    precision = lax.Precision.HIGHEST if score_precision == lax.Precision.HIGHEST else lax.Precision.DEFAULT
    return lax.dot_general(w, values.astype(jnp.float32), dims, preferred_element_type=jnp.float32,
                           precision=precision)



def product(a, b, contract, precision, operands):
    """`a, b` contracted over `contract = (i, j)` in float32: in the `operands` dtype
    (bf16/f16 inputs, as flash attention's backward) or float32 at `precision`."""
    dims = ((contract[:1], contract[1:]), ((), ()))
    if operands is not None:
        return lax.dot_general(a.astype(operands), b.astype(operands), dims, preferred_element_type=jnp.float32)
    precision = lax.Precision.HIGHEST if precision == lax.Precision.HIGHEST else lax.Precision.DEFAULT
    return lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), dims,
                           preferred_element_type=jnp.float32, precision=precision)


def whole_keys(parts):
    """The key tile from its `key_operands` parts (`hi + lo` for 3xTF32)."""
    return parts[0] if len(parts) == 1 else parts[0].astype(jnp.float32) + parts[1].astype(jnp.float32)



def default_precision(dtype):
    """Score dots that decide selections: exact float32 for float32 inputs (they must
    match the reference to 1e-4); 3xTF32 (`HIGH`, see `score_dot`) for
    bfloat16/float16 inputs: scores to ~1e-6, several times faster than exact dots."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.HIGH


def default_merge_precision(dtype):
    """Score dots of the merge passes, which only weigh values in the output: exact for
    float32 inputs, TF32 (~5e-4, below bfloat16's own 4e-3) for bfloat16/float16."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def default_importance_operands(dtype):
    """bfloat16/float16 inputs: the importance dots (which decide selections) in `BF16X3`,
    float32-grade (~4e-6 relative, against ~1e-6 for 3xTF32 and 4e-3 for plain bfloat16)
    at bfloat16 tensor-core rate, reading half the bytes of 3xTF32's split keys. H200,
    T=32768, against the float32 reference: parent lists identical 0.9988 (softmax) /
    0.9968 (shared_max), 0.9997 / 0.9994 with 3xTF32, 0.61 with plain bfloat16; the
    forward faster than with 3xTF32 (journal, 2026-11-22 (later)). float32 inputs: None (the
    dots at `default_precision`, exact float32)."""
    return BF16X3 if jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) else None


def default_merge_operands(dtype):
    """bfloat16/float16 inputs: the merge dots take operands in the input dtype (the
    rotated query and keys and the softmax weights rounded to it, float32 accumulation),
    as flash attention does; the merges do not select, so this only touches the output,
    at the input dtype's own precision. float32 inputs: float32 operands."""
    return jnp.dtype(dtype).name if jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) else None



@dataclasses.dataclass(frozen=True)
class Precisions:
    """The dot precisions of one call (static). `scores`: the importance dots' precision
    (`HIGHEST` exact float32, `HIGH` 3xTF32); `importance_operands`: None (float32 at
    `scores`), `BF16X3` or a dtype name; `merge` and `merge_operands` likewise for the
    merge dots (a dtype name: operands in that dtype, float32 accumulation)."""

    scores: lax.Precision
    importance_operands: str | None
    merge: lax.Precision
    merge_operands: str | None

    @classmethod
    def for_dtype(cls, dtype) -> "Precisions":
        """The defaults for inputs of `dtype` (see `default_precision` and the others)."""
        return cls(default_precision(dtype), default_importance_operands(dtype), default_merge_precision(dtype),
                   default_merge_operands(dtype))

    @classmethod
    def uniform(cls, precision: lax.Precision) -> "Precisions":
        """Every dot at `precision` with float32 operands (`HIGHEST`: exact float32 dots
        for any input dtype, as `tools/check_pallas_gpu.py` compares)."""
        return cls(precision, None, precision, None)
