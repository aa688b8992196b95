"""htree-jax: hierarchical sparse (htree) attention for JAX and Flax.

Public API: `HTreeConfig`, `build_tree`, `htree_attention` (and `BlockSizes`, the Pallas
kernels' tuning; `BlockKernels`, which kernel runs each part of block selection;
`Index`, a learned indexer's inputs with `selection="indexer"`), the Flax NNX module `HTreeAttention` (linen twin:
`htree_jax.linen.HTreeAttention`), `attention_fn` for `nnx.MultiHeadAttention` /
`nn.MultiHeadDotProductAttention`, and incremental decoding: `init_cache`, `prefill`,
`decode_step`, `reset_rows` (`HTreeCache`; `DecodeBlockSizes`, the decode kernels'
tuning), `rope`, the rotation htree applies (its convention), `memory_plan`
(`MemoryPlan`), one device's memory for a call, from XLA's plan, before running it, and
`compile_checked`, any jitted step compiled and checked against the devices' free memory.
The function they compute is stated in `docs/SPEC.md` ("SPEC n" in the code cites its
section n).

Layers, each importing only those below it (docs/CONTRIBUTING.md, "Layout"):
  public API    attention, cache, decode, module, linen, flax_attention, sharding, memory
  backends      backends: the backend rule, `choose_route`, `attend` and `attend_cache`;
                routes: the route table (each route's call, forward and backward)
  implementations  reference (JAX), `pallas_kernels` (a folder per kernel family)
  core          htree_jax.core: config, validation, index arithmetic, RoPE, tree, packing, bounds

The names are loaded on first use, so that `import pallas_kernels.gqa.forward` (which stands
on `htree_jax.core`) loads neither Flax nor the API modules.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
    "BlockKernels": "pallas_kernels.shared.kernels",
    "BlockSizes": "pallas_kernels.shared.configs",
    "DecodeBlockSizes": "pallas_kernels.shared.configs",
    "HTreeAttention": "htree_jax.module",
    "HTreeCache": "htree_jax.cache",
    "HTreeConfig": "htree_jax.core.config",
    "Index": "htree_jax.core.indexer",
    "IndexLoss": "htree_jax.module",
    "IndexerConfig": "htree_jax.core.indexer",
    "MemoryPlan": "htree_jax.memory",
    "attention_fn": "htree_jax.flax_attention",
    "build_tree": "htree_jax.core.tree",
    "compile_checked": "htree_jax.memory",
    "decode_step": "htree_jax.decode",
    "htree_attention": "htree_jax.attention",
    "init_cache": "htree_jax.cache",
    "memory_plan": "htree_jax.memory",
    "prefill": "htree_jax.decode",
    "reset_rows": "htree_jax.cache",
    "rope": "htree_jax.core.rope",
}
# Submodules reachable as attributes after `import htree_jax` (e.g. `htree_jax.linen`).
_SUBMODULES = ("attention", "backends", "bench", "cache", "core", "decode", "demo", "flax_attention", "introspect", "linen",
               "memory", "module", "reference", "routes", "sharding")

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'htree_jax' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))


if TYPE_CHECKING:  # what type checkers and IDEs see
    from htree_jax.attention import htree_attention
    from htree_jax.core.config import HTreeConfig
    from htree_jax.core.indexer import Index, IndexerConfig
    from htree_jax.core.rope import rope
    from htree_jax.core.tree import build_tree
    from htree_jax.cache import HTreeCache, init_cache, reset_rows
    from htree_jax.decode import decode_step, prefill
    from htree_jax.flax_attention import attention_fn
    from htree_jax.module import HTreeAttention, IndexLoss
    from pallas_kernels.shared.configs import BlockSizes, DecodeBlockSizes
    from pallas_kernels.shared.kernels import BlockKernels
