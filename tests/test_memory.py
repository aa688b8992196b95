"""The reference handles B=1, T=16384, H=8, H_kv=2, K=V=64 with the default config
(2 layers, M = 8192 candidates per query) in bounded memory, and matches the oracle there.

The memory is XLA's compiled plan for the whole call (as `htree_jax.bench.planned_gb`
measures on a GPU): compiling it is cheap, running all 16384 queries on two CPU cores is
not, so the outputs are checked at sampled positions of the same inputs and tree, through
the reference's own walk (`attend_tree`), against the float64 oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from htree_jax import HTreeConfig, MemoryPlan, compile_checked, htree_attention, memory_plan
from htree_jax import memory
from htree_jax.core.tree import build_tree
from htree_jax.memory import constant_argument_bytes, resident_bytes
from htree_jax.reference import (
    CPU_CHUNK_BUDGET_BYTES,
    TreeWalk,
    chunk_budget_bytes,
    reference_forward,
    attend_tree,
    default_query_chunk,
    rotate_by_child_offset,
    with_radii,
)
from reference_numpy import htree_attention_numpy

B, T, H, H_KV, K, V = 1, 16384, 8, 2, 64, 64


def test_default_config_t16384_planned_memory_is_bounded():
    config = HTreeConfig(selection_block=1)
    assert config.layer_sizes(T) == (16384, 1024)
    chunk = default_query_chunk(config, B, T, H_KV, H // H_KV, K, V)
    shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((B, T, H, K), (B, T, H_KV, K), (B, T, H_KV, V))]
    lowered = reference_forward.lower(*shapes, config=config, query_chunk=chunk)
    plan = lowered.compile().memory_analysis()
    if plan is None:  # a platform without a compiled-memory report
        raise AssertionError("no memory_analysis on this platform")
    # Beyond inputs (48 MiB) and outputs (o 32 MiB, selections 64 MiB): the tree and its
    # float32 rotated keys (~9 MiB), the scan's stacked outputs and one chunk of
    # intermediates (<= 64 MiB, the budget). Measured on jax 0.10.2, CPU: 137 MiB. The
    # arguments are the inputs and the constants the program takes (jax 0.12.1 on: 6.6 MB).
    constants = constant_argument_bytes(lowered)
    assert plan.argument_size_in_bytes == 48 * 2**20 + constants and constants < 8 * 2**20
    assert plan.output_size_in_bytes <= 97 * 2**20
    assert plan.temp_size_in_bytes < 2 * CPU_CHUNK_BUDGET_BYTES + 96 * 2**20, plan.temp_size_in_bytes


def test_default_config_t16384_matches_oracle_at_sampled_positions():
    config = HTreeConfig(selection_block=1)
    rng = np.random.default_rng(7)
    q = rng.standard_normal((B, T, H, K)).astype(np.float32)
    k = rng.standard_normal((B, T, H_KV, K)).astype(np.float32)
    v = rng.standard_normal((B, T, H_KV, V)).astype(np.float32)
    # Positions whose top layer holds more than top_k candidates, so each one selects
    # (below 8192 a query keeps every top node and the test would check no selection).
    pos = np.array([8192, 9001, 10007, 12345, 15000, T - 1])
    assert np.all(pos // config.compression_rate + 1 > config.top_k)
    tree = build_tree(k, v, config)
    layers = [(rotate_by_child_offset(kl, config), vl) + rho for (kl, vl), rho in zip(tree, with_radii(tree, config))]
    o, sel = attend_tree(jnp.asarray(q[:, pos]), layers, jnp.asarray(pos, jnp.int32), TreeWalk(config, query_chunk=2))
    ref, ref_sel, fragile = htree_attention_numpy(q, k, v, config, return_selected=True, query_positions=pos,
                                                  return_fragile=True)
    assert not fragile.any()
    np.testing.assert_array_equal(np.asarray(sel[0]), ref_sel[0])
    np.testing.assert_allclose(np.asarray(o), ref, rtol=1e-5, atol=1e-5)


def test_memory_plan_counts_and_checks_without_running():
    """`htree_jax.memory_plan`: XLA's plan of one call from shapes alone (nothing runs),
    the forward+backward's above the forward's; `check` raises `MemoryError` naming the
    need and the limit past a limit, and passes on devices that report none (the CPU)."""
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    shapes = [jax.ShapeDtypeStruct((2, 150, 4, 16), jnp.float32)] + [jax.ShapeDtypeStruct((2, 150, 2, 16),
                                                                                          jnp.float32)] * 2
    forward = memory_plan(*shapes, config, backend="reference")
    both = memory_plan(*shapes, config, gradients=True, backend="reference")
    # XLA's arguments are the inputs and the constants the lowered program takes.
    assert isinstance(forward, MemoryPlan) and forward.inputs == 4 * (2 * 150 * 4 * 16 + 2 * 2 * 150 * 2 * 16)
    assert forward.arguments == forward.inputs + forward.constants
    assert forward.outputs >= 4 * 2 * 150 * 4 * 16 and forward.temporaries > 0
    assert both.peak > forward.peak and both.inputs == forward.inputs + 4 * 2 * 150 * 4 * 16
    both.check(limit_bytes=both.peak)
    with pytest.raises(MemoryError, match=r"forward and backward needs \d+\.\d MiB on each device .* the limit "
                                          r"given has \d+\.\d MiB free: shard the call over more devices"):
        both.check(limit_bytes=both.peak - 1)
    both.check()  # the CPU reports no memory limit
    q, k, v = (jnp.zeros(s.shape, s.dtype) for s in shapes)  # arrays are taken as their shapes
    assert memory_plan(q, k, v, config, backend="reference") == forward
    with pytest.raises(ValueError, match=r"v must have shape \[B, T, H_kv, V\]"):  # htree_attention's checks
        memory_plan(shapes[0], shapes[1], jax.ShapeDtypeStruct((2, 150, 3, 16), jnp.float32), config)


def small_step(rng):
    """`(step, (q, k, v))`: the gradient of a sum of squares of `htree_attention` (3 layers at
    T=150) and fresh float32 inputs `[1, 150, 4 or 2, 16]`."""
    config = HTreeConfig(compression_rate=4, top_k=4, selection_block=1)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((1, 150, 4, 16), (1, 150, 2, 16),
                                                                         (1, 150, 2, 16)))
    step = jax.grad(lambda q, k, v: jnp.sum(htree_attention(q, k, v, config, backend="reference") ** 2),
                    argnums=(0, 1, 2))
    return step, (q, k, v)


def test_constant_arguments_are_counted_from_the_lowered_program():
    """A constant array the program takes as an argument (jax 0.12.1 on: those over 1 KB)
    is in XLA's arguments beside the inputs, and `constant_argument_bytes` counts it; a
    program that embeds it (before) counts none."""
    table = np.arange(1000, dtype=np.float32)
    lowered = jax.jit(lambda x: x * table).lower(jax.ShapeDtypeStruct((1000,), jnp.float32))
    constants = constant_argument_bytes(lowered)
    assert constants in (0, table.nbytes)
    assert ('jax.const' in lowered.as_text()) == (constants > 0)
    plan = MemoryPlan.of(lowered.compile(), lowered=lowered)
    assert plan.constants == constants and plan.arguments == 4000 + constants and plan.inputs == 4000


def test_compile_checked_runs_what_fits_and_refuses_what_does_not():
    """`htree_jax.compile_checked`: a whole step compiled, checked and returned to run
    (the same outputs as `jax.jit`), or a `MemoryError` naming the need and the limit
    before anything runs."""
    step, (q, k, v) = small_step(np.random.default_rng(0))
    compiled = compile_checked(step, q, k, v, what="a step")
    for a, b in zip(compiled(q, k, v), jax.jit(step)(q, k, v)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    plan = MemoryPlan.of(compiled)
    compile_checked(step, q, k, v, limit_bytes=plan.peak)
    with pytest.raises(MemoryError, match=r"a step needs \d+\.\d MiB on each device .* the limit given has"):
        compile_checked(step, q, k, v, what="a step", limit_bytes=plan.peak - 1)


def test_compile_checked_takes_the_arguments_a_device_holds_off_its_need(monkeypatch):
    """Arrays passed to `compile_checked` are in their device's `bytes_in_use` already:
    a step fits where the device's free memory and its arguments together cover the plan
    (the arguments counted twice refused a step that fitted);
    one byte less is refused naming what the device holds; shapes alone hold nothing."""
    step, (q, k, v) = small_step(np.random.default_rng(1))
    device = jax.devices()[0]
    held = resident_bytes((q, k, v))
    assert held == {device: q.nbytes + k.nbytes + v.nbytes}
    assert resident_bytes((q, q, jax.ShapeDtypeStruct(k.shape, k.dtype))) == {device: q.nbytes}
    lowered = jax.jit(step).lower(q, k, v)
    plan = MemoryPlan.of(lowered.compile(), lowered=lowered)
    assert plan.arguments == held[device] + plan.constants
    monkeypatch.setattr(memory, "free_bytes", lambda d: plan.peak - held[d])
    compile_checked(step, q, k, v)
    monkeypatch.setattr(memory, "free_bytes", lambda d: plan.peak - held[d] - 1)
    with pytest.raises(MemoryError, match=r"a step needs .* has \d+\.\d MiB free beside the \d+\.\d MiB of the "
                                          r"arguments it holds"):
        compile_checked(step, q, k, v, what="a step")
    monkeypatch.setattr(memory, "free_bytes", lambda d: plan.peak - 1)
    with pytest.raises(MemoryError, match=r"a step needs .* has \d+\.\d MiB free: shard"):
        compile_checked(step, *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)), what="a step")


def test_check_refuses_temporaries_larger_than_the_largest_free_block(monkeypatch):
    """XLA allocates a call's temporaries as one buffer: a device with free memory
    enough in all but no block that large is refused, naming the block; one block
    as large as the temporaries passes."""
    plan = MemoryPlan(arguments=10 * 2**30, outputs=10 * 2**30, temporaries=48 * 2**30, what="a step")
    monkeypatch.setattr(memory, "free_bytes", lambda d: 70 * 2**30)
    monkeypatch.setattr(memory, "largest_free_block", lambda d: 48 * 2**30)
    plan.check()
    monkeypatch.setattr(memory, "largest_free_block", lambda d: 48 * 2**30 - 1)
    with pytest.raises(MemoryError, match=r"a step needs 68.00 GiB .* the temporaries are one buffer and .*'s "
                                          r"largest free block is 48.00 GiB \(70.00 GiB free in all, in pieces\)"):
        plan.check()
    plan.check(limit_bytes=plan.peak)  # a limit given bounds the whole plan alone



class StatsOnly:
    """A device as `largest_free_block` reads it: its `memory_stats()` alone."""

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_largest_free_block_reads_the_allocators_block_or_the_room_left_to_reserve():
    """The largest free block of a preallocated pool, or (a pool still growing) the bytes
    the allocator may still reserve, whichever is larger; None where no block is reported."""
    GiB = 2**30
    full_pool = {"bytes_limit": 75 * GiB, "pool_bytes": 75 * GiB, "largest_free_block_bytes": 65 * GiB}
    assert memory.largest_free_block(StatsOnly(full_pool)) == 65 * GiB
    growing = {"bytes_limit": 75 * GiB, "pool_bytes": 20 * GiB, "largest_free_block_bytes": 8 * GiB}
    assert memory.largest_free_block(StatsOnly(growing)) == 55 * GiB
    assert memory.largest_free_block(StatsOnly({"largest_free_block_bytes": 3 * GiB})) == 3 * GiB
    assert memory.largest_free_block(StatsOnly({"bytes_limit": GiB})) is None
    assert memory.largest_free_block(StatsOnly(None)) is None


def test_the_reference_chunk_budget_is_64_mib_unless_the_environment_says(monkeypatch):
    monkeypatch.delenv("HTREE_REFERENCE_CHUNK_BYTES", raising=False)
    assert chunk_budget_bytes() == CPU_CHUNK_BUDGET_BYTES == 64 << 20
    monkeypatch.setenv("HTREE_REFERENCE_CHUNK_BYTES", str(1 << 30))
    assert chunk_budget_bytes() == 1 << 30
    monkeypatch.setenv("HTREE_REFERENCE_CHUNK_BYTES", "lots")
    with pytest.raises(ValueError, match="HTREE_REFERENCE_CHUNK_BYTES must be a positive number of bytes"):
        chunk_budget_bytes()
