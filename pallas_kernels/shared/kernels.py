"""`BlockKernels`: which kernel runs each part of block selection (SPEC 12,
`pallas_kernels/block/`): the merge, the backward's walk, how the key and value gradients
are summed and the sums' kernel. A user's ask (`htree_attention(..., block_kernels=)`),
`"auto"` where the plan chooses (`htree_jax.backends.plan_call`, once a call); the plan
hands the kernels a `BlockKernels` with every choice made. The launch configs
(`configs.py`) hold tile sizes and warps, not these choices.
"""

from __future__ import annotations

import dataclasses

# The block-selection merge's kernels (`pallas_kernels.block.forward.MERGES`, `docs/backends.md`).
MERGE_ROUTES = ("pallas_triton", "mosaic_gpu")
BACKWARD_SUMS = ("auto", "atomics", "partials")
BACKWARD_WALKS = ("auto", "pallas_triton", "mosaic_gpu")
SUM_KERNELS = ("pallas_triton", "mosaic_gpu")


@dataclasses.dataclass(frozen=True)
class BlockKernels:
    """Which kernel runs each part of block selection; `"auto"`: the plan's choice.

    - `merge`: the forward's merge, one of `MERGE_ROUTES`: Pallas-Triton
      (`block/merge.py`, the one interpreted runs take) or Mosaic GPU
      (`block/mosaic_merge.py`: 16-bit inputs, the head dims and rows
      `check_mosaic_dims` allows); `"auto"`: Mosaic GPU on a Hopper GPU where it takes
      the shape (the faster measured, RESULTS), else Pallas-Triton.
    - `sums`: how the backward sums the key and value gradients (`block/backward.py`):
      `"atomics"`, float32 atomics from every block that merged a node (not bitwise
      reproducible run to run); `"partials"` (`block/partials.py`), each block's sums
      written to a buffer, then summed by node in block order (bitwise reproducible);
      `"auto"`: partials on a GPU, atomics interpreted. At the benchmark shape's 128K
      (RESULTS, H200) partials take 305 ms on the Mosaic GPU walk and 681 on the
      Pallas-Triton one against the atomics' 877. Interpreted runs keep the atomics:
      there the partials' walk and sums compile in about twice the atomics' time (3.9 s
      against 2.1 at T=150), which the CPU suite feels, and it tests the partials by name.
    - `walk`: the kernel that walks the blocks for partial sums: `"mosaic_gpu"`
      (`block/mosaic_backward.py`: WGMMA, TMA, warp-specialized; 16-bit inputs, K and V
      up to 128), `"pallas_triton"` (`block/backward.py`, its twin, the one interpreted
      runs take), or `"auto"`: Mosaic GPU on a Hopper GPU wherever it takes the launch,
      else Pallas-Triton. The atomics walk on Pallas-Triton.
    - `sum_kernel`: the kernel of the Mosaic GPU walk's sums: `"pallas_triton"`
      (`block/partials.py`, in place) or `"mosaic_gpu"` (`block/mosaic_sums.py`: TMA,
      every tile a chunk, since it cannot alias its totals). Mosaic GPU is opt-in: gated,
      but its sums took 333 ms against 225 at 512K (H200; layer 0 3.85 ms a chunk
      against 2.15) for 40.7 against 43.1 at 128K (H100) (RESULTS).
    """

    merge: str = "auto"
    walk: str = "auto"
    sums: str = "auto"
    sum_kernel: str = "pallas_triton"

    def __post_init__(self):
        if self.merge not in ("auto",) + MERGE_ROUTES:
            raise ValueError(f"BlockKernels.merge must be 'auto' or one of {MERGE_ROUTES}, got {self.merge!r}")
        if self.sums not in BACKWARD_SUMS:
            raise ValueError(f"BlockKernels.sums must be one of {BACKWARD_SUMS}, got {self.sums!r}")
        if self.walk not in BACKWARD_WALKS:
            raise ValueError(f"BlockKernels.walk must be one of {BACKWARD_WALKS}, got {self.walk!r}")
        if self.sum_kernel not in SUM_KERNELS:
            raise ValueError(f"BlockKernels.sum_kernel must be one of {SUM_KERNELS}, got {self.sum_kernel!r}")
        if self.walk == "mosaic_gpu" and self.sums not in ("auto", "partials"):
            raise ValueError(f"BlockKernels.walk='mosaic_gpu' writes partial sums: it takes sums='partials', got "
                             f"{self.sums!r}")


__all__ = ["BACKWARD_SUMS", "BACKWARD_WALKS", "BlockKernels", "MERGE_ROUTES", "SUM_KERNELS"]
