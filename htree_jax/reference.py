"""The jittable JAX reference of htree attention: SPEC section 2 with static shapes.

One query `(b, t, h_kv)` walks the tree top-down with a parent list `[top_k]` padded
with `-1` and a candidate buffer of `M = top_k * compression_rate` positions, position
`p = s*r + c` holding node `parents[s]*r + c`. The same step runs for every layer,
including the top one, whose (virtual) parents are `0 .. floor(i*_{L-1} / r)`.
Queries are processed in chunks of `query_chunk` positions (`lax.map`), so the
`[chunk, M, K]` gathers are the only large intermediates.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from htree_jax.config import HTreeConfig
from htree_jax.rope import apply_rope, rope_table
from htree_jax.tree import build_tree

FORCED_IMPORTANCE = 1e6  # SPEC 2.3: above every possible importance (<= G)
# Small chunks stay cache-resident: 64 MiB ran 2.1x faster than 1 GiB on 2 CPU cores.
DEFAULT_CHUNK_BUDGET_BYTES = 64 << 20


def chunk_bytes_per_query(config: HTreeConfig, batch, num_kv_heads, group, head_dim, value_dim):
    """Bytes of per-layer intermediates for one query position (all batch rows, kv heads).

    Per `(b, t, h_kv)` the layer step holds float32/int32 arrays: the gathered keys and
    values (`M * (K + V)`), the query rotated once per parent slot (`top_k * G * K`),
    scores, weights and their masked copies (`4 * G * M`), and node indices, masks and
    packed keys (`6 * M`).
    """
    M = config.max_candidates
    per_head = M * (head_dim + value_dim + 4 * group + 6) + config.top_k * group * head_dim
    return 4 * per_head * batch * num_kv_heads


def default_query_chunk(config, batch, seq_len, num_kv_heads, group, head_dim, value_dim,
                        budget_bytes=DEFAULT_CHUNK_BUDGET_BYTES):
    per_query = chunk_bytes_per_query(config, batch, num_kv_heads, group, head_dim, value_dim)
    return int(max(1, min(seq_len, budget_bytes // per_query)))


def pack_importance(importance, positions, log_n):
    """SPEC 2.3 stable order: float32 bits, low `log_n` bits replaced by `~p`, as int32.

    Keys compare as integers (order-preserving for importance >= 0, and immune to
    denormal flushing); ties in the kept high bits go to the smaller position.
    """
    mask = (1 << log_n) - 1
    bits = lax.bitcast_convert_type(importance.astype(jnp.float32), jnp.int32)
    return (bits & ~mask) | (mask - positions)


def importance(scores, in_norm, mode):
    """Group importance (SPEC 2.3). `scores [C, G, M]` float32, `in_norm [C, M]` (the
    set R) -> `[C, M]`; 0 where R is empty. Only positions in R are meaningful; the
    caller forces the rightmost and masks invalid ones."""
    has_norm = jnp.any(in_norm, axis=-1, keepdims=True)  # [C, 1]
    s_r = jnp.where(in_norm[:, None, :], scores, -jnp.inf)
    if mode == "softmax":
        mx = jnp.max(s_r, axis=-1, keepdims=True)  # [C, G, 1]
        mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
        lse = mx + jnp.log(jnp.sum(jnp.exp(s_r - mx), axis=-1, keepdims=True))
        imp = jnp.sum(jnp.exp(s_r - lse), axis=1)
    elif mode == "shared_max":
        mx = jnp.max(s_r, axis=(1, 2), keepdims=True)  # [C, 1, 1]
        mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
        imp = jnp.sum(jnp.exp(s_r - mx), axis=1)
    else:
        raise ValueError(f"unknown importance mode {mode!r}")
    return jnp.where(has_norm, imp, 0.0)


def candidate_count(num_parents, t, r: int, layer: int):
    """SPEC 2.1: valid candidates `n = (n_P - 1) * r + c* + 1`, with `c* = (t // r^l) mod r`.

    Plain arithmetic, so it serves NumPy and JAX arrays alike (any broadcastable shapes).
    """
    return (num_parents - 1) * r + (t // r**layer) % r + 1


def select_top_k(importance_keys, valid, nodes, top_k, max_candidates):
    """Shared top-K on packed keys. `importance_keys, valid, nodes`: `[C, M]`.

    Returns `(selected [C, M] bool, next_parents [C, top_k] int32)`: the
    `min(top_k, n)` valid positions with the largest keys, and their node indices
    ascending, `-1` padded. Nodes increase with buffer position, so sorting the
    selected positions sorts the nodes.
    """
    keys = jnp.where(valid, importance_keys, -1)
    top_keys, _ = lax.top_k(keys, top_k)  # descending; -1 where fewer than top_k valid
    selected = valid & (keys >= top_keys[:, -1:])
    mask = max_candidates - 1
    positions = jnp.where(top_keys >= 0, mask - (top_keys & mask), max_candidates)
    positions = jnp.sort(positions, axis=-1)
    picked = jnp.take_along_axis(nodes, jnp.minimum(positions, mask), axis=-1)
    return selected, jnp.where(positions < max_candidates, picked, -1)


def merge(state, scores, values, merged):
    """Online-softmax fold of the merged candidates into `(m, S, U)`.

    `state`: `m, S [C, G]`, `U [C, G, V]`; `scores [C, G, M]`; `values [C, M, V]`;
    `merged [C, M]`. A layer with nothing merged leaves the state as it is.
    """
    m, S, U = state
    s_m = jnp.where(merged[:, None, :], scores, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s_m, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    w = jnp.exp(s_m - m_safe[..., None])
    decay = jnp.exp(m - m_safe)
    S = S * decay + jnp.sum(w, axis=-1)
    U = U * decay[..., None] + jnp.einsum("cgm,cmv->cgv", w, values, precision=lax.Precision.HIGHEST)
    return m_new, S, U


def _walk_one_head(q, t, layers, config: HTreeConfig, alpha, keys_rotated: bool = True):
    """All layers for one `(b, h_kv)` and a chunk of positions.

    `q [C, G, K]`, `t [C]` int32, `layers [(K_l [N_l, K], V_l [N_l, V]), ...]` bottom
    first, the keys rotated by child offset (`rotate_by_child_offset`), or as stored
    with `keys_rotated=False` (then the gathered candidates are rotated, the same
    float32 arithmetic: what decoding does, rather than rotate a whole cache per step).
    Returns `o [C, G, V]` float32 and the selected node lists of layers
    `L-1 .. 1`, each `[C, top_k]` int32.
    """
    r, k_top, M = config.compression_rate, config.top_k, config.max_candidates
    L = len(layers)
    C, G, K = q.shape
    Vd = layers[0][1].shape[-1]
    cos, sin = (jnp.asarray(a) for a in rope_table(M, K, float(config.rope_base)))
    p = jnp.arange(M, dtype=jnp.int32)
    slot, child = p // r, p % r
    # RoPE is relative: <rope(q, n-1), rope(k, s*r + c)> = <rope(q, n-1-s*r), rope(k, c)>,
    # and c = node mod r. So each layer's keys are rotated once by their child offset
    # and each query once per parent slot, instead of rotating M gathered keys per query.
    slot_offset = jnp.arange(k_top, dtype=jnp.int32) * r  # [k_top]
    if not keys_rotated:
        table = rope_table(r, K, float(config.rope_base))
        child_cos, child_sin = (jnp.asarray(a[np.arange(M) % r]) for a in table)

    top_parents = jnp.arange(k_top, dtype=jnp.int32)
    last_top_parent = t // (r ** (L - 1)) // r
    parents = jnp.where(top_parents[None, :] <= last_top_parent[:, None], top_parents[None, :], -1)

    state = (
        jnp.full((C, G), -jnp.inf, jnp.float32),
        jnp.zeros((C, G), jnp.float32),
        jnp.zeros((C, G, Vd), jnp.float32),
    )
    q = q.astype(jnp.float32)
    selections = []
    for l in reversed(range(L)):
        K_l, V_l = layers[l]
        n = candidate_count(jnp.sum(parents >= 0, axis=-1), t, r, l)  # [C]
        nodes = parents[:, slot] * r + child[None, :]  # [C, M]
        valid = p[None, :] < n[:, None]
        safe_nodes = jnp.where(valid, nodes, 0)
        gathered = K_l[safe_nodes]  # [C, M, K]
        if not keys_rotated:
            gathered = apply_rope(gathered.astype(jnp.float32), child_cos, child_sin)
        keys_by_slot = gathered.reshape(C, k_top, r, K)  # rotated by child offset
        rel = (n - 1)[:, None] - slot_offset[None, :]  # [C, k_top], may be negative
        sign = jnp.where(rel < 0, -1.0, 1.0)[..., None, None]
        q_rot = apply_rope(q[:, None], cos[jnp.abs(rel)][:, :, None], sign * sin[jnp.abs(rel)][:, :, None])
        scores = alpha * jnp.einsum(
            "qsgk,qsck->qgsc", q_rot, keys_by_slot, precision=lax.Precision.HIGHEST
        ).reshape(C, G, M)
        if l > 0:
            rightmost = p[None, :] == (n - 1)[:, None]
            in_norm = valid & ~rightmost if config.strict_causal else valid
            # Selection is a discrete choice: no gradient flows through it.
            imp = importance(lax.stop_gradient(scores), in_norm, config.importance)
            imp = jnp.where(rightmost, FORCED_IMPORTANCE, imp)
            keys = pack_importance(imp, p[None, :], config.log_n)
            selected, parents = select_top_k(keys, valid, nodes, k_top, M)
            merged = valid & ~selected
            selections.append(parents)
        else:
            merged = valid
        values = V_l[safe_nodes].astype(jnp.float32)
        state = merge(state, scores, values, merged)
    _, S, U = state
    return U / S[..., None], selections


def rotate_by_child_offset(layer_keys, config: HTreeConfig):
    """`K_l [B, N, H_kv, K]` -> float32 keys rotated by RoPE at `j mod r` (node `j`)."""
    N, K = layer_keys.shape[1], layer_keys.shape[-1]
    r = config.compression_rate
    cos, sin = rope_table(r, K, float(config.rope_base))
    child = np.arange(N) % r
    return apply_rope(
        layer_keys.astype(jnp.float32),
        jnp.asarray(cos[child])[None, :, None, :],
        jnp.asarray(sin[child])[None, :, None, :],
    )


@functools.partial(jax.jit, static_argnames=("config", "query_chunk"))
def _forward(q, k, v, config: HTreeConfig, query_chunk: int):
    layers = build_tree(k, v, config)
    layers = [(rotate_by_child_offset(kl, config), vl) for kl, vl in layers]
    return attend_tree(q, layers, jnp.arange(q.shape[1], dtype=jnp.int32), config, query_chunk)


def attend_tree(q, layers, positions, config: HTreeConfig, query_chunk: int, keys_rotated: bool = True):
    """Queries `q [B, S, H, K]` at token positions `positions [S]` (int32, may be traced)
    walk the tree `layers` (bottom first, `[B, N_l, H_kv, *]`; keys as `_walk_one_head`
    takes them). Returns `(o [B, S, H, V] in q.dtype, selections)`.

    The tree may hold more tokens than `positions` reach (a decode cache sized for
    `max_len`): by strict causality (SPEC 3) nothing after a query changes its output."""
    B, S, H, K = q.shape
    H_kv = layers[0][0].shape[2]
    G = H // H_kv
    alpha = config.score_scale(K)
    C = query_chunk
    num_chunks = -(-S // C)
    q5 = q.reshape(B, S, H_kv, G, K)
    padded = jnp.concatenate([positions, jnp.broadcast_to(positions[-1], (num_chunks * C - S,))])
    if num_chunks * C != S:
        q5 = jnp.pad(q5, ((0, 0), (0, num_chunks * C - S), (0, 0), (0, 0), (0, 0)))

    # vmap over batch (axis 0 of everything) then kv heads (axis 2 of q5, the layers).
    per_head = jax.vmap(
        lambda qh, t, lay: _walk_one_head(qh, t, lay, config, alpha, keys_rotated), in_axes=(1, None, 1)
    )
    per_batch = jax.vmap(per_head, in_axes=(0, None, 0))

    def chunk(i):
        qc = lax.dynamic_slice_in_dim(q5, i * C, C, axis=1)  # [B, C, H_kv, G, K]
        t = lax.dynamic_slice_in_dim(padded, i * C, C)
        return per_batch(qc, t, layers)  # o [B, H_kv, C, G, V], sels [B, H_kv, C, k_top]

    # Rematerialised under autodiff: the backward keeps only each chunk's inputs, not its
    # [chunk, M, K] gathers, so gradient memory is bounded by the same chunking.
    o, sels = lax.map(jax.checkpoint(chunk), jnp.arange(num_chunks, dtype=jnp.int32))
    # o: [chunks, B, H_kv, C, G, V] -> [B, S, H, V]
    o = jnp.transpose(o, (1, 0, 3, 2, 4, 5)).reshape(B, num_chunks * C, H, -1)[:, :S]
    sels = [jnp.transpose(s, (1, 0, 3, 2, 4)).reshape(B, num_chunks * C, H_kv, -1)[:, :S] for s in sels]
    return o.astype(q.dtype), sels


def htree_attention_reference(q, k, v, config: HTreeConfig, *, query_chunk: int | None = None):
    """htree attention with static shapes; inputs already validated.

    Returns `(o [B,T,H,V] in q.dtype, selections)`, selections being the selected node
    lists of layers `L-1 .. 1` (top first), each int32 `[B, T, H_kv, top_k]`, `-1` padded.

    Peak memory beyond the inputs and output: the tree (stored dtype) plus its keys
    rotated by child offset in float32 (`B * H_kv * K * sum_l N_l` floats,
    `sum_l N_l < T * r / (r - 1)`), the selections (`(L-1) * B*T*H_kv*top_k` int32),
    and one chunk of intermediates:
    `query_chunk * B * H_kv * 4 * (M * (K + V + 4G + 6) + top_k * G * K)` bytes,
    `M = top_k * compression_rate`. By default `query_chunk` is the largest that keeps
    the chunk under 64 MiB (at least 1): e.g. 6 positions for B=1, H_kv=2, G=4,
    K=V=64 with the default config, whose whole T=16384 call peaks at ~1.3 GB RSS.
    """
    B, T, H, K = q.shape
    H_kv, Vd = k.shape[2], v.shape[-1]
    if query_chunk is None:
        query_chunk = default_query_chunk(config, B, T, H_kv, H // H_kv, K, Vd)
    elif isinstance(query_chunk, bool) or not isinstance(query_chunk, int) or query_chunk < 1:
        raise ValueError(f"query_chunk must be a positive int, got {query_chunk!r}")
    return _forward(q, k, v, config, min(query_chunk, T))
