"""Block selection's decode step in one launch (SPEC 12, decoding): a token inside a
block keeps the block's selection of every layer above 0 (`HTreeCache.selections`),
so nothing is left to choose and every layer's candidates are known before any is
scored. One program per `(b, h_kv, split)` walks its share of every layer's candidate
buffer, top down, scoring and folding the candidates the layer does not keep into one
partial softmax state (`shared/softmax.py`); the splits' states are combined in XLA.

The per-layer decode walk (`walk.py` with `chosen`) does the same in two launches a
layer and a few XLA ops between them; this kernel takes the shapes most caches have
(`kept_merge_dims`): up to 16 heads a kv head, full RoPE, `K / 2` and `V` powers of two
up to 128 and 256 (float32: 64 and 128), no FP8 tokens, values of their own. Others take
the walk.

Layouts:
  q        `[B, H_kv, Gp, K]`  the step's query rows, un-rotated, `Gp = max(16, G)` padded
  t        `[B, 1]` int32      each row's position
  kept     `[B, H_kv, width]`  per layer above 0 (top first), ascending, `PAST_NODES` after
  layers   keys `[B, N_l, H_kv, K]`, values `[B, N_l, H_kv, V]` (the cache's, bottom first)
  cos, sin `[rows, K/2]` float32, RoPE at buffer positions `0 .. rows - 1`
  partial  m, S `[B, H_kv, splits, Gp]`, U `[B, H_kv, splits, Gp, V]` float32
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from htree_jax.core.config import HTreeConfig
from htree_jax.core.indexing import candidate_count, num_top_parents
from htree_jax.core.rope import rope_table
from pallas_kernels.shared.common import KERNEL_GROUP, NEG_INF, compiler_params, next_power_of_two, pad_axis
from pallas_kernels.shared.configs import DecodeBlockSizes
from pallas_kernels.shared.softmax import combine, fold

# A kept list's padding: above every node index, and `r` times it still an int32.
PAST_NODES = 1 << 26
MAX_HALF, MAX_VALUE = 128, 256


@dataclasses.dataclass(frozen=True)
class KeptStatic:
    """What one launch is compiled for: `span` candidates a step (a multiple of `r`),
    `splits` programs sharing each layer's buffer, `width` a kept list's padded length
    (`top_k + span`, a power of two), `exact`: float32 dots in full precision,
    `num_stages` the candidate loop's pipeline stages."""

    r: int
    top_k: int
    num_layers: int
    group: int
    half: int
    vp: int
    span: int
    splits: int
    width: int
    alpha: float
    exact: bool
    num_warps: int
    num_stages: int


def kept_merge_dims(config: HTreeConfig, G: int, K: int, V: int, dtype, fp8: bool, values_from_keys: bool) -> bool:
    """Whether the one-launch step takes the shape (else the per-layer walk does). Float32
    caches up to K = V = 128: the widest the GPU gate has run it at (its float32 block
    cases); 16-bit ones up to 256."""
    pow2 = lambda x: x >= 16 and x & (x - 1) == 0
    half, value = (MAX_HALF, MAX_VALUE) if jnp.dtype(dtype).itemsize <= 2 else (MAX_HALF // 2, MAX_VALUE // 2)
    return (G <= KERNEL_GROUP and config.partial_rope(K) is None and pow2(K // 2) and K // 2 <= half
            and pow2(V) and V <= value and not fp8 and not values_from_keys)


def _dot(a, b, st: KeptStatic, dtype, contract_last: bool):
    """`a @ b^T` (`contract_last`) or `a @ b` in float32: float32 operands exact, else
    rounded to the inputs' dtype for the tensor cores."""
    if not st.exact:
        a, b = a.astype(dtype), b.astype(dtype)
    dims = (((1,), (1,)), ((), ())) if contract_last else (((1,), (0,)), ((), ()))
    precision = lax.Precision.HIGHEST if st.exact else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _kept_merge_kernel(q_ref, t_ref, cos_ref, sin_ref, *refs, st: KeptStatic):
    L, r, C, h = st.num_layers, st.r, st.span, st.half
    kept_refs = refs[: L - 1]  # top layer's first
    layer_refs = refs[L - 1: L - 1 + 2 * L]  # bottom first: keys, values
    m_ref, s_ref, u_ref = refs[L - 1 + 2 * L:]
    split, dtype, t = pl.program_id(2), q_ref.dtype, t_ref[0]
    q_lo = q_ref[:, pl.ds(0, h)].astype(jnp.float32)
    q_hi = q_ref[:, pl.ds(h, h)].astype(jnp.float32)
    state = (jnp.full((st.group,), NEG_INF, jnp.float32), jnp.zeros((st.group,), jnp.float32),
             jnp.zeros((st.group, st.vp), jnp.float32))

    for l in reversed(range(L)):
        k_ref, v_ref = layer_refs[2 * l], layer_refs[2 * l + 1]
        parents = None if l == L - 1 else kept_refs[L - 2 - l]  # the kept nodes of layer l + 1
        kept = None if l == 0 else kept_refs[L - 1 - l]
        if parents is None:  # SPEC 2: virtual parents 0 .. floor(i*/r)
            n_parents = num_top_parents(t, r, L)
        else:
            n_parents = jnp.sum((parents[pl.ds(0, st.top_k)] < PAST_NODES).astype(jnp.int32))
        n = candidate_count(n_parents, t, r, l)
        # The query once per layer by n - 1, each key by its buffer position (SPEC 2.2).
        cq, sq = cos_ref[pl.ds(n - 1, 1), :], sin_ref[pl.ds(n - 1, 1), :]
        qr = (q_lo * cq - q_hi * sq, q_lo * sq + q_hi * cq)
        tiles = (n + C - 1) // C
        per = (tiles + st.splits - 1) // st.splits
        first, last = split * per, jnp.minimum(split * per + per, tiles)

        def node_of(p, parents=parents):
            return p if parents is None else parents[jnp.minimum(p // r, st.top_k - 1)] * r + p % r

        # The kept entries before this split's first candidate: where its window starts.
        seen = jnp.int32(0)
        if kept is not None:
            seen = jnp.sum((kept[...] < node_of(jnp.minimum(first * C, jnp.maximum(n - 1, 0)))).astype(jnp.int32))

        def fold_tile(i, carry, k_ref=k_ref, v_ref=v_ref, kept=kept, n=n, node_of=node_of):
            state, seen = carry
            p = i * C + jnp.arange(C, dtype=jnp.int32)
            valid = p < n
            nodes = jnp.where(valid, node_of(p), 0)
            k_lo = k_ref[nodes, pl.ds(0, h)].astype(jnp.float32)
            k_hi = k_ref[nodes, pl.ds(h, h)].astype(jnp.float32)
            c, s = cos_ref[pl.ds(i * C, C), :], sin_ref[pl.ds(i * C, C), :]
            kr = (k_lo * c - k_hi * s, k_lo * s + k_hi * c)
            scores = st.alpha * (_dot(qr[0], kr[0], st, dtype, True) + _dot(qr[1], kr[1], st, dtype, True))
            merged = valid
            if kept is not None:  # the kept nodes are the next entries of the sorted list
                window = kept[pl.ds(seen, C)]
                hits = jnp.sum((nodes[:, None] == window[None, :]).astype(jnp.int32), axis=1)
                seen = seen + jnp.sum((window <= jnp.max(jnp.where(valid, nodes, -1))).astype(jnp.int32))
                merged = valid & (hits == 0)
            scores = jnp.where(merged[None, :], scores, NEG_INF)
            weighted = lambda w: _dot(w, v_ref[nodes, :], st, dtype, False)
            return fold(state, [(scores, weighted)]), seen

        state, _ = lax.fori_loop(first, last, fold_tile, (state, seen))

    m, total, acc = state
    m_ref[...] = m
    s_ref[...] = total
    u_ref[...] = acc


def kept_static(config: HTreeConfig, dtype, B: int, H_kv: int, G: int, K: int, V: int, num_layers: int,
                block_sizes: DecodeBlockSizes) -> KeptStatic:
    """The launch for `B` rows of `H_kv` kv heads: `DecodeBlockSizes.span` candidates a
    step (at least 16 and `r`, at most the buffer), splits until `B * H_kv * splits`
    reaches `target_programs` (at most one tile a split), `kept_num_stages` stages."""
    r = config.compression_rate
    M = config.max_candidates
    span = max(16, r, min(next_power_of_two(block_sizes.span), next_power_of_two(M)))
    tiles = -(-M // span)
    splits = min(next_power_of_two(max(1, block_sizes.target_programs // (B * H_kv))), next_power_of_two(tiles))
    return KeptStatic(r=r, top_k=config.top_k, num_layers=num_layers, group=max(KERNEL_GROUP, next_power_of_two(G)),
                      half=K // 2, vp=V, span=span, splits=splits,
                      width=next_power_of_two(config.top_k + span), alpha=config.score_scale(K),
                      exact=jnp.dtype(dtype) == jnp.float32, num_warps=block_sizes.num_warps,
                      num_stages=block_sizes.kept_num_stages)


def kept_lists(kept, st: KeptStatic):
    """The cache's kept nodes `[B, H_kv, top_k]` (`-1` padded) as the kernel reads them:
    `PAST_NODES` for `-1` and after, `st.width` long."""
    kept = jnp.where(kept < 0, PAST_NODES, kept).astype(jnp.int32)
    return jnp.pad(kept, ((0, 0), (0, 0), (0, st.width - kept.shape[-1])), constant_values=PAST_NODES)


@functools.partial(jax.jit, static_argnames=("config", "block_sizes", "interpret"))
def kept_step_pallas(q, keys, values, positions, kept, config: HTreeConfig,
                     block_sizes: DecodeBlockSizes = DecodeBlockSizes(), interpret: bool = False):
    """One token a row inside its block: `q [B, H, K]` (un-rotated, rope layout) at
    `positions [B]` over the cache's `keys`, `values` (per layer, bottom first),
    keeping `kept` (the cache's selections: per layer above 0, top first, `[B, H_kv,
    top_k]`). Returns `o [B, H, V]` in q's dtype: what the walk with those selections
    gives (`walk.attend_cache_pallas(..., chosen=...)`). Shapes as `kept_merge_dims`."""
    B, H, K = q.shape
    H_kv, V, L = keys[0].shape[2], values[0].shape[-1], len(keys)
    G = H // H_kv
    st = kept_static(config, q.dtype, B, H_kv, G, K, V, L, block_sizes)
    gp = st.group
    rows = -(-config.max_candidates // st.span) * st.span
    cos, sin = (jnp.asarray(a) for a in rope_table(rows, K, float(config.rope_base), None))
    q4 = pad_axis(q.reshape(B, H_kv, G, K), 2, gp)
    t = positions.astype(jnp.int32).reshape(B, 1)
    lists = [kept_lists(x, st) for x in kept]
    layer_specs = [pl.BlockSpec((None, x.shape[1], None, x.shape[-1]), lambda b, h, s: (b, 0, h, 0))
                   for kl, vl in zip(keys, values) for x in (kl, vl)]
    vec = pl.BlockSpec((None, None, None, gp), lambda b, h, s: (b, h, s, 0))
    m, total, acc = pl.pallas_call(
        functools.partial(_kept_merge_kernel, st=st),
        grid=(B, H_kv, st.splits),
        in_specs=[pl.BlockSpec((None, None, gp, K), lambda b, h, s: (b, h, 0, 0)),
                  pl.BlockSpec((None, 1), lambda b, h, s: (b, 0)),
                  pl.BlockSpec((rows, K // 2), lambda b, h, s: (0, 0)),
                  pl.BlockSpec((rows, K // 2), lambda b, h, s: (0, 0))]
                 + [pl.BlockSpec((None, None, st.width), lambda b, h, s: (b, h, 0))] * len(lists) + layer_specs,
        out_specs=[vec, vec, pl.BlockSpec((None, None, None, gp, V), lambda b, h, s: (b, h, s, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, H_kv, st.splits, gp), jnp.float32)] * 2
                  + [jax.ShapeDtypeStruct((B, H_kv, st.splits, gp, V), jnp.float32)],
        compiler_params=compiler_params(st.num_warps, st.num_stages),
        interpret=interpret,
    )(q4, t, cos, sin, *lists, *[x for kl, vl in zip(keys, values) for x in (kl, vl)])
    empty = (jnp.full((B, H_kv, gp), NEG_INF, jnp.float32), jnp.zeros((B, H_kv, gp), jnp.float32),
             jnp.zeros((B, H_kv, gp, V), jnp.float32))
    _, total, acc = combine(empty, (m, total, acc))
    o = acc / total[..., None]
    return o[:, :, :G].reshape(B, H, V).astype(q.dtype)


__all__ = ["kept_merge_dims", "kept_step_pallas"]
