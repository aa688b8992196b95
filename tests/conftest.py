"""Shared fixtures: fresh random inputs and small multi-layer configs."""

from __future__ import annotations

import importlib.util
import os
import zlib

# CPU runs (CI) spend most of their time compiling interpreted Pallas kernels for XLA:CPU,
# not running them: with LLVM's optimisation passes off the same kernel tests took 292 s
# instead of 411 s on two cores, with the same results. Not where JAX's CUDA plugin is
# installed: there the gpu-marked tests compile for the GPU. Set before jax is imported.
if not any(importlib.util.find_spec(name) for name in ("jax_cuda13_plugin", "jax_cuda12_plugin")):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax
import numpy as np
import pytest

from htree_jax import HTreeConfig


def random_qkv(rng, B, T, H, H_kv, K, V, dtype=np.float32, scale=1.0):
    """Fresh normal q [B,T,H,K], k [B,T,H_kv,K], v [B,T,H_kv,V] in `dtype`."""
    q = (scale * rng.standard_normal((B, T, H, K))).astype(dtype)
    k = (scale * rng.standard_normal((B, T, H_kv, K))).astype(dtype)
    v = rng.standard_normal((B, T, H_kv, V)).astype(dtype)
    return q, k, v


# Small configs with 3+ layers at T <= 300 (the layer counts are asserted in the tests).
MULTI_LAYER_CASES = [
    # (compression_rate, top_k, T)
    (4, 4, 150),  # 150 -> 38 -> 10: 3 layers
    (2, 8, 300),  # 300 -> 150 -> 75 -> 38 -> 19 -> 10: 6 layers
    (8, 2, 200),  # 200 -> 25 -> 4: 3 layers
    (2, 2, 100),  # 100 -> 50 -> 25 -> 13 -> 7 -> 4: 6 layers
]


@pytest.fixture
def rng(request):
    # A different stream per test (fresh inputs), reproducible from the test's name
    # (crc32, not hash(): str hashes change with every interpreter's PYTHONHASHSEED).
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


def small_config(r, top_k, **kw):
    return HTreeConfig(compression_rate=r, top_k=top_k, **{"selection_block": 1, **kw})  # per query unless told


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Drops JAX's compiled executables after each test module: a whole run compiles
    thousands of small programs, and keeping them all grew one process past 2.4 GB."""
    yield
    jax.clear_caches()


# Test files whose tests run for minutes (each sharded run is a process of its own on 8
# simulated devices, the longest about 3 minutes on two cores).
LONG_FIRST = ("test_sharding.py", "test_multiprocess.py")


def pytest_addoption(parser):
    parser.addoption("--one-case-each", action="store_true",
                     help="run each test function once: the first of its parametrized cases (CI's second "
                          "run, on the newest JAX, which checks the API each test reaches, not every shape again)")


def first_case_of_each(items):
    """`(kept, dropped)`: the first collected item of each test function, the rest."""
    seen, kept, dropped = set(), [], []
    for item in items:
        function = item.nodeid.split("[")[0]
        (dropped if function in seen else kept).append(item)
        seen.add(function)
    return kept, dropped


# Left out of the `--one-case-each` run (CI's quick pass on the oldest JAX; reported as
# deselected), each 20-90 s, whose JAX API the run reaches through the ones it keeps:
# checks on simulated devices, each a process of its own, through
# `test_sharded_batch_and_heads_on_simulated_devices` (the partitioning under jit, sharded
# decode caches, `shard_map` of the kernels) and the two-process test, `memory_analysis`
# and nnx with optax in-process (test_memory.py, test_module.py); the packed block
# kernels' gradients against each document alone, through
# `test_packed_blocks_walk_the_top_layer_from_their_documents_tile` (the same kernels'
# gradients against the reference's); the wide kernels reading values from the keys,
# through `test_wide_backward_with_values_from_the_keys` (forward and backward), and q in
# the caller's order, which every `htree_attention` call on them reads; the saved
# selections' backward, through the GQA kernels' gradient tests; the latent shape (K=576,
# 128 heads), through the wide kernels at K=320 (`test_sixteen_heads_at_wide_head_dims_...`);
# the block sums without atomics against the atomics, through the partials' sums against
# the reference (test_block_partials.py, test_block_sums.py); the reference
# against the oracle by hypothesis, through every reference test; the frontier's,
# adaptation's and extension's training and scoring (and a seed of the extension study,
# stage by stage), the training-step benchmark's step and the needle task's curriculum,
# through test_examples.py's training (nnx, optax, the same jitted step). The two-process test is left too, the
# longest check of the pass (three processes at once): jax.distributed and gloo are tested
# on the newest JAX only. The partial sums' packed rows and context shards stay: no kept
# test reaches their chunks' offsets. The whole suite runs them all.
SECOND_RUN_LEAVES = tuple(f"test_sharding.py::{name}" for name in (
    "test_block_selection_shards_its_tokens_and_its_cache",
    "test_memory_plan_of_context_parallelism_falls_with_the_device_count",
    "test_the_gates_two_device_cases_run_on_simulated_devices",
    "test_sharded_nnx_model_optax_step",
)) + ("test_block_selection.py::test_packed_gradients_on_the_kernels_equal_each_document_alone[first-2]",
      "test_multiprocess.py::test_two_processes_equal_one_on_the_same_mesh",
      "test_wide.py::test_htree_attention_with_values_from_the_keys[pallas_interpret-32]",
      "test_wide.py::test_queries_in_the_given_order_equal_the_permuted_ones[32]",
      "test_pallas_backward.py::test_backward_with_saved_selections_equals_recomputing_them_bitwise[1-77-2-4-3-bfloat16]",
      "test_oracle_agreement.py::test_reference_matches_oracle_hypothesis",
      "test_frontier.py::test_extension_continues_a_short_dense_checkpoint_at_a_longer_length",
      "test_frontier.py::test_frontier_scores_checkpoints_and_draws_the_table",
      "test_examples.py::test_needle_task_with_a_length_curriculum_and_bfloat16_lowers_the_loss",
      "test_latent_shapes.py::test_mla_dims_equal_the_reference",
      "test_block_sums.py::test_sums_without_atomics_equal_the_atomics_and_are_the_same_every_call[float32]",
      "test_frontier.py::test_adaptation_continues_a_dense_checkpoint_with_htree_and_scores_each_share",
      "test_frontier.py::test_a_seed_runs_end_to_end_resumes_by_stage_and_travels_in_pieces",
      "test_bench.py::test_the_training_step_benchmark_times_dense_and_htree_in_one_call")


def second_run(items):
    """`(kept, dropped)` of the `--one-case-each` run: each function's first case, less
    `SECOND_RUN_LEAVES`."""
    kept, dropped = first_case_of_each(items)
    left = [item for item in kept if item.nodeid.endswith(SECOND_RUN_LEAVES)]
    return [item for item in kept if item not in left], dropped + left


def pytest_collection_modifyitems(config, items):
    """The longest tests first, each file's order kept: xdist hands tests out in
    collection order, and collected last (files sort by name) a 3-minute test left the
    other worker idle at the end of the run. With `--one-case-each`, each test
    function's first case only, less `SECOND_RUN_LEAVES` (the others reported as
    deselected)."""
    if config.getoption("--one-case-each"):
        items[:], dropped = second_run(items)
        config.hook.pytest_deselected(items=dropped)
    items.sort(key=lambda item: item.path.name not in LONG_FIRST)
