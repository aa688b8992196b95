"""The kernel families' configs (`pallas_kernels/shared/configs.py`): a user's `BlockSizes` laid
over the tuned configs of the shape class, every field where it lands, bad values named."""

from __future__ import annotations

import dataclasses

import pytest

from htree_jax import BlockSizes
from pallas_kernels.shared.configs import (
    TUNED,
    USER_FIELDS,
    KernelConfigs,
    LayerConfig,
    TopConfig,
    WideConfig,
    shape_class,
)


def test_block_sizes_has_at_most_twelve_fields_each_with_a_place():
    names = [f.name for f in dataclasses.fields(BlockSizes)]
    assert len(names) <= 12 and set(names) == set(USER_FIELDS)
    assert all(value is None for value in dataclasses.astuple(BlockSizes()))


@pytest.mark.parametrize("K, V, cls", [(128, 128, "head_dims<=256"), (256, 64, "head_dims<=256"),
                                       (576, 512, "wide"), (320, 32, "wide")])
def test_none_takes_the_tuned_configs_of_the_shape_class(K, V, cls):
    assert shape_class(K, V) == cls
    assert KernelConfigs.resolve(None, K, V) == KernelConfigs.resolve(BlockSizes(), K, V) == TUNED[cls]


def test_a_field_set_replaces_the_tuned_value_and_nothing_else():
    """At the latent shape a user's `span` keeps the wide class's other tiles (32-candidate
    tiles, 16-row top programs), which the 64-candidate defaults would overflow."""
    got = KernelConfigs.resolve(BlockSizes(span=16, num_warps=8, num_stages=1, top_rows=32), 576, 512)
    wide = TUNED["wide"]
    assert got.layer == dataclasses.replace(wide.layer, span=16, num_warps=8, merge_num_warps=8, num_stages=1,
                                            scores_num_stages=1, merge_num_stages=1)
    assert got.top == dataclasses.replace(wide.top, rows=32)
    assert (got.top_backward, got.wide) == (wide.top_backward, wide.wide)
    for name, targets in USER_FIELDS.items():  # every field lands where USER_FIELDS says
        value = {"save_selections": False, "min_query_rows": 16, "num_warps": 16, "wide_rows": 32,
                 "wide_backward_rows": 32, "node_entries": 0}.get(name, 7)
        got = KernelConfigs.resolve(BlockSizes(**{name: value}), 128, 128)
        for target in targets:
            family, _, field = target.rpartition(".")
            assert getattr(getattr(got, family) if family else got, field) == value, (name, target)


def test_a_kernel_configs_is_taken_as_it_is_and_changed_by_name():
    custom = TUNED["head_dims<=256"].with_changes({"top.keys_tile": 64, "layer.select_num_warps": 8,
                                                   "chunk_budget_bytes": 1 << 20})
    assert KernelConfigs.resolve(custom, 576, 512) is custom
    assert (custom.top.keys_tile, custom.layer.select_num_warps, custom.chunk_budget_bytes) == (64, 8, 1 << 20)
    with pytest.raises(ValueError, match="no kernel family 'tops'"):
        custom.with_changes({"tops.rows": 1})
    with pytest.raises(ValueError, match="'rows' is not a KernelConfigs field"):
        custom.with_changes({"rows": 1})
    with pytest.raises(TypeError, match="block_sizes must be an htree_jax.BlockSizes"):
        KernelConfigs.resolve({"span": 16}, 128, 128)


@pytest.mark.parametrize("make, message", [
    (lambda: BlockSizes(min_query_rows=4), "BlockSizes.min_query_rows must be 8 or 16"),
    (lambda: BlockSizes(save_selections=1), "BlockSizes.save_selections must be a bool"),
    (lambda: BlockSizes(wide_rows=8), "BlockSizes.wide_rows must be 0 .off. or >= 16"),
    (lambda: BlockSizes(wide_backward_rows=8), "BlockSizes.wide_backward_rows must be >= 16"),
    (lambda: BlockSizes(chunk_budget_bytes=0), "BlockSizes.chunk_budget_bytes must be an int >= 1"),
    (lambda: LayerConfig(min_query_rows=12), "min_query_rows must be 8 or 16"),
    (lambda: TopConfig(num_warps=6), "TopConfig.num_warps must be a power of two"),
    (lambda: WideConfig(rows=8), "WideConfig.rows must be 0 .off. or an int >= 16")])
def test_bad_values_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()
