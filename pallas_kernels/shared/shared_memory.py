"""The shared memory of a Pallas-Triton program, and the rule that picks a launch by it.

Hopper (H100 and H200) gives a program at most `LIMIT` bytes. A kernel whose staged
tiles pass it does not compile (`RESOURCE_EXHAUSTED: Shared memory size limit
exceeded`), so every launch below is chosen from candidates in order of measured speed,
the first that this model says fits (`first_fitting`).

The model counts what Triton keeps in shared memory for a program's products: the
left operands held for the whole loop (query rows, in each part the product takes),
scratch of the loop's reductions, and one buffer per pipeline stage of each tile the
loop loads (keys, radii). Each count is checked against what the compiler reported on
an H100 (XLA's thunk dumps, which `tools/gpu_gate.py` reads on every run):
equal where the program's scratch is not reused, above it where the compiler reuses some.
"""

from __future__ import annotations

import dataclasses

from jax import lax

from pallas_kernels.shared.precision import BF16X3

# Bytes of shared memory a program may take on an H100 or H200 (opt-in maximum).
LIMIT = 232448
# The widest padded head dim whose gathered tiles the compiler stages per pipeline stage
# (measured up to 256; at 1024, packed latent attention, it did not).
WIDEST_STAGED = 256


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
    """The top layer's importance kernel (`gqa.top_layer._top_keys_kernel`): `rows` query
    rows of `kp` features held (and their `bound_width` feature-group norms with the
    bound), the `[block_queries, tile]` float32 importance summed over each query's
    rows, and per stage a tile of `tile` keys (and their radii)."""
    left, right = operand_bytes(precision, operands, left=True), operand_bytes(precision, operands)
    held = rows * (kp + bound_width) * left + 4 * block_queries * tile
    if kp > WIDEST_STAGED:
        # Wider tiles are not staged per pipeline stage, nor their radii: packed latent
        # attention (kp = 1024, 16 rows, 16 candidates) took 114688 B with the mean at 2
        # stages and 180224 B with the bound at 1, each its held rows and 49152 B more.
        return Footprint(held, tile * kp * right, False)
    return Footprint(held, tile * (kp + bound_width) * right, pipelined(precision, operands))


def per_query(rows: int, tile: int, kp: int, vp: int, itemsize: int, bound_width: int = 0,
              backward: bool = False, precision=None, operands=None) -> Footprint:
    """A per-query kernel below the top layer (`importance._scores_kernel`, the merges;
    with `backward`, `layer_backward` and `node_backward`'s): `rows` product rows held at
    4 bytes a feature (float32, or `BF16X3`'s two bfloat16 parts; the backward's `do`
    and `dq` rows too) with the bound's `bound_width` group norms; per stage a tile of
    `tile` gathered keys and `vp` values (0: the scores kernel's keys only) as stored,
    and their float32 radii. Calibrated on the compiler (H100, 2026-11-26): float32 at
    K = V = 256 asked 246848 B with 2 stages (counted 286720) and compiled with 1;
    packed latent attention (16 rows, kp = 1024) with the bound asked 368640 B (counted
    524288) and 237568 B at 16 candidates (327680), the mean 172032 B (196608).

    One stage is the fallback (`first_fitting`'s last candidate): Triton keeps no
    pipeline buffers then, and every probed shape compiled so (the count above is an
    upper bound there)."""
    held = rows * 4 * (kp + bound_width + (kp + vp if backward else 0))
    staged = tile * (itemsize * (kp + vp) + 4 * bound_width)
    return Footprint(held, staged, True if precision is None else pipelined(precision, operands))


def per_query_stages(stages: int, footprint: Footprint) -> int:
    """The block sizes' pipeline stages where `footprint` fits with them, else one."""
    return first_fitting([(stages,), (1,)], lambda c: footprint)[0]


# Wide programs (groups of more than 16 heads; latent attention) count only their
# operands, not the compiler's scratch for the RoPE rotations and the merge's
# accumulator, so they keep to budgets of their own below `LIMIT`, each measured where
# it was set (H200, the MLA shape): a program's query rows and one step's tiles at most
# `WIDE_PROGRAM_BYTES` (bfloat16 with separate values, 204800 B, compiles at 64 rows and
# 64 candidates; float32, 409600 B counted, asked 262144 B of 232448), and the tiles of
# every pipeline stage of a merge or decode kernel at most `WIDE_STAGED_BYTES` (the
# decode step's kernels compile at 147456 B counted; a bottom merge at 64 candidates a
# span, 278528 B counted, asked 348416 B).
WIDE_PROGRAM_BYTES = 208 * 1024
WIDE_STAGED_BYTES = 160 * 1024


def wide_program(rows: int, tile: int, latent: int, rope_half: int, own_values: int, itemsize: int,
                 bound_width: int = 0) -> Footprint:
    """A wide program (`program_shape`): `rows` query rows' `latent` features held
    (and, for the decode step's bound, their `bound_width` float32 group norms); per step
    `tile` candidates' latent features, two RoPE halves of `rope_half`, `own_values`
    value features (0: the values are the latent features) and `bound_width` float32 radii."""
    held = rows * (itemsize * latent + 4 * bound_width)
    return Footprint(held, tile * (itemsize * (latent + 2 * rope_half + own_values) + 4 * bound_width))


def staged_tiles(span: int, features: int, itemsize: int, bound_width: int = 0) -> Footprint:
    """The gathered tiles of a decode or wide merge step: `span` rows of `features` at
    `itemsize` bytes and `bound_width` float32 radii; nothing held (the rows are budgeted
    by `wide_program`)."""
    return Footprint(0, span * (itemsize * features + 4 * bound_width))


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


def program_shape(rows: int, tile: int, r: int, Wl: int, hp: int, Wv_own: int, itemsize: int,
                  bound_width: int = 0) -> tuple:
    """`(rows, tile)` of a wide program: the first of `program_candidates` whose query
    rows' latent part and one step's tiles (latent, RoPE, separate values; with the
    decode step's bound, `bound_width` float32 group norms and radii) fit
    `WIDE_PROGRAM_BYTES` (`wide_program`). At the MLA shape
    (r=16) bfloat16 keeps 64 x 64; float32 takes 32 x 32 with separate values."""
    footprint = lambda c: wide_program(c[0], c[1], Wl, hp, Wv_own, itemsize, bound_width)
    rows, tile, _ = first_fitting(program_candidates(rows, tile, r), footprint, WIDE_PROGRAM_BYTES)
    return rows, tile


def program_candidates(rows: int, tile: int, r: int) -> list:
    """`(rows, tile, 1)` from the block sizes' down, fastest first: rows halved while
    they are at least the tile (and above 16), then the tile (a multiple of r, at least
    16), then rows down to 16."""
    out = [(rows, tile, 1)]
    while True:
        if rows > 16 and rows >= tile:
            rows //= 2
        elif tile // 2 >= max(16, r) and (tile // 2) % r == 0:
            tile //= 2
        elif rows > 16:
            rows //= 2
        else:
            return out
        out.append((rows, tile, 1))

__all__ = ["LIMIT", "WIDE_PROGRAM_BYTES", "WIDE_STAGED_BYTES", "Footprint", "first_fitting", "fits", "operand_bytes",
           "per_query", "per_query_stages", "pipelined", "program_candidates", "program_shape", "staged_tiles",
           "top_importance", "wide_program"]
