"""The block backward's walk on Mosaic GPU (`pallas_kernels.block.mosaic_backward`,
`BlockKernels(walk=...)`): CI has no GPU and Mosaic GPU has no interpret mode
for WGMMA, so here it is lowered for CUDA at each shape class (what Mosaic GPU checks
before the GPU compiler: layouts, shared memory, copies), its refusals are checked by
name, and the pieces around it that run in XLA or Pallas-Triton (the partial sums'
turn back by buffer position, the rows' layout) run against their definitions. The
kernel itself runs in the GPU gate (`tools/gpu_gate.py`, the ` walk mosaic_gpu` and
` by partials` cases), against the reference and bitwise twice."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from htree_jax import HTreeConfig
from htree_jax.backends import blocks_of
from pallas_kernels.block.backward import block_backward_pallas, chosen_sum, chosen_walk
from pallas_kernels.block.forward import block_static
from pallas_kernels.block.layout import table_positions
from pallas_kernels.block.inverted import inverted_index
from pallas_kernels.block.merge import BlockLaunch, rope_tables, rotate_halves
from pallas_kernels.block.mosaic_backward import TILE, BackwardPipeline, block_backward_mosaic, check_mosaic_backward_dims
from pallas_kernels.block.mosaic_merge import from_program_layout, program_layout
from pallas_kernels.block.mosaic_sums import check_mosaic_sum_dims, ring_stages
from pallas_kernels.block.partials import SumLaunch, chunk_bounds, entry_keys, range_lanes, slab_widths, sum_partials
from pallas_kernels.shared.configs import BlockConfig
from pallas_kernels.shared.kernels import BlockKernels
from tests.test_block_kernels import block_config, hopper, inputs
from tests.test_block_routes import LOWERS_FOR_CUDA

MOSAIC = BlockKernels(sums="partials", walk="mosaic_gpu")


def relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# (r, top_k, T, H, H_kv, K, V, dtype, budget): the benchmark's rows over three layers in
# several chunks; four layers at r = 8; two programs a block (G = 16) in float16; padded
# head dims (96); one layer (nothing refined, no lists).
LOWERED = [(16, 8, 4096, 32, 4, 128, 128, jnp.bfloat16, 1 << 22), (8, 8, 1500, 8, 2, 128, 128, jnp.bfloat16, 1 << 34),
           (16, 8, 2048, 16, 1, 128, 128, jnp.float16, 1 << 34), (16, 8, 600, 8, 2, 96, 96, jnp.bfloat16, 1 << 34),
           (64, 4, 300, 2, 1, 128, 128, jnp.bfloat16, 1 << 34)]


@pytest.mark.skipif(not LOWERS_FOR_CUDA, reason="Mosaic GPU lowers without a GPU from jax 0.11 on")
@pytest.mark.parametrize("sums", ["pallas_triton", "mosaic_gpu"])
@pytest.mark.parametrize("r, top_k, T, H, H_kv, K, V, dtype, budget", LOWERED)
def test_the_mosaic_backward_lowers_on_the_cpu(r, top_k, T, H, H_kv, K, V, dtype, budget, sums):
    """The walk, then the sums by node on either kernel (`BlockKernels.sum_kernel`)."""
    config = HTreeConfig(compression_rate=r, top_k=top_k, selection_block=r)
    q = jax.ShapeDtypeStruct((1, T, H, K), dtype)
    k = jax.ShapeDtypeStruct((1, T, H_kv, K), dtype)
    v = jax.ShapeDtypeStruct((1, T, H_kv, V), dtype)
    o, lse = jax.ShapeDtypeStruct((1, T, H, V), dtype), jax.ShapeDtypeStruct((1, T, H), jnp.float32)
    blocks = [jax.ShapeDtypeStruct((1, -(-T // r), H_kv, top_k), jnp.int32)] * (config.num_layers(T) - 1)
    block = BlockConfig(backward_partial_bytes=budget)
    kernels = BlockKernels(sums="partials", walk="mosaic_gpu", sum_kernel=sums)
    grads = jax.jit(lambda q, k, v, o, lse, s: block_backward_pallas(q, k, v, o, lse, o, s, config=config,
                                                                      block=block, kernels=kernels))
    dq, dk, dv = jax.eval_shape(grads, q, k, v, o, lse, blocks)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    with hopper():
        text = grads.trace(q, k, v, o, lse, blocks).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and ("triton" in text) == (sums == "pallas_triton")


@pytest.mark.skipif(not LOWERS_FOR_CUDA, reason="Mosaic GPU lowers without a GPU from jax 0.11 on")
@pytest.mark.parametrize("packed, shard", [(True, False), (False, True)])
def test_the_mosaic_walk_of_packed_rows_and_of_a_shard_lowers_on_the_cpu(packed, shard):
    """The walk's own inputs for packed rows (`firsts`: the top layer from the
    document's first node) and a context shard (`offset`)."""
    r, T, G, H_kv = 16, 4096, 8, 2
    config = HTreeConfig(compression_rate=r, top_k=8, selection_block=r)
    st = block_static(config, T, G, 128, 128, jnp.bfloat16, TILE)
    q5 = jax.ShapeDtypeStruct((1, T, H_kv, G, 128), jnp.bfloat16)
    vec = jax.ShapeDtypeStruct((1, T, H_kv, G), jnp.float32)
    layers = []
    for n in config.layer_sizes(T):
        layers += [jax.ShapeDtypeStruct((1, H_kv, max(16, 1 << (n - 1).bit_length()), 128), jnp.bfloat16)] * 2
    sel = [jax.ShapeDtypeStruct((1, T // r, H_kv, st.width), jnp.int32)] * (st.num_layers - 1)
    rows = table_positions(config, T, st)
    nodes = tuple(config.layer_sizes(T))
    extra = jax.ShapeDtypeStruct((1, T // r), jnp.int32) if packed else jax.ShapeDtypeStruct((), jnp.int32)

    def walk(q5, do5, lse, delta, layers, sel, extra):
        more = dict(firsts=extra) if packed else dict(offset=extra)
        launch = BlockLaunch(config, st, 128, rows, nodes, widths=slab_widths(nodes, rows, st))
        return block_backward_mosaic((q5, do5, lse, delta), layers, sel, launch, **more)

    f = jax.jit(walk)
    dq5, slabs, ranges = jax.eval_shape(f, q5, q5, vec, vec, layers, sel, extra)
    assert dq5.shape == q5.shape and dq5.dtype == jnp.float32 and len(slabs) == 2 * st.num_layers
    assert ranges.shape == (1, H_kv, T // st.queries, range_lanes(st.num_layers))
    assert "mosaic_gpu" in f.trace(q5, q5, vec, vec, layers, sel, extra).lower(lowering_platforms=("cuda",)).as_text()


def test_the_walk_is_chosen_by_name_and_refused_where_it_cannot_run():
    config = HTreeConfig(top_k=8, selection_block=16)
    st = block_static(config, 4096, 8, 128, 128, jnp.bfloat16, TILE)
    rows = table_positions(config, 4096, st)
    # Interpreted, "auto" sums by atomics and walks on Pallas-Triton; on a GPU, from partials.
    assert chosen_sum(BlockKernels(), interpret=True) == "atomics"
    assert chosen_sum(BlockKernels(), interpret=False) == "partials"
    assert chosen_walk(BlockKernels(), st, 128, 128, jnp.bfloat16, rows, interpret=True) == "pallas_triton"
    assert chosen_walk(BlockKernels(sums="atomics"), st, 128, 128, jnp.bfloat16, rows, False) == "pallas_triton"
    with pytest.raises(ValueError, match="no interpret mode"):
        chosen_walk(MOSAIC, st, 128, 128, jnp.bfloat16, rows, interpret=True)
    with pytest.raises(ValueError, match="BlockKernels.walk must be one of"):
        BlockKernels(walk="cuda")
    with pytest.raises(ValueError, match="takes sums='partials'"):
        BlockKernels(sums="atomics", walk="mosaic_gpu")
    with pytest.raises(ValueError, match="BlockKernels.sum_kernel must be"):
        BlockKernels(sum_kernel="xla")
    with pytest.raises(ValueError, match="take|sums the Mosaic GPU walk's slabs"):
        check_mosaic_sum_dims(4, 128, 128, 64, 4)
    with pytest.raises(ValueError, match="ranges within shared memory"):
        check_mosaic_sum_dims(16, 128, 128, 1 << 14, 4)
    assert ring_stages(16, 1024) == 4 and ring_stages(64, 1024) == 2
    for dtype, K, V, rule in ((jnp.float32, 128, 128, "bfloat16 or float16"), (jnp.bfloat16, 256, 256, "K in 66..128"),
                              (jnp.bfloat16, 64, 64, "K in 66..128")):
        with pytest.raises(ValueError, match=rule):
            check_mosaic_backward_dims(block_static(config, 4096, 8, K, V, dtype, TILE), K, V, dtype, rows)
    wide = HTreeConfig(top_k=4096, selection_block=16)  # its lists and bitmaps pass shared memory
    st_wide = block_static(wide, 1 << 20, 8, 128, 128, jnp.bfloat16, TILE)
    with pytest.raises(ValueError, match="shared memory"):
        check_mosaic_backward_dims(st_wide, 128, 128, jnp.bfloat16, table_positions(wide, 1 << 20, st_wide))
    small = HTreeConfig(compression_rate=4, top_k=8, selection_block=4)
    with pytest.raises(ValueError, match="compression_rate 8, 16, 32 or 64"):
        check_mosaic_backward_dims(block_static(small, 600, 8, 128, 128, jnp.bfloat16, TILE), 128, 128,
                                   jnp.bfloat16, 256)
    # The Mosaic GPU sums take the Mosaic GPU walk's slabs only: interpreted, a clear error.
    config4 = block_config(4, 4, "first", "bound")
    q, k, v = inputs(np.random.default_rng(0), 1, 150, 4, 2, 32, 32, jnp.float32)
    blocks = blocks_of(q, k, v, config4, impl="pallas_interpret")
    with pytest.raises(ValueError, match="sums the Mosaic GPU walk's slabs"):
        block_backward_pallas(q, k, v, q, q[..., 0], q, blocks, config=config4, interpret=True,
                              kernels=BlockKernels(sums="partials", sum_kernel="mosaic_gpu"))
    for bad in (dict(stages=1), dict(consumer_registers=208, memory_registers=96), dict(consumer_registers=160),
                dict(memory_registers=172, consumer_registers=168)):
        with pytest.raises(ValueError, match="BackwardPipeline"):
            BackwardPipeline(**bad)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_partials_of_keys_turned_by_position_are_turned_back_when_summed(rng, dtype):
    """`sum_partials(..., tables=)`, the sums of the Mosaic GPU walk's slabs (each `dk`
    the gradient of its key turned by its buffer position): slabs turned by position
    sum to what the unturned slabs sum to without tables (float32 sums of any dtype)."""
    config = block_config(4, 4, "first", "bound")
    q, k, v = inputs(rng, 1, 150, 8, 2, 32, 32, jnp.float32)
    selections = blocks_of(q, k, v, config, impl="pallas_interpret")
    L, NB = config.num_layers(150), selections[0].shape[1]
    sizes = tuple(config.layer_sizes(150))
    index = inverted_index(selections, r=4, b=4, T=150, num_layers=L, layer_sizes=sizes)
    st = block_static(config, 150, 4, 32, 32, jnp.float32)
    width = 64
    cos, sin = rope_tables(config, 32, width, st)
    pk = jnp.asarray(rng.standard_normal((1, 2, NB * width, 32)), dtype)
    pv = jnp.asarray(rng.standard_normal((1, 2, NB * width, 32)), dtype)
    ranges = jnp.zeros((1, 2, NB, range_lanes(L)), jnp.int32).at[..., 1::2].set(width)
    pos = jnp.arange(NB * width) % width
    lo, hi = rotate_halves(pk[..., :16].astype(jnp.float32), pk[..., 16:].astype(jnp.float32), cos[pos], sin[pos])
    turned = jnp.concatenate([lo, hi], -1)
    first = jnp.zeros((16,), jnp.int32)
    for l, ix in enumerate(index):
        U = ix.offsets.shape[-1] - 1
        bounds = chunk_bounds(entry_keys(ix, NB), U, NB, 0, NB)
        launch = SumLaunch(r=4, width=width, per_block=1, layer=l, interpret=True)
        want = sum_partials(first, bounds, ix, ranges, (pk.astype(jnp.float32), pv), launch=launch)
        got = sum_partials(first, bounds, ix, ranges, (turned, pv), launch=launch, tables=(cos, sin))
        for a, b in zip(got, want):
            assert relative(a, b) < 1e-5


def test_the_program_layout_round_trips():
    """`program_layout` (a program's rows together, padded) and `from_program_layout`,
    with leading axes and trailing ones, at one and at two programs a block."""
    config = HTreeConfig(compression_rate=16, top_k=8, selection_block=16)
    for G in (8, 16):
        st = block_static(config, 4096, G, 128, 128, jnp.bfloat16, TILE)
        x = jnp.arange(2 * 1 * 64 * 2 * G * 3, dtype=jnp.float32).reshape(2, 1, 64, 2, G, 3)
        laid = program_layout(x, st, 128, lead=1)
        assert laid.shape == (2, 1, 64 // st.queries, 2, 128, 3)
        np.testing.assert_array_equal(laid[:, :, 1, 0, :G, 0], x[:, :, st.queries, 0, :, 0])  # program 1's first query
        np.testing.assert_array_equal(from_program_layout(laid, st, G, lead=1), x)
