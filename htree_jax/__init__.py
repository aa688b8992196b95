"""htree-jax: hierarchical sparse (htree) attention for JAX and Flax.

Public API: `HTreeConfig`, `build_tree`, `htree_attention`, the Flax NNX module
`HTreeAttention` (linen twin: `htree_jax.linen.HTreeAttention`), and `attention_fn` for
`nnx.MultiHeadAttention` / `nn.MultiHeadDotProductAttention`, and incremental decoding:
`init_cache`, `prefill`, `decode_step` (`HTreeCache`).
"""

from htree_jax.attention import htree_attention
from htree_jax.config import HTreeConfig
from htree_jax.decode import HTreeCache, decode_step, init_cache, prefill, reset_rows
from htree_jax.flax_attention import attention_fn
from htree_jax.module import HTreeAttention
from htree_jax.tree import build_tree

__version__ = "0.1.0"

__all__ = [
    "HTreeAttention", "HTreeCache", "HTreeConfig", "attention_fn", "build_tree", "decode_step",
    "htree_attention", "init_cache", "prefill", "reset_rows", "__version__",
]
