"""The bottom merge over query blocks (`pallas_kernels/union.py`) against the per-query
path, the reference and a NumPy union; interpret mode."""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from htree_jax import HTreeConfig, htree_attention
from pallas_kernels.common import pad_axis
from pallas_kernels.forward import htree_forward_pallas
from pallas_kernels.plan import BlockSizes, layout, union_width
from pallas_kernels.merge import merge_pallas, merge_twin
from pallas_kernels.precision import key_operands
from pallas_kernels.rope import rotate_phases
from pallas_kernels.union import block_union, union_members, union_merge_pallas
from tests.conftest import random_qkv
from tests.test_pallas_kernels import layer_inputs


def numpy_union(parents, bq):
    """Per block: the distinct parents ascending, and each member's slot of each."""
    B, Q, H_kv, P = parents.shape
    out = {}
    for b, i, h in np.ndindex(B, Q // bq, H_kv):
        lists = [parents[b, i * bq + m, h] for m in range(bq)]
        union = sorted({int(x) for row in lists for x in row if x >= 0})
        slots = np.full((bq, len(union)), -1)
        for m, row in enumerate(lists):
            for s, x in enumerate(row):
                if x >= 0:
                    slots[m, union.index(int(x))] = s
        out[b, i, h] = (union, slots)
    return out


def sorted_parent_lists(rng, shape, num_nodes):
    B, Q, H_kv, P = shape
    parents = np.full(shape, -1, np.int32)
    for idx in np.ndindex(B, Q, H_kv):
        count = rng.integers(0, P + 1)
        parents[idx][:count] = np.sort(rng.choice(num_nodes, size=count, replace=False))
    return parents


@pytest.mark.parametrize("num_nodes_known", [True, False], ids=["packed-key sort", "two-operand sort"])
@pytest.mark.parametrize("width", [64, 8])
def test_block_union_equals_numpy(rng, num_nodes_known, width):
    bq, num_nodes = 4, 40
    parents = sorted_parent_lists(rng, (2, 12, 3, 6), num_nodes)
    union, size, slots = (np.asarray(x) for x in block_union(jnp.asarray(parents), bq, width,
                                                             num_nodes if num_nodes_known else None))
    want = numpy_union(parents, bq)
    truncated = 0
    for (b, i, h), (u, s) in want.items():
        assert size[b, i, h, 0] == len(u)
        kept = min(len(u), width)  # a union past the buffer keeps its smallest parents
        truncated += len(u) > width
        np.testing.assert_array_equal(union[b, i, h, :kept], u[:kept])
        assert np.all(union[b, i, h, kept:] == -1)
        np.testing.assert_array_equal(slots[b, i, h, :, :kept], s[:, :kept])
        assert np.all(slots[b, i, h, :, kept:] == -1)
    assert (truncated > 0) == (width == 8)
    members = np.asarray(union_members(jnp.asarray(size), width, bq))
    np.testing.assert_array_equal(members[..., 0], np.repeat(size[..., 0] <= width, bq, axis=1))


def test_union_merge_kernel_equals_per_query_kernel_and_twin(rng):
    """One layer's bottom merge, kernel against kernel: blocks of 4 queries with
    independent random parent lists (most nodes selected by one member only), a block
    whose members' lists are disjoint, one whose members share every parent, and a
    buffer too small for some blocks (those keep the per-query kernel's outputs)."""
    config = HTreeConfig(compression_rate=4, top_k=4)
    bq = 4
    a = layer_inputs(rng, config, G=3, K=24, V=20, Q=16, N=4 * 40)
    st = a["st"]
    parents, n = np.array(a["parents"]), np.array(a["n"])
    parents[0, :4, 0] = -1  # block 0, kv head 0: disjoint lists, each full (4 parents)
    for m in range(4):
        parents[0, m, 0, :4] = np.arange(4) * 4 + m
        n[0, m, 0, 0] = 4 * 3 + m % 4 + 1
    parents[1, 4:8, 1] = parents[1, 4, 1]  # block 1, kv head 1: one shared list
    n[1, 4:8, 1] = n[1, 4, 1]
    parents, n = jnp.asarray(parents), jnp.asarray(n)
    P = parents.shape[-1]
    phases = rotate_phases(a["layer_k"], a["cos"], a["sin"], st)
    k_rot = key_operands(phases, st.precision)
    args = (a["q"], parents, n, k_rot, a["layer_v"], a["cos"], a["sin"], a["state"], st)
    o_q, lse_q = merge_pallas(*args, interpret=True, return_lse=True)
    o_t = merge_twin(a["q"], parents, n, None, None, a["layer_k"], a["layer_v"], a["cos"], a["sin"], a["state"], st)
    want = numpy_union(np.asarray(parents), bq)
    assert len(want[0, 0, 0][0]) == 16 and len(want[1, 1, 1][0]) == len(set(np.asarray(parents)[1, 4, 1]) - {-1})
    G = st.group
    for width in (bq * P, 8):
        union, size, slots = block_union(parents, bq, width, 40)
        prior = union_merge_pallas(a["q"], union, size, slots, n, k_rot, a["layer_v"], a["cos"], a["sin"],
                                   a["state"], st, parents_per_step=2, interpret=True, return_lse=True)
        skip = union_members(size, width, bq)
        o, lse = merge_pallas(*args, interpret=True, return_lse=True, skip=skip, prior=prior)
        fits = np.asarray(skip)[..., 0] == 1
        assert fits.all() if width == bq * P else (fits.any() and not fits.all())
        np.testing.assert_allclose(np.asarray(o)[..., :G, :], np.asarray(o_q)[..., :G, :], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(lse)[..., :G], np.asarray(lse_q)[..., :G], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(o)[..., :G, :], np.asarray(o_t)[..., :G, :], rtol=1e-5, atol=1e-5)
        # The union kernel alone wrote exactly the rows of the blocks that fit.
        np.testing.assert_allclose(np.asarray(prior[0])[fits][..., :G, :], np.asarray(o_q)[fits][..., :G, :],
                                   rtol=1e-5, atol=1e-5)


def _bottom_union_fits(sel, config, T, block_sizes):
    """Which blocks of the bottom layer the union path serves, from its parent lists."""
    P = layout(config, block_sizes)[2]
    bq, width = block_sizes.union_queries, union_width(block_sizes, P)
    parents = pad_axis(jnp.asarray(sel), 1, -(-T // bq) * bq)
    parents = jnp.where(jnp.arange(parents.shape[1])[None, :, None, None] < T, parents, -1)
    _, size, _ = block_union(pad_axis(parents + 1, 3, P) - 1, bq, width)
    return np.asarray(size <= width)


UNION_CASES = [
    # (r, top_k, T, G, union_queries, union_limit): T not a multiple of the block, a
    # ragged last block, several blocks per chunk, 2- to 6-layer trees.
    (4, 4, 150, 2, 4, 1.0),
    (4, 4, 150, 2, 16, 0.15),
    (2, 4, 77, 2, 8, 1.0),
    (8, 8, 200, 1, 16, 1.0),
    (2, 2, 100, 3, 4, 0.1),
]


@pytest.mark.parametrize("r, top_k, T, G, bq, limit", UNION_CASES)
def test_forward_union_path_equals_reference(rng, r, top_k, T, G, bq, limit):
    config = HTreeConfig(compression_rate=r, top_k=top_k)
    assert config.num_layers(T) >= 2
    q, k, v = random_qkv(rng, 2, T, 2 * G, 2, 40, 36)
    o_ref, sel_ref = htree_attention(q, k, v, config, backend="reference", return_selected=True)
    forced = BlockSizes(union_queries=bq, union_limit=limit)
    fits = _bottom_union_fits(sel_ref[-1], config, T, forced)
    assert fits.all() if limit == 1.0 else (fits.any() and not fits.all()), fits.mean()
    for block_sizes in (forced, BlockSizes(union_limit=0.0)):
        o, sel = htree_forward_pallas(q, k, v, config, block_sizes, interpret=True)
        for a, b in zip(sel, sel_ref):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), rtol=1e-5, atol=1e-5)
