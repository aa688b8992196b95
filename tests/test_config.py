"""HTreeConfig: defaults, derived sizes, validation, hashability."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from htree_jax import HTreeConfig


def test_defaults_and_derived_sizes():
    c = HTreeConfig()
    assert (c.compression_rate, c.top_k, c.rope_base, c.scale) == (16, 512, 10000.0, None)
    assert (c.importance, c.strict_causal) == ("softmax", True)
    assert (c.selection_block, c.block_source, c.selects_by_block) == (16, "first", True)  # by block (SPEC 12)
    assert c.max_candidates == 8192 and c.log_n == 13
    assert c.layer_sizes(8192) == (8192,)
    assert c.layer_sizes(8193) == (8193, 513)
    assert c.layer_sizes(131072) == (131072, 8192)
    assert c.layer_sizes(524288) == (524288, 32768, 2048)
    assert c.num_layers(1) == 1 and c.num_layers(524288) == 3
    assert c.score_scale(64) == 64**-0.5
    assert HTreeConfig(scale=0.5).score_scale(64) == 0.5


def test_the_default_selects_by_block_at_the_compression_rate_and_per_query_for_latent_attention():
    """`selection_block=None` (the default) is the tree's `compression_rate`, stored, so a
    default config equals (and hashes as) the one that names it; with `rope_dim` set
    (latent attention's layout) it is 1, the per-query wide kernels' selection."""
    for r in (2, 4, 16, 64):
        c = HTreeConfig(compression_rate=r)
        assert c.selection_block == r and c == HTreeConfig(compression_rate=r, selection_block=r)
        assert hash(c) == hash(HTreeConfig(compression_rate=r, selection_block=r))
    assert HTreeConfig(rope_dim=64).selection_block == 1
    assert HTreeConfig(rope_dim=64, selection_block=16).selection_block == 16
    assert not HTreeConfig(selection_block=1).selects_by_block
    # dataclasses.replace passes the stored 16 on: the error says how to get the default
    with pytest.raises(ValueError, match="pass selection_block=None for the default"):
        dataclasses.replace(HTreeConfig(), compression_rate=4)
    assert dataclasses.replace(HTreeConfig(), compression_rate=4, selection_block=None).selection_block == 4


def test_hashable_static_jit_argument():
    assert hash(HTreeConfig()) == hash(HTreeConfig())
    assert HTreeConfig(top_k=64) != HTreeConfig()
    f = jax.jit(lambda x, config: x * config.top_k, static_argnames="config")
    assert int(f(jnp.ones(()), config=HTreeConfig(top_k=64))) == 64
    with pytest.raises(dataclasses.FrozenInstanceError):
        HTreeConfig().top_k = 4


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(compression_rate=3), "compression_rate must be a power of two"),
        (dict(compression_rate=1), "compression_rate must be a power of two >= 2"),
        (dict(compression_rate=0), "compression_rate"),
        (dict(compression_rate=4.0), "compression_rate"),
        (dict(top_k=0), "top_k must be a positive power of two"),
        (dict(top_k=6), "top_k must be a positive power of two"),
        (dict(top_k=-4), "top_k"),
        (dict(rope_base=0.0), "rope_base must be a positive finite"),
        (dict(rope_base=float("inf")), "rope_base"),
        (dict(scale=-1.0), "scale must be None or a positive finite"),
        (dict(scale=float("nan")), "scale"),
        (dict(importance="max"), "importance must be one of"),
        (dict(strict_causal=1), "strict_causal must be a bool"),
        (dict(top_k=2**20, compression_rate=32), "at most 2\\*\\*24"),
    ],
)
def test_invalid_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HTreeConfig(**kwargs)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_layer_sizes_rejects_bad_length(bad):
    with pytest.raises(ValueError, match="seq_len must be a positive int"):
        HTreeConfig().layer_sizes(bad)


def test_numpy_numbers_are_accepted_and_stored_as_python_numbers():
    import numpy as np

    c = HTreeConfig(compression_rate=np.int32(4), top_k=np.int64(4), rope_base=np.float32(500.0),
                    scale=np.float64(0.25))
    assert c == HTreeConfig(compression_rate=4, top_k=4, rope_base=500.0, scale=0.25)
    assert hash(c) == hash(HTreeConfig(compression_rate=4, top_k=4, rope_base=500.0, scale=0.25))
    assert type(c.top_k) is int and type(c.compression_rate) is int and type(c.rope_base) is float
    with pytest.raises(ValueError, match="top_k must be a positive power of two"):
        HTreeConfig(top_k=np.int64(6))
    with pytest.raises(ValueError, match="top_k"):
        HTreeConfig(top_k=np.bool_(True))
