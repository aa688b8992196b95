"""The float64 NumPy oracle of htree attention (see `htree_numpy`)."""

from reference_numpy.htree_numpy import build_tree_numpy, htree_attention_numpy, trace_query

__all__ = ["build_tree_numpy", "htree_attention_numpy", "trace_query"]
