"""The block backward's key and value gradients from partial sums (`pallas_kernels.block.
partials`, `BlockKernels(sums="partials")`, interpreted): the chunks' index ranges,
packed rows against each document alone, context shards against the whole sequence. The
gradients against the JAX reference, against the atomics' sums in several chunks and two
calls equal bitwise: `tests/test_block_sums.py`. (Its launches are lowered to Triton
for a Hopper GPU in `tests/test_block_kernels.py`.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from htree_jax import HTreeConfig, htree_attention
from htree_jax.backends import attend, blocks_of
from htree_jax.core.blocks import block_rows
from pallas_kernels.block.inverted import inverted_index
from pallas_kernels.block.partials import chunk_blocks, chunk_bounds, entry_keys
from pallas_kernels.shared.configs import KernelConfigs
from pallas_kernels.shared.kernels import BlockKernels
from tests.test_block_kernels import block_config, inputs
from tests.conftest import random_qkv
from tests.test_packing import assert_gradients_equal_per_document, segments


PARTIALS = BlockKernels(sums="partials")


def partials_tuning(K, V, **changes):
    return KernelConfigs.resolve(None, K, V).with_changes(changes)


def test_the_chunks_cover_each_tiles_entries_once(rng):
    """A chunk's bounds (`chunk_bounds`) are the tile's index entries of the chunk's
    blocks, and the chunks of a call partition every tile's entries."""
    config = block_config(4, 4, "first", "bound")
    q, k, v = inputs(rng, 2, 150, 8, 2, 32, 32, jnp.float32)
    selections = blocks_of(q, k, v, config, impl="pallas_interpret")
    L, NB = config.num_layers(150), selections[0].shape[1]
    index = inverted_index(selections, r=4, b=4, T=150, num_layers=L, layer_sizes=tuple(config.layer_sizes(150)))
    for ix in index:
        U = ix.offsets.shape[-1] - 1
        keys = entry_keys(ix, NB)
        covered = np.zeros(ix.blocks.shape, int)
        for first in range(0, NB, 7):
            count = min(7, NB - first)
            lo, hi = (np.asarray(x) for x in chunk_bounds(keys, U, NB, first, count))
            for b in range(2):
                for h in range(2):
                    for u in range(U):
                        e = np.arange(lo[b, h, u], hi[b, h, u])
                        blocks = np.asarray(ix.blocks[b, h])[e]
                        assert np.all((blocks >= first) & (blocks < first + count))
                        assert np.all((e >= int(ix.offsets[b, h, u])) & (e < int(ix.offsets[b, h, u + 1])))
                        covered[b, h, e] += 1
        real = np.arange(ix.blocks.shape[-1])[None, None, :] < np.asarray(ix.offsets[..., -1:])
        np.testing.assert_array_equal(covered, real.astype(int))
    assert chunk_blocks(10, 2, 100, 1000) == 5 and chunk_blocks(10, 1, 100, 50) == 1 and chunk_blocks(3, 1, 1, 99) == 3


def test_packed_gradients_from_partials_equal_each_document_alone(rng):
    config = block_config(4, 4, "first", "bound")
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, 2, 150, 4, 2, 32, 32))
    w = jnp.asarray(rng.standard_normal((2, 150, 4, 32)), jnp.float32)
    rows = [[1, 20, 70, 59], [16, 2, 132]]
    seg = segments(rows)
    tuning = partials_tuning(32, 32, **{"block.backward_partial_bytes": 2 ** 21})  # several chunks
    packed = lambda q, k, v: jnp.sum(htree_attention(q, k, v, config, segment_ids=seg, max_documents=4,
                                                     backend="pallas_interpret", block_sizes=tuning,
                                                     block_kernels=PARTIALS) * w)
    assert_gradients_equal_per_document(packed, q, k, v, w, rows, config)


def test_context_shards_from_partials_equal_the_whole_sequence(rng):
    """Two context shards (`positions`, ranking rows from the shard before) with the key
    and value gradients from partials in several chunks each (a chunk's first position
    is the shard's offset plus its blocks'): `dq` the whole sequence's rows', `dk`, `dv`
    summed the whole sequence's."""
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=4)
    B, H, H_kv, K, T, S = 2, 4, 2, 32, 160, 80
    q, k, v = (jnp.asarray(x) for x in random_qkv(rng, B, T, H, H_kv, K, K))
    w = jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.float32)
    tuning = partials_tuning(K, K, **{"block.backward_partial_bytes": 2 ** 19})  # 4 chunks a shard

    def whole(q, k, v):
        return jnp.sum(attend(q, k, v, config, "pallas_interpret")[0] * w)

    grads = jax.grad(whole, argnums=(0, 1, 2))(q, k, v)
    q5 = q.reshape(B, T, H_kv, H // H_kv, K)
    dq, dk, dv = [], 0.0, 0.0
    for start in range(0, T, S):
        positions = jnp.arange(start, start + S, dtype=jnp.int32)
        rows = block_rows(q5, positions, jnp.broadcast_to(positions, (B, S)), config)

        def shard(q_s, k, v, positions=positions, rows=rows, start=start):
            o_s, _ = attend(q_s, k, v, config, "pallas_interpret", positions=positions, rank_rows=rows,
                            block_sizes=tuning, block_kernels=PARTIALS)
            return jnp.sum(o_s * w[:, start:start + S])

        dq_s, dk_s, dv_s = jax.grad(shard, argnums=(0, 1, 2))(q[:, start:start + S], k, v)
        dq.append(dq_s)
        dk, dv = dk + dk_s, dv + dv_s
    for name, got, want in zip("qkv", (jnp.concatenate(dq, axis=1), dk, dv), grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5, err_msg=f"d{name}")
