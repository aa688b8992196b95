"""The block merge's route off Pallas-Triton, Mosaic GPU (`BlockKernels.merge`,
`docs/backends.md`): it is checked before any kernel runs (a clear error naming the
rule), and on a GPU it equals the Pallas-Triton kernel on fresh inputs.
The GPU's own checks are the gate's `via` cases (`tools/gpu_gate.py`); the ones
here run where a GPU is (CI has none: they skip there, and say so)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from htree_jax import HTreeConfig, htree_attention
from pallas_kernels.block.forward import merge_static
from pallas_kernels.block.layout import table_positions
from pallas_kernels.block.merge import BlockLaunch, rope_tables, rotate_back, rotate_halves
from pallas_kernels.block.mosaic_merge import (NARROW_PIPELINE, PIPELINE, Pipeline, block_merge_mosaic, check_mosaic_dims,
                                              count_entries, earlier_bits, refined_bitmaps, turned_keys,
                                              with_firsts, with_offset)
from pallas_kernels.shared.configs import KernelConfigs
from pallas_kernels.shared.kernels import BlockKernels
from tests.conftest import random_qkv
from tools.probes import block_backward_blocks, block_backward_ladder, block_merge_pipelines

GPU = jax.default_backend() == "gpu"


def test_an_unknown_route_is_refused_by_name():
    with pytest.raises(ValueError, match="BlockKernels.merge must be .auto. or one of"):
        BlockKernels(merge="cuda")
    q = jnp.ones((1, 64, 4, 64), jnp.float32)
    with pytest.raises(TypeError, match="block_kernels must be an htree_jax.BlockKernels"):
        htree_attention(q, q[:, :, :2], q[:, :, :2], backend="pallas_interpret", block_kernels="mosaic_gpu")


@pytest.mark.parametrize("route", ["mosaic_gpu"])
def test_routes_off_pallas_triton_refuse_interpret_mode_before_any_kernel(route):
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=4)
    q = jnp.ones((1, 64, 4, 64), jnp.float32)
    k = jnp.ones((1, 64, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="has no interpret mode"):
        htree_attention(q, k, k, config, backend="pallas_interpret", block_kernels=BlockKernels(merge=route))


def test_the_mosaic_route_names_each_rule_it_refuses():
    check_mosaic_dims(16, 128, 128, 128, jnp.bfloat16)
    with pytest.raises(ValueError) as e:
        check_mosaic_dims(4, 256, 256, 32, jnp.float32)
    text = str(e.value)
    for rule in ("bfloat16 or float16", "compression_rate 8, 16, 32 or 64", "at most 128 rows",
                 "K / 2 of 32 or 64", "BlockKernels(merge='pallas_triton')"):
        assert rule in text


# (r, top_k, T, H, H_kv, K, V, dtype, source, routes)
GPU_CASES = [(16, 8, 4096, 32, 4, 128, 128, jnp.bfloat16, "first", ("mosaic_gpu",)),
             (16, 32, 3000, 8, 1, 128, 128, jnp.bfloat16, "previous", ("mosaic_gpu",)),
             (8, 8, 1500, 8, 2, 64, 128, jnp.float16, "first", ("mosaic_gpu",))]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="the routes off Pallas-Triton run on a CUDA GPU only (no interpret mode)")
@pytest.mark.parametrize("r, top_k, T, H, H_kv, K, V, dtype, source, routes", GPU_CASES)
def test_each_route_equals_the_pallas_triton_merge(rng, r, top_k, T, H, H_kv, K, V, dtype, source, routes):
    config = HTreeConfig(compression_rate=r, top_k=top_k, selection_block=r, block_source=source)
    q, k, v = (jnp.asarray(x, dtype) for x in random_qkv(rng, 1, T, H, H_kv, K, V))
    base = np.asarray(htree_attention(q, k, v, config, backend="pallas"), np.float64)
    for route in routes:
        o = np.asarray(htree_attention(q, k, v, config, backend="pallas", block_kernels=BlockKernels(merge=route)),
                       np.float64)
        error = np.linalg.norm(o - base) / np.linalg.norm(base)
        assert error < (1e-5 if dtype == jnp.float32 else 1e-2), (route, error)


def test_the_mosaic_merge_layouts_refuse_what_they_cannot_hold():
    for bad in (dict(tile=32), dict(stages=1), dict(consumer_registers=232, memory_registers=64),
                dict(consumer_registers=180), dict(ablate="lists"), dict(tile=128),
                dict(turn="queries", consumer_registers=168, memory_registers=40, rotator_registers=128)):
        with pytest.raises(ValueError, match="Pipeline"):
            Pipeline(**bad)


# Mosaic GPU lowers a kernel to its GPU module in Python, with no GPU, from jax 0.11 on
# (0.10's refuses the 16-byte copy of the parent counts); compiling it needs the GPU.
LOWERS_FOR_CUDA = tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 11)
EVERY_LAYOUT = (PIPELINE, NARROW_PIPELINE, dataclasses.replace(NARROW_PIPELINE, hold_rows=False),
                dataclasses.replace(PIPELINE, hold_rows=True),
                Pipeline(tile=64, stages=4, consumer_registers=168, memory_registers=40, rotator_registers=128),
                Pipeline(tile=128, stages=2, consumer_registers=176, memory_registers=40, rotator_registers=120),
                Pipeline(tile=64, stages=2), dataclasses.replace(PIPELINE, absolute_top=False),
                dataclasses.replace(NARROW_PIPELINE, absolute_top=False))
BENCHMARK_SHAPE = (16, 512, 131072, 8, 4, 128, 128, jnp.bfloat16)


def mosaic_merge_abstract(r, top_k, T, G, H_kv, K, V, dtype, pipe):
    """The Mosaic GPU merge at a shape, jitted, and its abstract arguments."""
    config = HTreeConfig(compression_rate=r, top_k=top_k, selection_block=r)
    st = merge_static(config, T, G, K, V, dtype, KernelConfigs().block, "mosaic_gpu")
    Tp = -(-T // r) * r
    q5 = jax.ShapeDtypeStruct((1, Tp, H_kv, st.group, 2 * st.half), dtype)
    layers = []
    for n in config.layer_sizes(T):
        n_p = max(16, 1 << (n - 1).bit_length())
        layers += [jax.ShapeDtypeStruct((1, H_kv, n_p, 2 * st.half), dtype),
                   jax.ShapeDtypeStruct((1, H_kv, n_p, st.vp), dtype)]
    sel = [jax.ShapeDtypeStruct((1, Tp // r, H_kv, st.width), jnp.int32)] * (st.num_layers - 1)
    launch = BlockLaunch(config, st, K, table_positions(config, T, st))
    merge = jax.jit(lambda q5, layers, sel: block_merge_mosaic(q5, layers, sel, launch, pipe=pipe))
    return merge, (q5, layers, sel), st


@pytest.mark.parametrize("shape, pipes", [
    (BENCHMARK_SHAPE, EVERY_LAYOUT),  # 3 layers, two consumers
    ((8, 8, 1500, 4, 2, 64, 128, jnp.float16), (None,)),  # 4 layers, one consumer
    ((16, 8, 2048, 16, 1, 64, 64, jnp.float16), (None,)),  # two programs a block
    ((64, 4, 300, 1, 1, 128, 64, jnp.bfloat16), (None,)),  # one layer: no lists
])
def test_the_mosaic_merge_lowers_on_the_cpu(shape, pipes):
    """CI cannot run the Mosaic GPU kernel (no interpret mode for WGMMA); tracing it at
    each shape class catches what Python sees (shapes, barriers, layouts' arguments),
    and lowering it what Mosaic GPU checks before the GPU compiler (layouts, shared
    memory, copies)."""
    for pipe in pipes:
        merge, args, st = mosaic_merge_abstract(*shape, pipe)
        o, lse = jax.eval_shape(merge, *args)
        Tp, H_kv = args[0].shape[1:3]
        assert o.shape == (1, Tp, H_kv, st.group, st.vp) and o.dtype == shape[-1]
        assert lse.shape == (1, Tp, H_kv, st.group) and lse.dtype == jnp.float32
        if LOWERS_FOR_CUDA:
            assert "mosaic_gpu" in merge.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_a_mosaic_merge_layout_past_shared_memory_is_refused_before_it_is_built():
    deep = Pipeline(tile=128, stages=3, consumer_registers=232, memory_registers=40, turn="queries")
    merge, args, _ = mosaic_merge_abstract(*BENCHMARK_SHAPE, deep)
    with pytest.raises(ValueError, match="shared memory.*fewer stages"):
        jax.eval_shape(merge, *args)


def test_turned_keys_score_as_keys_rotated_by_their_buffer_position():
    """`Pipeline(turn="queries")`: a step's node tile `v` read from copy `v` of
    `turned_keys`, scored against rows turned back by the step's first position
    (`merge.rotate_back`), gives the scores of keys rotated by their buffer position
    (`merge.rotate_halves`, SPEC 2.2): the kernel's indexing, checked where it runs."""
    rng = np.random.default_rng(0)
    r, tile, half, n_rows = 16, 64, 8, 256
    config = HTreeConfig(compression_rate=r, top_k=8, selection_block=r)
    st = merge_static(config, 4096, 8, 2 * half, 2 * half, jnp.bfloat16, KernelConfigs().block, "mosaic_gpu")
    cos, sin = rope_tables(config, 2 * half, 1024, st)
    k_lo, k_hi = (jnp.asarray(rng.standard_normal((1, 1, n_rows, st.half)), jnp.float32) for _ in range(2))
    v = jnp.zeros((1, 1, n_rows, st.vp), jnp.float32)
    t_lo, t_hi, _ = turned_keys([k_lo, k_hi, v], cos, sin, st, tile)
    assert t_lo.shape == (tile // r, 1, 1, n_rows, st.half)
    q_lo, q_hi = (jnp.asarray(rng.standard_normal((4, st.half)), jnp.float32) for _ in range(2))  # rotated rows
    step = 3
    parents = rng.choice(n_rows // r, size=tile // r, replace=False)  # a step's node tiles, any rows
    a_lo, a_hi = rotate_back(q_lo, q_hi, cos[step * tile], sin[step * tile])
    for v_, parent in enumerate(parents):
        rows = parent * r + np.arange(r)
        p = step * tile + v_ * r + np.arange(r)  # buffer positions of the node tile
        got = a_lo @ t_lo[v_, 0, 0, rows].T + a_hi @ t_hi[v_, 0, 0, rows].T
        r_lo, r_hi = rotate_halves(k_lo[0, 0, rows], k_hi[0, 0, rows], cos[p], sin[p])
        want = q_lo @ r_lo.T + q_hi @ r_hi.T
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_top_layers_keys_at_their_buffer_positions_score_without_a_turn():
    """`Pipeline(absolute_top=True)`: the top layer's one copy of `turned_keys` holds
    node `n` rotated by `n`, its buffer position in every block, so rows that are not
    turned score as keys rotated by their position (SPEC 2.2); the lower layers keep
    their `tile / r` copies."""
    rng = np.random.default_rng(1)
    r, tile, half, n_rows = 16, 128, 8, 200
    config = HTreeConfig(compression_rate=r, top_k=8, selection_block=r)
    st = merge_static(config, 4096, 8, 2 * half, 2 * half, jnp.bfloat16, KernelConfigs().block, "mosaic_gpu")
    cos, sin = rope_tables(config, 2 * half, 256, st)
    layer = lambda n: [jnp.asarray(rng.standard_normal((1, 1, n, st.half)), jnp.float32) for _ in range(2)] + [
        jnp.zeros((1, 1, n, st.vp), jnp.float32)]
    bottom, top = layer(512), layer(n_rows)
    out = turned_keys(bottom + top, cos, sin, st, tile, absolute_top=True)
    assert out[0].shape == (tile // r, 1, 1, 512, st.half) and out[3].shape == (1, 1, 1, n_rows, st.half)
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(turned_keys(bottom, cos, sin, st, tile)[0]))
    q_lo, q_hi = (jnp.asarray(rng.standard_normal((4, st.half)), jnp.float32) for _ in range(2))
    p = np.arange(n_rows)
    r_lo, r_hi = rotate_halves(top[0][0, 0], top[1][0, 0], cos[p], sin[p])
    np.testing.assert_allclose(q_lo @ out[3][0, 0, 0].T + q_hi @ out[4][0, 0, 0].T, q_lo @ r_lo.T + q_hi @ r_hi.T,
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="absolute_top with turn='queries' only"):
        Pipeline(tile=64, stages=2, absolute_top=True)


def test_the_layout_probe_reads_every_layout_it_names(capsys):
    """`tools/probes/block_merge_pipelines.py --pipe`: each token it documents builds its
    `Pipeline` (the probe runs only on a GPU; its reading of a layout runs here)."""
    for spec in ("128,2,232,40,queries,smem", "64,4,232,40,queries,rotation", "64,4,168,40,128", "64,2,176,152",
                 "128,2,232,40,queries,smem,absolute"):
        assert block_merge_pipelines.main(["--pipe", spec]) == 0
    out = capsys.readouterr().out
    assert "hold_rows=False" in out and "ablate='rotation'" in out and "rotator_registers=128" in out
    assert "absolute_top=True" in out


def test_the_backward_probe_traces_and_lowers_each_layout_it_times():
    """`tools/probes/block_backward_ladder.py` (a GPU's): its kernel at 16, 32 and 48 keys
    a program, 2 and 3 stages, traced here to its output shapes and, where this JAX
    lowers Mosaic GPU on a CPU, lowered (shared memory, copies, WGMMA operands)."""
    rng = np.random.default_rng(0)
    for keys, stages in ((16, 2), (16, 3), (32, 2), (48, 2)):
        ins = block_backward_ladder.inputs(rng, 1, 16, 2, 8, jnp.bfloat16, R=keys)
        f = jax.jit(functools.partial(block_backward_ladder.node_grads, stages=stages))
        dk, dv = jax.eval_shape(f, *ins)
        assert dk.shape == dv.shape == (1, 2, 2, 2, 64, keys) and dk.dtype == jnp.float32
        if LOWERS_FOR_CUDA:
            assert "mosaic_gpu" in f.trace(*ins).lower(lowering_platforms=("cuda",)).as_text()


def test_the_block_major_backward_probe_traces_and_lowers_each_partial_kind():
    """`tools/probes/block_backward_blocks.py` (a GPU's): the block-major kernel with no
    partials stored, bfloat16 and float32 ones, and the sum by node of each, traced to
    their output shapes and, where this JAX lowers Mosaic GPU on a CPU, lowered (shared
    memory, copies, WGMMA operands); the sum's index against a brute-force inversion."""
    rng = np.random.default_rng(0)
    ins = block_backward_blocks.inputs(rng, 1, 4, 8, 8, jnp.bfloat16)
    lists = np.asarray(ins[-1])
    codes, counts = block_backward_blocks.inverted(lists, 2)
    for u in range(8):  # tile u's entries: (block j, slot s) with lists[0, j, s] == u, in block order
        want = [(j % 2) * 8 + s for j in range(4) for s in range(8) if lists[0, j, s] == u]
        assert int(counts[0, u, 0]) == len(want) and list(np.asarray(codes[0, u, :len(want)])) == want
    cos_t, sin_t = block_backward_blocks.angle_tables()
    for kind, n_out in (("none", 1), ("bf16", 2), ("f32", 2)):
        f = jax.jit(functools.partial(block_backward_blocks.block_grads, partials=kind, slots=2))
        outs = jax.eval_shape(f, *ins)
        assert len(outs) == n_out and outs[0].shape == (1, 4, 2, 128, 64)
        if LOWERS_FOR_CUDA:
            assert "mosaic_gpu" in f.trace(*ins).lower(lowering_platforms=("cuda",)).as_text()
        if n_out == 1:
            continue
        part = outs[1]
        assert part.shape == (1, 2, 2, 2, 2, 64, 64) and part.dtype == {"bf16": jnp.bfloat16, "f32": jnp.float32}[kind]
        g = jax.jit(block_backward_blocks.sum_by_node)
        args = (jnp.zeros(part.shape, part.dtype), codes, counts, cos_t, sin_t)
        assert jax.eval_shape(g, *args).shape == (1, 8, 2, 2, 16, 64)
        if LOWERS_FOR_CUDA:
            assert "mosaic_gpu" in g.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_packed_rows_mark_the_top_layer_before_each_document():
    """Mosaic GPU's merge starts its top layer at the step of a block's document's first
    node (`with_firsts`); within that step the positions before it are marked as the
    refined ones are, so neither is merged (`refined_bitmaps`, `earlier_bits`)."""
    firsts = jnp.asarray([[0, 1, 31, 32, 33, 70]], jnp.int32)
    bits = np.asarray(earlier_bits(firsts, 4)).astype(np.uint64)
    marked = (bits[..., None] >> np.arange(32, dtype=np.uint64)) & 1  # [1, 6, words, 32]
    want = np.arange(128)[None, None, :] < np.asarray(firsts)[..., None]
    np.testing.assert_array_equal(marked.reshape(1, 6, 128).astype(bool), want)
    config = HTreeConfig(compression_rate=4, top_k=2, selection_block=4)
    st = merge_static(config, 64, 2, 32, 32, jnp.bfloat16, KernelConfigs().block, "mosaic_gpu")
    top = jnp.asarray([[[[5, 9]]]], jnp.int32)  # one block, one kv head: the top layer refines nodes 5, 9
    below = jnp.asarray([[[[21, 38]]]], jnp.int32)
    maps = np.asarray(refined_bitmaps([top, below], st, 4, firsts=jnp.asarray([[3]], jnp.int32)))
    top_bits = (maps[0, 0, 0, 0, 0].astype(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
    assert set(np.flatnonzero(top_bits)) == {0, 1, 2, 5, 9}
    plain = np.asarray(refined_bitmaps([top, below], st, 4))
    np.testing.assert_array_equal(maps[1], plain[1])  # the layers below: unchanged


@pytest.mark.parametrize("L", [2, 3, 4, 5])
def test_packed_rows_give_the_mosaic_merge_each_blocks_first_node_after_the_counts(L):
    """`with_firsts`: each block's first top node in entry `L` of the layers' counts
    (where the kernel reads it), the counts themselves unchanged, the length doubled
    only where no entry follows the layers' (as `block_merge_mosaic` sizes its buffer)."""
    lp = max(4, 1 << (L - 1).bit_length())
    counts = jnp.arange(2 * 3 * 2 * lp, dtype=jnp.int32).reshape(2, 3, 2, lp)
    counts = jnp.where(jnp.arange(lp) < L, counts, 0)
    firsts = jnp.asarray([[0, 64, 128], [7, 9, 300]], jnp.int32)
    got = np.asarray(with_firsts(counts, firsts, L))
    assert got.shape[-1] == (2 * lp if lp <= L else lp)
    np.testing.assert_array_equal(got[..., :L], np.asarray(counts)[..., :L])
    np.testing.assert_array_equal(got[..., L], np.broadcast_to(np.asarray(firsts)[:, :, None], (2, 3, 2)))


@pytest.mark.parametrize("L", [2, 3, 4])
def test_a_context_shard_gives_the_mosaic_merge_its_offset_after_the_first_nodes(L):
    """`with_offset`: a context shard's first position in entry `L + 1` of every block's
    counts, after packed rows' first nodes (entry `L`), the counts as long as
    `count_entries` says (the kernel's buffer)."""
    lp = max(4, 1 << (L - 1).bit_length())
    counts = jnp.where(jnp.arange(lp) < L, jnp.ones((1, 3, 2, lp), jnp.int32), 0)
    got = np.asarray(with_offset(with_firsts(counts, jnp.asarray([[0, 4, 8]], jnp.int32), L), 512, L))
    assert got.shape[-1] == count_entries(L, True, True) >= L + 2
    np.testing.assert_array_equal(got[..., L + 1], 512)
    np.testing.assert_array_equal(got[0, :, 0, L], [0, 4, 8])
    np.testing.assert_array_equal(got[..., :L], 1)


@pytest.mark.skipif(not LOWERS_FOR_CUDA, reason="Mosaic GPU lowers for cuda from jax 0.11 on")
def test_the_mosaic_merge_of_a_context_shard_lowers_on_the_cpu():
    """A quarter of the benchmark shape's queries from a traced offset over every token's tree."""
    merge, (q5, layers, sel), st = mosaic_merge_abstract(*BENCHMARK_SHAPE, PIPELINE)
    config = HTreeConfig(compression_rate=16, top_k=512, selection_block=16)
    S = q5.shape[1] // 4
    q5 = jax.ShapeDtypeStruct((1, S) + q5.shape[2:], q5.dtype)
    sel = [jax.ShapeDtypeStruct((1, S // 16) + x.shape[2:], x.dtype) for x in sel]
    launch = BlockLaunch(config, st, 128, table_positions(config, BENCHMARK_SHAPE[2], st))
    shard = jax.jit(lambda q5, layers, sel, offset: block_merge_mosaic(q5, layers, sel, launch, pipe=PIPELINE,
                                                                       offset=offset))
    offset = jax.ShapeDtypeStruct((), jnp.int32)
    assert "mosaic_gpu" in shard.trace(q5, layers, sel, offset).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.skipif(not LOWERS_FOR_CUDA, reason="Mosaic GPU lowers for cuda from jax 0.11 on")
def test_the_mosaic_merge_of_packed_rows_lowers_on_the_cpu():
    merge, (q5, layers, sel), st = mosaic_merge_abstract(*BENCHMARK_SHAPE, PIPELINE)
    config = HTreeConfig(compression_rate=16, top_k=512, selection_block=16)
    firsts = jax.ShapeDtypeStruct((1, q5.shape[1] // 16), jnp.int32)
    launch = BlockLaunch(config, st, 128, table_positions(config, BENCHMARK_SHAPE[2], st))
    packed = jax.jit(lambda q5, layers, sel, f: block_merge_mosaic(q5, layers, sel, launch, pipe=PIPELINE, firsts=f))
    assert "mosaic_gpu" in packed.trace(q5, layers, sel, firsts).lower(lowering_platforms=("cuda",)).as_text()
