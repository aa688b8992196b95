"""The block backward's key and value gradients summed without atomics (`BlockKernels(
sums="partials")`, interpreted): the inverted index the sums read against a
brute-force inversion of the blocks' selections, the gradients against the JAX
reference on multi-layer trees (both sources, padded heads, ragged lengths, partial
RoPE, bfloat16, a group split over programs), and against the atomics' sums, two calls
equal bitwise. (Each launch is lowered to Triton for a Hopper GPU in
`tests/test_block_kernels.py`; `test_block_partials.py` has the partials' own checks.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from htree_jax import htree_attention
from htree_jax.backends import blocks_of
from htree_jax.core.indexing import num_top_parents
from pallas_kernels.block.backward import block_backward_pallas
from pallas_kernels.block.forward import block_forward_pallas
from pallas_kernels.block.inverted import inverted_index
from pallas_kernels.shared.configs import BlockConfig, KernelConfigs
from pallas_kernels.shared.kernels import BlockKernels
from tests.test_block_kernels import CASES, block_config, inputs, relative

def brute_inversion(selections, r, T, L, layer_sizes):
    """Per layer (bottom first), per (b, h_kv): `{tile: [(block, slot, refined children), ...]}`
    by walking every block's buffer."""
    B, NB, H_kv = selections[0].shape[:3]
    sel = [np.asarray(s) for s in selections]  # top layer first
    out = []
    for l in range(L):
        layer = {}
        for b in range(B):
            for h in range(H_kv):
                tiles = {}
                for j in range(NB):
                    if l == L - 1:
                        parents = list(range(int(num_top_parents(j * r, r, L))))
                    else:
                        parents = [int(x) for x in sel[L - 2 - l][b, j, h] if x >= 0]
                    refined = set(int(x) for x in sel[L - 1 - l][b, j, h] if x >= 0) if l > 0 else set()
                    for s, u in enumerate(parents):
                        kept = frozenset(c for c in range(r) if u * r + c in refined)
                        tiles.setdefault(u, []).append((j, s, kept))
                layer[(b, h)] = tiles
        out.append(layer)
    return out


@pytest.mark.parametrize("r, top_k, T, H_kv, source", [(4, 4, 150, 2, "first"), (4, 2, 300, 1, "previous"),
                                                        (8, 4, 700, 2, "first"), (2, 4, 100, 1, "first")])
def test_the_inverted_index_is_the_brute_force_inversion(rng, r, top_k, T, H_kv, source):
    config = block_config(r, top_k, source, "bound")
    L = config.num_layers(T)
    assert L >= 3
    q, k, v = inputs(rng, 2, T, 4 * H_kv, H_kv, 16, 16, jnp.float32)
    selections = blocks_of(q, k, v, config, impl="pallas_interpret")
    sizes = tuple(config.layer_sizes(T))
    index = inverted_index(selections, r=r, b=r, T=T, num_layers=L, layer_sizes=sizes)
    want = brute_inversion(selections, r, T, L, sizes)
    for l in range(L):
        offsets, blocks, slots, refined = (np.asarray(x) for x in index[l])
        for (b, h), tiles in want[l].items():
            for u in range(offsets.shape[-1] - 1):
                lo, hi = offsets[b, h, u], offsets[b, h, u + 1]
                got = [(int(blocks[b, h, e]), int(slots[b, h, e]),
                        frozenset(c for c in range(r) if (int(refined[b, h, e, c // 32]) >> (c % 32)) & 1))
                       for e in range(lo, hi)]
                assert got == tiles.get(u, []), (l, b, h, u)
            assert offsets[b, h, -1] == sum(len(x) for x in tiles.values())


PARTIALS = BlockKernels(sums="partials")


# The cases the partials' path branches on (each program's slab and walked range):
# ragged padded heads, bfloat16, partial RoPE and a group split over programs.
@pytest.mark.parametrize("case", [CASES[i] for i in (2, 3, 4, 5)])
def test_gradients_summed_from_partials_match_the_reference(rng, case):
    source, selection, r, top_k, T, H, H_kv, K, V, rope_dim, dtype = case
    config = block_config(r, top_k, source, selection, rope_dim=rope_dim)
    q, k, v = inputs(rng, 1, T, H, H_kv, K, V, dtype)
    weights = jnp.asarray(rng.standard_normal((1, T, H, V)), jnp.float32)

    def grads(backend, kernels=None):
        loss = lambda q, k, v: jnp.sum(htree_attention(q, k, v, config, backend=backend,
                                                       block_kernels=kernels).astype(jnp.float32) * weights)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    tolerance = 1e-5 if dtype == jnp.float32 else 3e-2
    for name, a, b in zip("qkv", grads("pallas_interpret", PARTIALS), grads("reference")):
        assert relative(a.astype(jnp.float32), b.astype(jnp.float32)) < tolerance, name


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sums_without_atomics_equal_the_atomics_and_are_the_same_every_call(rng, dtype):
    """From partial sums in three chunks of several blocks and a remainder
    (1 MiB holds 10 of this call's 38 blocks' slabs, 96 KiB a block) and one block a
    chunk (one chunk: the reference cases). The same float32 terms summed in another
    order: in bfloat16 too the gradients differ from the atomics' only where a sum
    rounds to the next bfloat16 value (none did here; a bias of 0.1% in the sums is
    a relative 1e-3, past the 1e-4 allowed)."""
    config = block_config(4, 4, "first", "bound")
    q, k, v = inputs(rng, 2, 150, 8, 2, 32, 32, dtype)
    selections = blocks_of(q, k, v, config, impl="pallas_interpret")
    o, lse = block_forward_pallas(q, k, v, selections, config=config, interpret=True)
    do = jnp.asarray(rng.standard_normal(o.shape), dtype)
    run = lambda block, kernels: block_backward_pallas(q, k, v, o, lse, do, selections, config=config, block=block,
                                                       kernels=kernels, interpret=True)
    atomics = run(BlockConfig(), BlockKernels())
    tolerance = 1e-6 if dtype == jnp.float32 else 1e-4
    for block in (BlockConfig(backward_partial_bytes=n) for n in (2 ** 20, 1)):
        first, second = run(block, PARTIALS), run(block, PARTIALS)
        for name, a, b, c in zip("qkv", atomics, first, second):
            assert relative(b, a) < tolerance, (name, block, relative(b, a))
            np.testing.assert_array_equal(np.asarray(b, np.float32), np.asarray(c, np.float32))


def test_an_unknown_sum_is_refused_by_name():
    with pytest.raises(ValueError, match="BlockKernels.sums must be one of"):
        BlockKernels(sums="sorted")
    with pytest.raises(ValueError, match="backward_partial_bytes"):
        BlockConfig(backward_partial_bytes=0)
    with pytest.raises(ValueError, match="BlockKernels.sums must be one of"):
        BlockKernels(sums="by_node")  # left the library on 12-07 (1476 ms against 297 at 128K)
    assert KernelConfigs().with_changes({"block.backward_partial_bytes": 2 ** 20}).block == BlockConfig(
        backward_partial_bytes=2 ** 20)
