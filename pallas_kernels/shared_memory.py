"""The shared memory of a Pallas-Triton program, and the rule that picks a launch by it.

Hopper (H100 and H200) gives a program at most `LIMIT` bytes. A kernel whose staged
tiles pass it does not compile (`RESOURCE_EXHAUSTED: Shared memory size limit
exceeded`), so every launch below is chosen from candidates in order of measured speed,
the first that this model says fits (`first_fitting`).

The model counts what Triton keeps in shared memory for a program's products: the
left operands held for the whole loop (query rows, in each part the product takes),
scratch of the loop's reductions, and one buffer per pipeline stage of each tile the
loop loads (keys, radii). Each count is checked against what the compiler reported on
an H100 (`benchmarks/probe_shared_memory.py`, thunk dumps; RESULTS "shared memory"):
equal where the program's scratch is not reused, above it where the compiler reuses some.
"""

from __future__ import annotations

import dataclasses

from jax import lax

from pallas_kernels.precision import BF16X3

# Bytes of shared memory a program may take on an H100 or H200 (opt-in maximum).
LIMIT = 232448


@dataclasses.dataclass(frozen=True)
class Footprint:
    """A program's shared memory: `held` bytes for the whole loop, `staged` bytes per
    pipeline stage; `pipelined=False`: one buffer whatever the stages (products exact in
    float32 do not run on the tensor cores' asynchronous path, and the compiler kept one
    buffer of their tiles at two stages)."""

    held: int
    staged: int
    pipelined: bool = True

    def bytes(self, stages: int) -> int:
        return self.held + (max(1, stages) if self.pipelined else 1) * self.staged


def operand_bytes(precision, operands, left: bool = False) -> int:
    """Bytes per feature of a product operand as the kernels hold it: `BF16X3` two
    bfloat16 parts (4), a 16-bit dtype name 2, float32 4; 3xTF32 (`Precision.HIGH`,
    float32 operands) splits the left operand in the kernel into two float32 parts (8).
    The right operand of the top layer's importance is one float32 array then
    (`key_operands(split=False)`)."""
    if operands == BF16X3:
        return 4
    if operands is not None:
        return 2
    return 8 if left and precision == lax.Precision.HIGH else 4


def top_importance(rows: int, block_queries: int, tile: int, kp: int, bound_width: int, precision,
                   operands) -> Footprint:
    """The top layer's importance kernel (`top_layer._top_keys_kernel`): `rows` query
    rows of `kp` features held (and their `bound_width` feature-group norms with the
    bound), the `[block_queries, tile]` float32 importance summed over each query's
    rows, and per stage a tile of `tile` keys (and their radii)."""
    left, right = operand_bytes(precision, operands, left=True), operand_bytes(precision, operands)
    held = rows * (kp + bound_width) * left + 4 * block_queries * tile
    return Footprint(held, tile * (kp + bound_width) * right, pipelined(precision, operands))


def pipelined(precision, operands) -> bool:
    """Whether a product's tiles are staged per pipeline stage: all but exact float32."""
    return not (operands is None and precision == lax.Precision.HIGHEST)


def fits(footprint: Footprint, stages: int, limit: int = LIMIT) -> bool:
    return footprint.bytes(stages) <= limit


def first_fitting(candidates, footprint_of, limit: int = LIMIT):
    """The first candidate `(..., stages)` whose `footprint_of(candidate)` fits with its
    stages; the last candidate when none does (the compiler then says by how much)."""
    candidates = list(candidates)
    for c in candidates:
        if fits(footprint_of(c), c[-1], limit):
            return c
    return candidates[-1]


__all__ = ["LIMIT", "Footprint", "first_fitting", "fits", "operand_bytes", "pipelined", "top_importance"]
