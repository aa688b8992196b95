"""Block selection's kernels (SPEC 12, `pallas_kernels.block`, interpreted) against the
JAX reference with the same option: selections equal, outputs, gradients and the
importance export to the dtype's tolerance, on multi-layer trees, both sources, both
rules, ragged lengths, padded heads, partial RoPE, a group split over several programs
of one block, and SPEC 10's NaN rows; the one-launch decode step inside a block
(`pallas_kernels.decode.kept`) against the decode walk keeping the same selection; and
each launch shape lowered to Triton for a Hopper GPU (what interpret mode cannot see,
short of compiling)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from htree_jax import DecodeBlockSizes, HTreeConfig, build_tree, htree_attention
from htree_jax.backends import attend
from htree_jax.core.blocks import block_rows
from htree_jax.core.tree import CacheTree
from pallas_kernels.block.backward import block_backward_pallas
from pallas_kernels.block.forward import block_forward_pallas
from pallas_kernels.block.merge import block_queries
from pallas_kernels.decode.kept import kept_merge_dims, kept_step_pallas
from pallas_kernels.decode.walk import attend_cache_pallas
from pallas_kernels.shared.kernels import BlockKernels
from tests.conftest import random_qkv

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def block_config(r, top_k, source, selection, **kw):
    return HTreeConfig(compression_rate=r, top_k=top_k, selection=selection, selection_block=r, block_source=source,
                       **kw)


def relative(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def inputs(rng, B, T, H, H_kv, K, V, dtype):
    return tuple(jnp.asarray(x, dtype) for x in random_qkv(rng, B, T, H, H_kv, K, V))


# (source, selection, r, top_k, T, H, H_kv, K, V, rope_dim, dtype): 3+ layers each.
CASES = [
    ("first", "bound", 4, 4, 150, 4, 2, 32, 32, None, jnp.float32),
    ("previous", "mean", 4, 4, 150, 8, 2, 64, 32, None, jnp.float32),
    ("first", "mean", 8, 2, 257, 3, 1, 48, 40, None, jnp.float32),  # T ragged; G, K, V padded
    ("previous", "bound", 4, 8, 200, 4, 1, 32, 32, None, jnp.bfloat16),
    ("first", "bound", 4, 4, 150, 4, 2, 64, 64, 32, jnp.float32),  # partial RoPE
    ("first", "bound", 4, 4, 90, 64, 1, 32, 32, None, jnp.float32),  # 64 heads: two programs a block
]


@pytest.mark.parametrize("source, selection, r, top_k, T, H, H_kv, K, V, rope_dim, dtype", CASES)
def test_forward_matches_the_reference(rng, source, selection, r, top_k, T, H, H_kv, K, V, rope_dim, dtype):
    config = block_config(r, top_k, source, selection, rope_dim=rope_dim)
    assert config.num_layers(T) >= 3
    q, k, v = inputs(rng, 2, T, H, H_kv, K, V, dtype)
    o, sel, imp = htree_attention(q, k, v, config, backend="pallas_interpret", return_selected=True,
                                  return_importance=True)
    o_ref, sel_ref, imp_ref = htree_attention(q, k, v, config, backend="reference", return_selected=True,
                                              return_importance=True)
    for a, b in zip(sel, sel_ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert relative(o, o_ref) < TOLERANCE[dtype]
    for a, b in zip(imp, imp_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("H, H_kv", [(128, 1), (96, 2)])
def test_groups_up_to_128_heads_take_the_block_kernels(rng, H, H_kv):
    """Block selection's kernels at the per-query kernels' widest groups (issue 84): 128
    heads a kv head (one query a program) and 48 (padded to 64), against the reference."""
    config = block_config(4, 4, "first", "bound")
    q, k, v = inputs(rng, 1, 150, H, H_kv, 32, 32, jnp.float32)
    o, sel = htree_attention(q, k, v, config, backend="pallas_interpret", return_selected=True)
    o_ref, sel_ref = htree_attention(q, k, v, config, backend="reference", return_selected=True)
    for a, b in zip(sel, sel_ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert relative(o, o_ref) < TOLERANCE[jnp.float32]


def test_a_group_of_64_heads_takes_two_programs_a_block():
    assert block_queries(4, 64, 64) == 2 and block_queries(16, 8, 128) == 16 and block_queries(16, 8, 256) == 8


@pytest.mark.parametrize("source, selection", [("first", "bound"), ("previous", "mean")])
def test_gradients_match_the_reference(rng, source, selection):
    config = block_config(4, 4, source, selection)
    q, k, v = inputs(rng, 1, 150, 8, 2, 32, 32, jnp.float32)
    weights = jnp.asarray(rng.standard_normal((1, 150, 8, 32)), jnp.float32)

    def grads(backend):
        loss = lambda q, k, v: jnp.sum(htree_attention(q, k, v, config, backend=backend) * weights)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    for name, a, b in zip("qkv", grads("pallas_interpret"), grads("reference")):
        assert relative(a, b) < 1e-5, name


def test_a_nan_key_poisons_the_rows_the_reference_poisons(rng):
    config = block_config(4, 4, "first", "bound")
    q, k, v = inputs(rng, 1, 150, 4, 2, 32, 32, jnp.float32)
    k = k.at[0, 77, 1, 3].set(jnp.nan)
    nan_rows = lambda backend: np.isnan(np.asarray(htree_attention(q, k, v, config, backend=backend))).any(-1)
    rows = nan_rows("pallas_interpret")
    np.testing.assert_array_equal(rows, nan_rows("reference"))
    assert rows[0, 77:].any() and not rows[0, :77].any()


def hopper():
    """An abstract H200 for lowering without one (jax 0.12 asks for it; 0.10 takes it)."""
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device))


# (H, H_kv, K, V, dtype): the benchmark's rows (128 a program), float32's exact dots,
# the widest heads (64 rows a program), a group of 16 (one program a block of 8 queries).
LOWERED = [(32, 4, 128, 128, jnp.bfloat16), (8, 1, 128, 128, jnp.float32), (8, 1, 256, 256, jnp.bfloat16),
           (16, 1, 192, 192, jnp.float16)]


@pytest.mark.parametrize("H, H_kv, K, V, dtype", LOWERED)
def test_the_block_kernels_lower_to_triton(H, H_kv, K, V, dtype):
    """Interpret mode cannot see a lowering fault: each block launch (forward, and the
    backward with each `BlockKernels.sums`: the atomics' one launches the walk, the
    partials' one the walk and a sum a layer) lowered to Triton for a Hopper GPU, here on the CPU
    (`lowering_platforms`; it does not compile to PTX: shared memory and registers are
    the GPU gate's)."""
    T, config = 4096, HTreeConfig(top_k=8, selection_block=16)
    q = jax.ShapeDtypeStruct((1, T, H, K), dtype)
    k = jax.ShapeDtypeStruct((1, T, H_kv, K), dtype)
    v = jax.ShapeDtypeStruct((1, T, H_kv, V), dtype)
    o, lse = jax.ShapeDtypeStruct((1, T, H, V), dtype), jax.ShapeDtypeStruct((1, T, H), jnp.float32)
    blocks = [jax.ShapeDtypeStruct((1, T // 16, H_kv, 8), jnp.int32)] * (config.num_layers(T) - 1)
    assert config.num_layers(T) == 3
    with hopper():
        forward = jax.jit(lambda q, k, v, s: block_forward_pallas(q, k, v, s, config=config)).trace(q, k, v, blocks)
        backward = [jax.jit(lambda q, k, v, o, lse, s, kernels=kernels: block_backward_pallas(
            q, k, v, o, lse, o, s, config=config, kernels=kernels)).trace(q, k, v, o, lse, blocks)
            for kernels in (BlockKernels(), BlockKernels(sums="partials"))]
        for traced in (forward, *backward):
            text = traced.lower(lowering_platforms=("cuda",)).as_text()
            assert "triton" in text


# (r, top_k, T, G, H_kv, K, V, span, dtype): 3+ layers each; `span` below the buffer
# gives several tiles a layer and several splits (`target_programs`).
KEPT_CASES = [(4, 4, 150, 2, 2, 32, 32, 16, jnp.float32), (2, 32, 600, 4, 1, 64, 32, 16, jnp.float32),
              (16, 8, 2100, 16, 1, 128, 128, 64, jnp.bfloat16), (4, 32, 1200, 1, 2, 32, 64, 16, jnp.bfloat16)]


@pytest.mark.parametrize("r, top_k, T, G, H_kv, K, V, span, dtype", KEPT_CASES)
def test_the_one_launch_decode_step_matches_the_walk(rng, r, top_k, T, G, H_kv, K, V, span, dtype):
    """`kept_step_pallas` (a token inside its block keeping the cache's selection, one
    launch) against the decode walk keeping the same selection (`attend_cache_pallas(...,
    chosen=)`), both interpreted, rows at ragged positions (a layer's edges included)
    over a cache's tree of random tokens, the selection a walk of random ranking rows
    made at each row's block start."""
    config = HTreeConfig(compression_rate=r, top_k=top_k, selection_block=r, selection="mean")
    assert config.num_layers(T) >= 3
    B, H = 3, G * H_kv
    _, k, v = random_qkv(rng, B, T, H, H_kv, K, V)
    layers = build_tree(jnp.asarray(k, dtype), jnp.asarray(v, dtype), config)
    keys, values = tuple(kl for kl, _ in layers), tuple(vl for _, vl in layers)
    positions = jnp.asarray([T - 1, r ** 2 + 1, T // 2 + r - 1], jnp.int32)
    sizes = DecodeBlockSizes(span=span, target_programs=64)
    q = jnp.asarray(rng.standard_normal((B, 1, H, K)), dtype)
    ranking = jnp.asarray(rng.standard_normal((B, 1, H, K)), dtype)
    starts = (positions - positions % r)[:, None]
    tree = CacheTree(keys, values)
    _, kept = attend_cache_pallas(ranking, tree, starts, config, block_sizes=sizes, interpret=True)
    want, _ = attend_cache_pallas(q, tree, positions[:, None], config, block_sizes=sizes, interpret=True,
                                  zero_unmerged=False, chosen=tuple(kept))
    assert kept_merge_dims(config, G, K, V, dtype, False, False)
    got = kept_step_pallas(q[:, 0], keys, values, positions, tuple(x[:, 0] for x in kept), config, sizes,
                           interpret=True)
    assert relative(got, want[:, 0]) <= TOLERANCE[dtype], relative(got, want[:, 0])


@pytest.mark.parametrize("G, K, V, dtype", [(8, 128, 128, jnp.bfloat16), (16, 256, 256, jnp.float32),
                                            (1, 32, 32, jnp.float16)])
def test_the_one_launch_decode_step_lowers_to_triton(G, K, V, dtype):
    """`kept_step_pallas` lowered to Triton for a Hopper GPU on the CPU (as above)."""
    T, B, H_kv = 131072, 8, 4
    config = HTreeConfig(top_k=512, selection_block=16)
    sizes = config.layer_sizes(T)
    keys = tuple(jax.ShapeDtypeStruct((B, n, H_kv, K), dtype) for n in sizes)
    values = tuple(jax.ShapeDtypeStruct((B, n, H_kv, V), dtype) for n in sizes)
    kept = tuple(jax.ShapeDtypeStruct((B, H_kv, 512), jnp.int32) for _ in sizes[1:])
    q = jax.ShapeDtypeStruct((B, G * H_kv, K), dtype)
    positions = jax.ShapeDtypeStruct((B,), jnp.int32)
    with hopper():
        traced = jax.jit(lambda *a: kept_step_pallas(*a, config)).trace(q, keys, values, positions, kept)
        assert "triton" in traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("source, T, S", [("first", 160, 40), ("previous", 144, 48)])
def test_context_shards_on_the_kernels_equal_the_whole_sequence(rng, source, T, S):
    """A context shard (its queries at positions `offset ..`, every token's keys, its
    ranking rows from the shard before: `sharding.shard_rank_rows`) on the block kernels
    interpreted: outputs and selections those of the whole sequence's rows, `dq` its
    rows', and the shards' `dk`, `dv` summed the whole sequence's (3 layers)."""
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=4, block_source=source)
    B, H, H_kv, K = 2, 4, 2, 32
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, B, T, H, H_kv, K, K))
    w = jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.float32)
    assert config.num_layers(T) == 3

    def whole(q, k, v):
        o, selected = attend(q, k, v, config, "pallas_interpret")
        return jnp.sum(o * w), (o, selected)

    (_, (o, selected)), grads = jax.value_and_grad(whole, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    q5 = q.reshape(B, T, H_kv, H // H_kv, K)
    dq, dk, dv = [], 0.0, 0.0
    for start in range(0, T, S):
        positions = jnp.arange(start, start + S, dtype=jnp.int32)
        rows = block_rows(q5, positions, jnp.broadcast_to(positions, (B, S)), config)  # every query before it

        def shard(q_s, k, v, positions=positions, rows=rows, start=start):
            o_s, sel_s = attend(q_s, k, v, config, "pallas_interpret", positions=positions, rank_rows=rows)
            return jnp.sum(o_s * w[:, start:start + S]), (o_s, sel_s)

        (_, (o_s, sel_s)), (dq_s, dk_s, dv_s) = jax.value_and_grad(shard, argnums=(0, 1, 2), has_aux=True)(
            q[:, start:start + S], k, v)
        np.testing.assert_allclose(np.asarray(o_s), np.asarray(o[:, start:start + S]), rtol=1e-5, atol=1e-5)
        for got, want in zip(sel_s, selected):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want[:, start:start + S]))
        dq.append(dq_s)
        dk, dv = dk + dk_s, dv + dv_s
    for name, got, want in zip("qkv", (jnp.concatenate(dq, axis=1), dk, dv), grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5, err_msg=f"d{name}")
