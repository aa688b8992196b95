"""The shared-memory model (`pallas_kernels.shared_memory`) against what the compiler
reported on an H100, and every launch it picks across the accepted grid fits by it."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import pytest

from htree_jax import HTreeConfig
from htree_jax.core.bounds import group_count
from pallas_kernels import shared_memory
from pallas_kernels.common import KERNEL_GROUP, next_power_of_two
from pallas_kernels.plan import BlockSizes, layout, top_pipeline
from pallas_kernels.precision import Precisions

# The top layer's importance kernel as compiled on an H100 (jax 0.11.2, 2026-11-26,
# `benchmarks/probe_shared_memory.py`): (G, K, rope_dim, dtype, bound, queries per program,
# tile, stages) -> bytes. "exact": the bytes the thunk dump gave, or the bytes an
# overflowing compile requested; "at most": dumps where the compiler reused scratch.
EXACT = [
    ((1, 32, None, "bfloat16", True, 128, 128, 2), 139264),
    ((4, 64, None, "bfloat16", False, 32, 128, 2), 114688),
    ((4, 64, None, "bfloat16", True, 32, 128, 2), 163840),
    ((8, 128, None, "bfloat16", False, 16, 128, 2), 204800),
    ((16, 128, None, "bfloat16", False, 8, 128, 2), 200704),
    ((8, 96, 32, "bfloat16", False, 16, 128, 2), 204800),
    ((8, 128, None, "float32", False, 16, 64, 2), 102400),
    ((8, 128, None, "float32", True, 16, 64, 2), 151552),
    ((8, 96, 32, "float32", True, 16, 64, 2), 200704),
    # Overflows (requested, of 232448):
    ((8, 128, None, "bfloat16", True, 16, 128, 2), 303104),
    ((8, 128, None, "bfloat16", True, 16, 128, 3), 401408),
    ((8, 128, None, "bfloat16", True, 16, 64, 3), 249856),
    ((8, 128, None, "bfloat16", True, 16, 64, 4), 299008),
    ((8, 128, None, "bfloat16", False, 16, 128, 3), 270336),
    ((8, 96, 32, "bfloat16", True, 16, 128, 2), 401408),
]
AT_MOST = [
    ((1, 32, None, "float32", False, 128, 64, 2), 40960),
    ((1, 32, None, "float32", True, 128, 64, 2), 53248),
    ((4, 64, None, "float32", False, 32, 64, 2), 49152),
    ((4, 64, None, "float32", True, 32, 64, 2), 73728),
    ((16, 128, None, "float32", True, 8, 64, 2), 149504),
    ((8, 192, None, "bfloat16", False, 16, 64, 1), 196608),
    ((8, 256, None, "bfloat16", False, 16, 64, 1), 196608),
    ((8, 192, None, "bfloat16", True, 16, 64, 1), 262144),  # requested (overflow)
]


def bound_width(K: int, rope_dim, bound: bool) -> int:
    if not bound:
        return 0
    kp = next_power_of_two(K, 32)
    return next_power_of_two(group_count(kp, kp - (K - (rope_dim or K))), 16)


def model_bytes(G, K, rope_dim, dtype, bound, queries, tile, stages):
    precisions = Precisions.for_dtype(jnp.dtype(dtype))
    footprint = shared_memory.top_importance(queries * next_power_of_two(G), queries, tile, next_power_of_two(K, 32),
                                             bound_width(K, rope_dim, bound), precisions.scores,
                                             precisions.importance_operands)
    return footprint.bytes(stages)


@pytest.mark.parametrize("case, measured", EXACT)
def test_model_equals_the_compiler(case, measured):
    assert model_bytes(*case) == measured


@pytest.mark.parametrize("case, measured", AT_MOST)
def test_model_bounds_the_compiler(case, measured):
    assert measured <= model_bytes(*case) <= measured * 1.6


def test_first_fitting_takes_the_first_that_fits():
    footprint = lambda c: shared_memory.Footprint(held=c[0], staged=1000)
    assert shared_memory.first_fitting([(232000, 2), (200000, 2), (100, 1)], footprint) == (200000, 2)
    assert shared_memory.first_fitting([(10**6, 2), (10**6, 1)], footprint) == (10**6, 1)  # none: the last


GROUPS = [1, 2, 3, 4, 6, 8, 12, 16]
HEAD_DIMS = [(32, None), (64, None), (96, 32), (128, None), (192, None), (192, 64), (256, None)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("selection", ["mean", "bound"])
def test_every_top_importance_launch_fits(dtype, selection):
    """The grid the API accepts on the top layer's kernels (G <= 16, and larger groups as
    virtual heads of 16; K up to 256 padded, V alike; top_k 8..1024, both importance
    modes, which do not change the launch): the picked launch fits by the model."""
    precisions = Precisions.for_dtype(jnp.dtype(dtype))
    for G, (K, rope), top_k in itertools.product(GROUPS, HEAD_DIMS, [8, 16, 64, 256, 512, 1024]):
        for importance in ("softmax", "shared_max"):
            config = HTreeConfig(top_k=top_k, rope_dim=rope, selection=selection, importance=importance)
            block_sizes = BlockSizes.for_dims(K, K)
            Mp = layout(config, block_sizes)[3]
            kp, width = next_power_of_two(K, 32), bound_width(K, rope, selection == "bound")
            _, (queries, tile, stages) = top_pipeline(block_sizes, precisions, kp, kp, min(G, KERNEL_GROUP), Mp,
                                                      width)
            got = model_bytes(min(G, KERNEL_GROUP), K, rope, dtype, selection == "bound", queries, tile, stages)
            assert got <= shared_memory.LIMIT, (G, K, rope, top_k, queries, tile, stages, got)
            assert tile <= Mp and queries >= 1


def test_the_bound_keeps_the_measured_launch_where_it_fits():
    """The benchmark shape (G=8, K=V=128, bf16): the mean keeps 128 candidates in two
    stages (204800 B); the bound, which asked 303104 B there, takes 64 in two (200704 B)."""
    precisions = Precisions.for_dtype(jnp.bfloat16)
    mean = top_pipeline(BlockSizes(), precisions, 128, 128, 8, 1024, 0)[1]
    bound = top_pipeline(BlockSizes(), precisions, 128, 128, 8, 1024, bound_width(128, None, True))[1]
    assert mean == (16, 128, 2) and bound == (16, 64, 2)
