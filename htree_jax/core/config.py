"""`HTreeConfig`: the static parameters of htree attention (SPEC.md, "Shapes and names")."""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import numpy as np

IMPORTANCE_MODES = ("softmax", "shared_max")
SELECTION_RULES = ("mean", "bound", "indexer")
BLOCK_SOURCES = ("first", "previous")
# SPEC 2.3: the rightmost candidate's importance, above every possible importance (<= G).
FORCED_IMPORTANCE = 1e6


def _is_power_of_two(x: int) -> bool:
    return x >= 1 and (x & (x - 1)) == 0


def _is_int(x) -> bool:
    """Python and NumPy integers; not bools (a `True` top_k is a mistake, not a 1)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class HTreeConfig:
    """Static configuration of htree attention.

    Frozen and hashable, so it can be passed as a static argument to `jax.jit`; and a
    pytree with no leaves, so `jax.jit(htree_attention)(q, k, v, config)` also works.

    Attributes:
      compression_rate: children per tree node (`r`), a power of two >= 2.
      top_k: nodes kept for refinement per layer (`k_top`), a power of two >= 1.
      rope_base: base of the rotate-half RoPE that htree applies itself.
      scale: score scale `alpha`; `None` means `K ** -0.5`.
      importance: `"softmax"` (per-head normalised, NSA's rule, the default) or
        `"shared_max"` (one running max over the group, the upstream Triton rule).
      strict_causal: leave the rightmost node out of the importance normaliser
        (SPEC section 2.3). With `True` (the default) the output at `t` depends on
        no token after `t`, so prefix runs and token-by-token decoding agree with
        the full-sequence output exactly. With `False` the rightmost node of an
        upper layer, a mean that includes tokens after `t`, enters the normaliser,
        so changing future keys can change which nodes are selected, and hence
        `o[t]` (tested in `tests/test_properties.py`).
      rope_dim: RoPE on the last `rope_dim` features of q and k only (SPEC 7; the
        layout of multi-head latent attention, `[q_nope, q_pe]`), with angles
        `rope_base^(-2i/rope_dim)`; the others enter the dot product unrotated. Even,
        `0 < rope_dim <= K` (checked against K at the call); `None`: all of K.
      selection: how a layer ranks its candidates for refinement (SPEC 11). `"bound"`
        (the default): by an upper bound of what any token under the node could score
        (the score plus `alpha` times the query's feature-group norms against the
        node's radii), which finds the one strong token a mean dilutes: a model trained
        with dense attention keeps its recall under htree (RESULTS, selection transfer).
        `"mean"`, the original rule: by their mean keys' scores. The merge uses the mean
        keys' scores either way. Every backend, full sequences and decoding.
        `"indexer"` (SPEC 13): by a learned indexer's scores, the caller's
        `htree_jax.Index(q, k, w)` given with the call; SPEC 13's KL loss trains it. The
        JAX reference only for now (full sequences, one document a row; with block
        selection `block_source="first"`).
      selection_block: `compression_rate` (block selection, SPEC 12: the queries of one
        bottom node share one selection at every layer, ranked by `block_source`'s rows)
        or `1` (each query selects for itself). `None` (the default) is
        `compression_rate`, except with `rope_dim` set (latent attention's layout), where
        it is `1`: block selection's kernels take heads of up to 256 features, and
        latent attention's 576 run on the per-query wide kernels, whose 128 heads a kv
        head already share one gather a query (docs/latent_attention.md). The value is
        resolved here, so `HTreeConfig().selection_block == 16`. Every backend (the JAX
        reference and the kernels) takes both: full sequences, packed rows, shards and
        decoding (docs/backends.md says which kernels run).
      block_source: with `selection_block > 1`, whose queries rank the block's
        candidates: `"first"` (the block's first query) or `"previous"` (the previous
        block's queries, their importance summed). Causal either way (SPEC 12).
    """

    compression_rate: int = 16
    top_k: int = 512
    rope_base: float = 10000.0
    scale: float | None = None
    importance: str = "softmax"
    strict_causal: bool = True
    rope_dim: int | None = None
    selection: str = "bound"
    selection_block: int | None = None
    block_source: str = "first"

    def __post_init__(self):
        # NumPy scalars are numbers too (`np.int64(4)`, `np.float32(1e4)`); each field is
        # stored as the plain Python type, so equal configs hash equally under `jax.jit`.
        r, k = self.compression_rate, self.top_k
        if not _is_int(r) or r < 2 or not _is_power_of_two(int(r)):
            raise ValueError(f"compression_rate must be a power of two >= 2, got {r!r}")
        if not _is_int(k) or not _is_power_of_two(int(k)):
            raise ValueError(f"top_k must be a positive power of two, got {k!r}")
        base = self.rope_base
        if not _is_real(base) or not (math.isfinite(base) and base > 0):
            raise ValueError(f"rope_base must be a positive finite number, got {base!r}")
        if self.scale is not None:
            s = self.scale
            if not _is_real(s) or not (math.isfinite(s) and s > 0):
                raise ValueError(f"scale must be None or a positive finite number, got {s!r}")
        for name, value in (("compression_rate", int(r)), ("top_k", int(k)), ("rope_base", float(base)),
                            ("scale", None if self.scale is None else float(self.scale))):
            object.__setattr__(self, name, value)
        if self.importance not in IMPORTANCE_MODES:
            raise ValueError(
                f"importance must be one of {IMPORTANCE_MODES}, got {self.importance!r}"
            )
        if self.selection not in SELECTION_RULES:
            raise ValueError(f"selection must be one of {SELECTION_RULES}, got {self.selection!r}")
        b = self.selection_block
        if b is None:  # the default: by block, per query in latent attention's layout
            b = 1 if self.rope_dim is not None else int(r)
        if not _is_int(b) or int(b) not in (1, int(r)):
            hint = ("; if it came from dataclasses.replace, which keeps the old config's selection_block, pass "
                    "selection_block=None for the default" if _is_int(b) and int(b) > 1 and _is_power_of_two(int(b))
                    else "")
            raise ValueError(f"selection_block must be 1 or compression_rate (= {int(r)}): the queries of one bottom "
                             f"node share a selection (SPEC 12), got {b!r}{hint}")
        object.__setattr__(self, "selection_block", int(b))
        if self.block_source not in BLOCK_SOURCES:
            raise ValueError(f"block_source must be one of {BLOCK_SOURCES}, got {self.block_source!r}")
        if self.selection == "indexer" and self.selection_block > 1 and self.block_source != "first":
            raise ValueError("selection='indexer' with block selection ranks with the block's first query "
                             f"(SPEC 13): block_source must be 'first', got {self.block_source!r}")
        R = self.rope_dim
        if R is not None:
            if not _is_int(R) or int(R) <= 0 or int(R) % 2:
                raise ValueError(f"rope_dim must be None or a positive even int (features rotated), got {R!r}")
            object.__setattr__(self, "rope_dim", int(R))
        if not isinstance(self.strict_causal, bool):
            raise ValueError(f"strict_causal must be a bool, got {self.strict_causal!r}")
        if self.max_candidates > 2**24:
            # Candidate positions are packed into the low bits of a float32 importance.
            raise ValueError(
                "top_k * compression_rate must be at most 2**24, got "
                f"{self.top_k} * {self.compression_rate} = {self.max_candidates}"
            )

    @property
    def max_candidates(self) -> int:
        """`M = top_k * compression_rate`: the static length of a candidate buffer."""
        return self.top_k * self.compression_rate

    @property
    def ranks_by_bound(self) -> bool:
        """`selection="bound"`: a layer ranks its candidates by the bound scores (SPEC 11)."""
        return self.selection == "bound"

    @property
    def selects_by_block(self) -> bool:
        """`selection_block > 1`: a bottom node's queries share one selection (SPEC 12)."""
        return self.selection_block > 1

    @property
    def log_n(self) -> int:
        """Bits of the packed importance that hold the candidate position: `log2(M)`."""
        return self.max_candidates.bit_length() - 1

    def layer_sizes(self, seq_len: int) -> tuple[int, ...]:
        """Node counts `(N_0, ..., N_{L-1})`, bottom first: `N_0 = T`, and while
        `N_l > M`, `N_{l+1} = ceil(N_l / r)`."""
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        sizes = [seq_len]
        while sizes[-1] > self.max_candidates:
            sizes.append(-(-sizes[-1] // self.compression_rate))
        return tuple(sizes)

    def num_layers(self, seq_len: int) -> int:
        """`L`, the number of tree layers for a sequence of `seq_len` tokens."""
        return len(self.layer_sizes(seq_len))

    def check_rope_dim(self, head_dim: int) -> None:
        """`rope_dim <= K` (SPEC 7), before any work."""
        if self.rope_dim is not None and self.rope_dim > head_dim:
            raise ValueError(f"rope_dim must be at most the head dim K = {head_dim}, got {self.rope_dim}")

    def partial_rope(self, head_dim: int) -> int | None:
        """`rope_dim` where it rotates fewer than all `K` features, else None."""
        return self.rope_dim if self.rope_dim is not None and self.rope_dim < head_dim else None

    def score_scale(self, head_dim: int) -> float:
        """`alpha`: `scale`, or `head_dim ** -0.5` when `scale` is None."""
        return float(head_dim) ** -0.5 if self.scale is None else float(self.scale)
