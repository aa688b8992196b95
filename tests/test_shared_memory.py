"""The shared-memory model (`pallas_kernels.shared.shared_memory`) against what the compiler
reported on an H100, and every launch it picks across the accepted grid fits by it."""

from __future__ import annotations

import itertools
import re

import jax.numpy as jnp
import numpy as np
import pytest

from tools import gpu_gate
from htree_jax import HTreeConfig
from htree_jax.core.bounds import group_count
from pallas_kernels.decode.walk import decode_bound_width, decode_program, pipelined
from pallas_kernels.gqa.plan import bound_groups, group_rows, layout, top_importance_launch, top_pipeline
from pallas_kernels.shared import shared_memory
from pallas_kernels.shared.common import KERNEL_GROUP, LayerStatic, next_power_of_two
from pallas_kernels.shared.configs import DecodeBlockSizes, KernelConfigs
from pallas_kernels.shared.precision import Precisions

# The top layer's importance kernel as compiled on an H100 (jax 0.11.2, 2026-11-26,
# the thunk dumps that `tools/gpu_gate.py` reads): (G, K, rope_dim, dtype, bound, queries per program,
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
    # Packed latent attention (virtual heads of 16, K = 576 padded to 1024; gpu_gate, H100):
    ((16, 576, 64, "bfloat16", False, 1, 16, 2), 114688),
    ((16, 576, 64, "bfloat16", True, 1, 16, 1), 180224),
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
    assert model_bytes(*case) <= shared_memory.LIMIT or measured > shared_memory.LIMIT


def test_first_fitting_takes_the_first_that_fits():
    footprint = lambda c: shared_memory.Footprint(held=c[0], staged=1000)
    assert shared_memory.first_fitting([(232000, 2), (200000, 2), (100, 1)], footprint) == (200000, 2)
    assert shared_memory.first_fitting([(10**6, 2), (10**6, 1)], footprint) == (10**6, 1)  # none: the last


GROUPS = [1, 2, 3, 4, 6, 8, 12, 16]
HEAD_DIMS = [(32, None), (64, None), (96, 32), (128, None), (192, None), (192, 64), (256, None)]
# Groups past 16 heads run as virtual kv heads of 16 on these kernels (head dims up to
# 256, and packed latent attention at K = 576 with rope_dim = 64, V = 512).
WIDE_GROUPS = [32, 48, 64, 128]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("selection", ["mean", "bound"])
def test_every_top_importance_launch_fits(dtype, selection):
    """The grid the API accepts on the top layer's kernels (G <= 16, and larger groups as
    virtual heads of 16; K up to 256 padded, V alike; top_k 8..1024, both importance
    modes, which do not change the launch): the picked launch fits by the model."""
    precisions = Precisions.for_dtype(jnp.dtype(dtype))
    for G, (K, rope), top_k in itertools.product(GROUPS, HEAD_DIMS, [8, 16, 64, 256, 512, 1024]):
        for importance in ("softmax", "shared_max"):
            config = HTreeConfig(top_k=top_k, rope_dim=rope, selection=selection, importance=importance, selection_block=1)
            block_sizes = KernelConfigs.resolve(None, K, K)
            Mp = layout(config, block_sizes)[3]
            kp, width = next_power_of_two(K, 32), bound_width(K, rope, selection == "bound")
            _, (queries, tile, stages) = top_pipeline(block_sizes, precisions, kp, kp, min(G, KERNEL_GROUP), Mp,
                                                      width)
            got = model_bytes(min(G, KERNEL_GROUP), K, rope, dtype, selection == "bound", queries, tile, stages)
            assert got <= shared_memory.LIMIT, (G, K, rope, top_k, queries, tile, stages, got)
            assert tile <= Mp and queries >= 1


@pytest.mark.parametrize("selection", ["mean", "bound"])
def test_every_packed_latent_top_importance_launch_fits(selection):
    """Packed latent attention (the GQA kernels on virtual heads of 16 at K = 576)."""
    for top_k, importance in itertools.product([8, 64, 512, 1024], ["softmax", "shared_max"]):
        config = HTreeConfig(top_k=top_k, rope_dim=64, selection=selection, importance=importance)
        tuning = KernelConfigs.resolve(None, 576, 512)
        _, got = top_importance_launch(config, tuning, "bfloat16", 576, 512, KERNEL_GROUP)
        assert got <= shared_memory.LIMIT, (top_k, got)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("selection", ["mean", "bound"])
def test_every_per_query_launch_fits_or_takes_one_stage(dtype, selection):
    """Below the top layer: the forward's scores kernel (with the bound's norms and
    radii) and merges, and the backward's per-query kernels keep the block sizes' stages
    where the model says they fit, else one (every probed shape compiled so). The shapes that overflowed
    with two take one: float32 at K = V = 256 and K = V = 192 (backward), packed latent
    attention with the bound (forward)."""
    itemsize = jnp.dtype(dtype).itemsize
    for G, (K, rope) in itertools.product(GROUPS + WIDE_GROUPS, HEAD_DIMS + [(576, 64)]):
        V = 512 if K == 576 else K
        bs = KernelConfigs.resolve(None, K, V)
        config = HTreeConfig(top_k=8, rope_dim=rope, selection=selection, selection_block=1)
        kp, vp = next_power_of_two(K, 32), next_power_of_two(V, 16)
        rows = group_rows(min(G, KERNEL_GROUP), bs)
        precisions = Precisions.for_dtype(jnp.dtype(dtype))
        launches = ((bs.layer.num_stages, shared_memory.per_query(rows, bs.layer.tile, kp, vp, itemsize,
                                                                  backward=True)),
                    (bs.layer.scores_num_stages, shared_memory.per_query(rows, bs.layer.tile, kp, 0, itemsize,
                                                                   bound_groups(config, K)[1])),
                    (bs.layer.merge_num_stages, shared_memory.per_query(rows, bs.layer.tile, kp, vp, itemsize,
                                                                  precision=precisions.merge,
                                                                  operands=precisions.merge_operands)))
        for asked, footprint in launches:
            stages = shared_memory.per_query_stages(asked, footprint)
            assert stages == 1 or (stages == asked and shared_memory.fits(footprint, stages)), (G, K, stages)
    backward = lambda K, rows: shared_memory.per_query(rows, 64, K, K, 4, backward=True)
    assert shared_memory.per_query_stages(2, backward(256, 8)) == 1
    assert shared_memory.per_query_stages(2, backward(256, 16)) == 1
    assert shared_memory.per_query_stages(2, backward(128, 16)) == 2
    packed_bound = shared_memory.per_query(16, 32, 1024, 0, 2, 1024)
    assert shared_memory.per_query_stages(2, packed_bound) == 1
    assert shared_memory.per_query_stages(2, shared_memory.per_query(16, 32, 1024, 0, 2)) == 2


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("selection", ["mean", "bound"])
def test_every_wide_program_fits(itemsize, selection):
    """Wide groups (latent attention, G = 32..128, K = 576, V = 512 or the values read
    from the keys): the program the forward, the backward and the decode step take fits
    `WIDE_PROGRAM_BYTES`, and each decode kernel's stages fit `WIDE_STAGED_BYTES`. With
    the bound the decode step holds 544 float32 group norms a row (it asked 397568 B and
    565504 B at G = 32 and 128 before they were counted): bfloat16 takes 16 x 32."""
    config = HTreeConfig(top_k=64, rope_dim=64, selection=selection)
    width = decode_bound_width(config, 576)
    assert width == (544 if selection == "bound" else 0)
    for G, own_values in itertools.product(WIDE_GROUPS, [0, 512]):
        rows, span = decode_program(config, G, 576, 512, itemsize, DecodeBlockSizes())
        program = shared_memory.wide_program(rows, span, 512, 32, own_values, itemsize, width)
        assert shared_memory.fits(program, 1, shared_memory.WIDE_PROGRAM_BYTES), (G, rows, span)
        st = LayerStatic(r=16, tile=1024, group=G, alpha=1.0, importance="softmax", strict_causal=True, log_n=10,
                         top_k=64, precision=None, span=span, num_stages=1, latent_half=256)
        walk = pipelined(st, 576, 512, itemsize, own_values == 0, width)
        tiles = [(walk.scores, 576, width), (walk.merge, 512, 0), (walk.bottom, 576 + own_values, 0)]
        for x, features, w in tiles:
            staged = shared_memory.staged_tiles(x.span, features, itemsize, w)
            assert shared_memory.fits(staged, x.num_stages, shared_memory.WIDE_STAGED_BYTES), (G, x, features)
    if selection == "bound" and itemsize == 2:
        assert decode_program(config, 128, 576, 512, 2, DecodeBlockSizes()) == (16, 32)


def test_the_bound_keeps_the_measured_launch_where_it_fits():
    """The benchmark shape (G=8, K=V=128, bf16): the mean keeps 128 candidates in two
    stages (204800 B); the bound, which asked 303104 B there, takes 128 in one (204800 B,
    faster than 64 in two)."""
    precisions = Precisions.for_dtype(jnp.bfloat16)
    mean = top_pipeline(KernelConfigs(), precisions, 128, 128, 8, 1024, 0)[1]
    bound = top_pipeline(KernelConfigs(), precisions, 128, 128, 8, 1024, bound_width(128, None, True))[1]
    assert mean == (16, 128, 2) and bound == (16, 128, 1)


def test_the_gate_reads_each_kernels_shared_memory_from_the_thunk_dump(tmp_path):
    """`gpu_gate.dumped_kernels`: the largest bytes per Pallas kernel (its launch suffix
    dropped), other custom kernels left out, each dump file read once."""
    line = "kCustomKernel [x] {} grid: (1, 2, 3) block: (64, 1, 1) shared_memory: {} bytes\n"
    (tmp_path / "module_0001.thunk_sequence.txt").write_text(
        line.format("_scores_kernel__3", 1024) + line.format("_scores_kernel", 4096) + line.format("cudnn_fmha", 9))
    seen = set()
    assert gpu_gate.dumped_kernels(seen, str(tmp_path)) == {"_scores_kernel": 4096}
    assert gpu_gate.dumped_kernels(seen, str(tmp_path)) == {}
    (tmp_path / "module_0002.thunk_sequence.txt").write_text(line.format("_top_merge_kernel__1", 229376))
    assert gpu_gate.dumped_kernels(seen, str(tmp_path)) == {"_top_merge_kernel": 229376}


def test_gate_decode_error_waives_only_near_ties():
    """`gpu_gate.decode_rows_error`: a query the oracle flags as a near-tie may differ
    between decode and the full call; any other difference counts."""
    full = np.ones((1, 4, 4, 2))
    fragile = np.zeros((1, 4, 2), bool)
    fragile[0, 1, 1] = True
    flipped = full.copy()
    flipped[0, 1, 2:] += 5.0  # the waived query's heads (kv head 1: heads 2, 3)
    assert gpu_gate.decode_rows_error(flipped, full, fragile) == (0.0, 1 / 8)
    flipped[0, 1, 0] += 5.0  # kv head 0 of the same position: not waived
    err, waived = gpu_gate.decode_rows_error(flipped, full, fragile)
    assert err > 0.1 and waived == 1 / 8


def test_every_gate_case_sets_up_on_the_cpu():
    """`gpu_gate.case_setup` for every small case of the matrix: the GPU is the only place
    the gate runs, so a case whose name it cannot read would otherwise fail there first
    (as every block case once did)."""
    setups = {gpu_gate.case_name("small", c, 0): gpu_gate.case_setup(c[0], c[2], c[3])
              for c in gpu_gate.matrix(full=True)}
    long = [s for name, s in setups.items() if name.endswith(" T=4096")]
    named = [s for name, s in setups.items() if name.split(" T=")[0].endswith(" by partials")]
    assert named and all(s.partials and s.block and s.route is None and
                         s.tuning["block_kernels"].sums == "partials" for s in named)
    # Partial sums are the GPU's default: every block case but the atomics' checks them bitwise.
    for name, s in setups.items():
        assert s.partials == (s.block and not name.endswith(" by atomics")), name
    assert any(s.packed and s.partials for s in setups.values()) and any(s.shard and s.partials
                                                                         for s in setups.values())
    # No two cases run the same kernels on a Hopper GPU: Mosaic GPU by name only where "auto" does not take it.
    mosaic_named = {(c[0], c[1], c[3].replace(" via mosaic_gpu", "")) for c in gpu_gate.matrix(full=False)
                    if isinstance(c[3], str) and " via mosaic_gpu" in c[3]}
    defaults = {(c[0], c[1], c[3]) for c in gpu_gate.matrix(full=False)}
    assert mosaic_named and not mosaic_named & defaults, mosaic_named & defaults
    assert long and all(s.T == 4096 and (s.route == "mosaic_gpu" or s.packed or s.partials) for s in long)
    walks = {name: s.tuning["block_kernels"].walk for name, s in setups.items() if " walk " in name}
    assert set(walks.values()) == {"pallas_triton", "mosaic_gpu"}
    assert all(setups[name].partials for name in walks)
    sums = [s for name, s in setups.items() if " sums mosaic_gpu " in name]
    assert sums and all(s.partials and s.tuning["block_kernels"].sum_kernel == "mosaic_gpu" for s in sums)
    atomics = [s for name, s in setups.items() if name.endswith(" by atomics")]
    assert atomics and all(s.tuning["block_kernels"].sums == "atomics" for s in atomics)
    packed = [s for name, s in setups.items() if " block " in name and " packed" in name]
    assert packed and all(s.packed and s.block and s.config.block_source in ("first", "previous") for s in packed)
    assert {s.packed for s in packed} == {2, 8}  # " packed 8": eight documents
    shards = [s for name, s in setups.items()
              if name.split(" T=")[0].endswith(" shard") or " shard via " in name or " shard by " in name]
    assert shards and all(s.shard and s.block and not s.packed and s.T % 32 == 0 for s in shards)
    for name, s in setups.items():
        length = name.rsplit(" T=", 1)
        assert s.T == (int(length[1]) if len(length) == 2 else gpu_gate.GATE_T)
        assert s.shard == (s in shards)
        assert (" via " in name) == (s.route is not None) and s.block == (" block " in name)
        if s.block:
            assert s.config.selection_block == 16 and s.config.block_source in ("first", "previous")
        else:
            assert s.config.selection_block == 1  # per query, named
    # The two-device cases: named apart, and taken by the block gate's `--only`.
    devices = {gpu_gate.case_name("devices", c, 0) for c in gpu_gate.DEVICE_CASES}
    assert len(devices) == len(gpu_gate.DEVICE_CASES) and all(re.search("block", n) for n in devices)
    # "block first" cases are HTreeConfig()'s selection, at every GQA shape class of the gate
    default = {c[0] for c in gpu_gate.matrix(full=True) if c[3] == "block first"
               and gpu_gate.case_setup(c[0], c[2], c[3]).config == HTreeConfig(top_k=8, selection=c[2],
                                                                                rope_dim=c[0][3])}
    assert default >= {shape for shape in gpu_gate.GQA_SHAPES if shape[3] is None}
