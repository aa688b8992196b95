"""htree-jax: hierarchical sparse (htree) attention for JAX and Flax.

Public API: `HTreeConfig`, `build_tree`, `htree_attention`.
"""

from htree_jax.attention import htree_attention
from htree_jax.config import HTreeConfig
from htree_jax.tree import build_tree

__version__ = "0.1.0"

__all__ = ["HTreeConfig", "build_tree", "htree_attention", "__version__"]
