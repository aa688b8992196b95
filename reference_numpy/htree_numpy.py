"""The float64 NumPy oracle: a per-(b, t, h_kv) loop that reads like docs/SPEC.md.

Everything is computed in float64 except where the spec fixes a narrower type:
tree layers are rounded to the input dtype when stored (SPEC 1), and the importance is
rounded to float32 before it is bit-packed (SPEC 2.3). It is slow on purpose: every
other implementation is tested against it, so it must stay obviously right.
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np

# The oracle imports nothing of the project's: it reads the fields of any config object
# (an `htree_jax.HTreeConfig` in practice) and derives everything else itself, so a
# fault in the library's arithmetic cannot hide in the oracle too.
SPEC_DEFAULTS = types.SimpleNamespace(compression_rate=16, top_k=512, rope_base=10000.0, scale=None,
                                      importance="softmax", strict_causal=True, rope_dim=None, selection="mean",
                                      selection_block=1, block_source="first")
FORCED_IMPORTANCE = 1e6  # SPEC 2.3: above every possible importance (which is <= G)

# Relative perturbation of the importance under which `fragile` checks a selection.
# float32 implementations compute importance to ~1e-6 relative (measured: no float32
# selection differed from the oracle outside this band in 21600 random queries).
FRAGILE_RTOL = 1e-5


def layer_sizes(T: int, config) -> list:
    """SPEC 1: `N_0 = T`; while `N_l > M = top_k * r`: `N_{l+1} = ceil(N_l / r)`."""
    sizes = [T]
    while sizes[-1] > config.top_k * config.compression_rate:
        sizes.append(-(-sizes[-1] // config.compression_rate))
    return sizes


def num_top_parents(t: int, r: int, L: int) -> int:
    """SPEC 2: the top layer's virtual parents `0 .. floor(i*_{L-1} / r)`."""
    return t // r ** (L - 1) // r + 1


def candidate_count(n_parents: int, t: int, r: int, l: int) -> int:
    """SPEC 2.1: `n = (n_P - 1) * r + c*_l + 1`, `c*_l = floor(t / r^l) mod r`."""
    return (n_parents - 1) * r + (t // r**l) % r + 1


def build_tree_numpy(k, v, config):
    """Mean-pooling tree in float64, each layer rounded to the input dtype when stored.

    Returns `[(K_0, V_0), ...]` bottom first, float64 arrays `[B, N_l, H_kv, D]`.
    """
    k, v = np.asarray(k), np.asarray(v)
    stored = k.dtype
    r = config.compression_rate
    layers = [(k.astype(np.float64), v.astype(np.float64))]
    for n_up in layer_sizes(k.shape[1], config)[1:]:
        below = layers[-1]
        up = []
        for x in below:
            n_below = x.shape[1]
            pooled = np.stack(
                [x[:, i * r : min(i * r + r, n_below)].mean(axis=1) for i in range(n_up)], axis=1
            )
            up.append(pooled.astype(stored).astype(np.float64))
        layers.append(tuple(up))
    return layers


def feature_groups(K: int, rope_dim=None) -> list:
    """SPEC 11: each unrotated feature alone, each rotated pair `(K-R+i, K-R+i+R/2)` together
    (in the original feature order)."""
    R = K if rope_dim is None else rope_dim
    return [[d] for d in range(K - R)] + [[K - R + i, K - R + i + R // 2] for i in range(R // 2)]


def group_norms(x, groups):
    """`x [..., K]` -> the L2 norm of each feature group, `[..., n_groups]`."""
    return np.stack([np.sqrt(np.sum(x[..., g] ** 2, axis=-1)) for g in groups], axis=-1)


def tree_radii(k_layers, config, groups):
    """SPEC 11: per layer `[B, N_l, H_kv, n_groups]` float64, `rho^(0) = 0`,
    `rho^(l)_i = max_j (rho^(l-1)_j + ||K^(l-1)_j - K^(l)_i||)` over the existing children,
    per group, from the stored layers (`k_layers` as `build_tree_numpy` gives them)."""
    r = config.compression_rate
    B, _, H_kv, _ = k_layers[0].shape
    radii = [np.zeros(k_layers[0].shape[:3] + (len(groups),))]
    for l in range(1, len(k_layers)):
        below, up = k_layers[l - 1], k_layers[l]
        rho = np.zeros(up.shape[:3] + (len(groups),))
        for i in range(up.shape[1]):
            children = slice(i * r, min(i * r + r, below.shape[1]))
            dist = group_norms(below[:, children] - up[:, i:i + 1], groups)  # [B, c, H_kv, n_groups]
            rho[:, i] = np.max(radii[-1][:, children] + dist, axis=1)
        # float32, as stored (SPEC 11)
        radii.append(rho.astype(np.float32).astype(np.float64))
    return radii


def rope(x, positions, base, rope_dim=None):
    """Rotate-half RoPE in float64: `x [..., n, K]` rotated by `positions [n]`; with
    `rope_dim = R` (SPEC 7) only the last `R` features, angles `base^(-2i/R)`, the first
    `K - R` left as they are."""
    K = x.shape[-1]
    R = K if rope_dim is None else rope_dim
    inv_freq = float(base) ** (-np.arange(0, R, 2, dtype=np.float64) / R)
    ang = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    nope, pe = x[..., : K - R], x[..., K - R:]
    lo, hi = pe[..., : R // 2], pe[..., R // 2:]
    return np.concatenate([nope, lo * cos - hi * sin, lo * sin + hi * cos], axis=-1)


def pack_importance(importance_f32, positions, log_n):
    """SPEC 2.3: float32 bits with the low `log_n` bits replaced by `~p` (int64 keys); a
    NaN importance packs as 0 (SPEC 10: the rightmost node must stay selected)."""
    mask = (1 << log_n) - 1
    importance_f32 = np.where(np.isnan(importance_f32), np.float32(0), np.asarray(importance_f32, np.float32))
    bits = np.asarray(importance_f32, np.float32).view(np.int32).astype(np.int64)
    return (bits & ~mask) | (mask - np.asarray(positions, np.int64))


def pack_index_scores(x_f32, positions, log_n):
    """SPEC 13: index scores (float32) as order-preserving non-negative keys, the low
    `log_n` bits replaced by `~p` (int64 keys): `u = bits ^ 0x80000000` (x >= 0) or
    `~bits` (x < 0) as uint32, then `u >> 1`; -0 as +0, a NaN as key 0."""
    mask = (1 << log_n) - 1
    x = np.asarray(x_f32, np.float32)
    x = np.where(x == 0, np.float32(0), x)
    bits = x.view(np.uint32).astype(np.int64)
    u = np.where(bits >= 1 << 31, (~bits) & 0xFFFFFFFF, bits ^ (1 << 31))
    u = np.where(np.isnan(x), 0, u >> 1)
    return (u & ~mask) | (mask - np.asarray(positions, np.int64))


FORCED_INDEX_KEY = 0x7FFFFFFF  # SPEC 13: the rightmost position's key before its position bits


def index_scores(iq_rows, iw_rows, ik_nodes):
    """SPEC 13: `x[p] = sum_i iw[i] * max(0, <iq[i], IK[j(p)]>)`, float64: `iq_rows [n_i,
    D_I]`, `iw_rows [n_i]`, `ik_nodes [n, D_I]` -> `[n]`."""
    return iw_rows @ np.maximum(0.0, iq_rows @ ik_nodes.T)


def index_kl(scores, x, in_norm):
    """SPEC 13's loss at one layer: `KL(P || softmax_R(x))`, `P` the group-summed softmax
    importance of `scores [G, n]` over `R = in_norm`, normalised; 0 for an empty `R`."""
    if not in_norm.any():
        return 0.0
    imp = importance(scores, in_norm, "softmax")[in_norm]
    P = imp / imp.sum()
    xr = x[in_norm]
    log_q = xr - (xr.max() + np.log(np.exp(xr - xr.max()).sum()))
    nz = P > 0
    return float(np.sum(P[nz] * (np.log(P[nz]) - log_q[nz])))


def importance(scores, in_norm, mode):
    """`scores [G, n]`, `in_norm [n]` (the set R) -> float64 importance `[n]` (SPEC 2.3)."""
    G, n = scores.shape
    if not in_norm.any():
        return np.zeros(n)
    s_r = scores[:, in_norm]
    if mode == "softmax":
        mx = s_r.max(axis=1, keepdims=True)
        lse = mx + np.log(np.exp(s_r - mx).sum(axis=1, keepdims=True))
        return np.exp(scores - lse).sum(axis=0)
    m = s_r.max()
    return np.exp(scores - m).sum(axis=0)


@dataclasses.dataclass
class LayerTrace:
    layer: int
    candidates: np.ndarray  # node indices of layer `layer`, buffer order, [n]
    scores: np.ndarray  # float64 [G, n]
    selected: np.ndarray  # node indices kept for refinement (ascending); empty at l = 0
    merged: np.ndarray  # node indices folded into the softmax
    fragile: bool  # the selection could flip under a FRAGILE_RTOL change of importance
    importance: np.ndarray = None  # float64 importance of `selected` (SPEC 8: the rightmost's formula value)
    index_loss: float = 0.0  # SPEC 13: this layer's KL(P || Q) (selection="indexer")


@dataclasses.dataclass
class QueryTrace:
    output: np.ndarray  # float64 [G, V]
    layers: list  # LayerTrace, top layer first

    @property
    def fragile(self) -> bool:
        return any(lt.fragile for lt in self.layers)

    @property
    def index_loss(self) -> float:
        return sum(lt.index_loss for lt in self.layers)


def trace_query(q_group, layers, t, config, alpha, radii=None, groups=None, q_rank=None, index=None):
    """One `(b, t, h_kv)`: `q_group [G, K]` float64, `layers` from `build_tree_numpy`
    sliced to one batch row and kv head (`[(K_l [N_l, K], V_l [N_l, V]), ...]`). With
    `config.selection == "bound"`, `radii` (per layer `[N_l, n_groups]`, `tree_radii`
    sliced alike) and the feature `groups` (SPEC 11). With block selection (SPEC 12)
    `q_rank [R, K]` float64, the block's ranking rows (`ranking_rows`): the layers above 0
    rank by their scores on the same buffer; the merge keeps the query's own. With
    `config.selection == "indexer"` (SPEC 13), `index = (iq [n_i, D_I], iw [n_i], [IK_l
    [N_l, D_I], ...])` float64, the ranking query's index heads and the index tree."""
    r, k_top, L = config.compression_rate, config.top_k, len(layers)
    G = q_group.shape[0]
    Vd = layers[0][1].shape[-1]
    log_n = (k_top * r).bit_length() - 1  # bits of a packed key that hold the position
    m = np.full(G, -np.inf)
    S = np.zeros(G)
    U = np.zeros((G, Vd))
    parents = np.arange(num_top_parents(t, r, L))  # virtual parents of the top layer
    traces = []
    for l in reversed(range(L)):
        K_l, V_l = layers[l]
        n = int(candidate_count(len(parents), t, r, l))
        pos = np.arange(n)
        nodes = parents[pos // r] * r + pos % r
        q_rot = rope(q_group, np.full(1, n - 1), config.rope_base, config.rope_dim)
        k_rot = rope(K_l[nodes], pos, config.rope_base, config.rope_dim)
        s = alpha * q_rot @ k_rot.T  # [G, n]
        fragile = False
        if l > 0:
            in_norm = pos < n - 1 if config.strict_causal else np.ones(n, bool)
            rows = q_group if q_rank is None else q_rank
            ranked = s if q_rank is None else alpha * rope(rows, np.full(1, n - 1), config.rope_base,
                                                           config.rope_dim) @ k_rot.T  # SPEC 12
            index_loss = 0.0
            if getattr(config, "selection", "mean") == "indexer":  # SPEC 13: the indexer ranks
                x = index_scores(index[0], index[1], index[2][l][nodes])
                index_loss = index_kl(ranked, x, in_norm)
                imp64 = x  # what the keys and the fragile band are made from
                imp = x.astype(np.float32)
                keys = pack_index_scores(imp, pos, log_n)
                keys[n - 1] = (FORCED_INDEX_KEY & ~((1 << log_n) - 1)) | ((1 << log_n) - 1 - (n - 1))
            else:
                if getattr(config, "selection", "mean") == "bound":  # SPEC 11: rank by the bound
                    ranked = ranked + alpha * group_norms(rows, groups) @ radii[l][nodes].T
                imp64 = importance(ranked, in_norm, config.importance)
                imp = imp64.astype(np.float32)
                imp[n - 1] = np.float32(FORCED_IMPORTANCE)
                keys = pack_importance(imp, pos, log_n)
            chosen = np.argsort(-keys, kind="stable")[: min(k_top, n)]
            is_sel = np.zeros(n, bool)
            is_sel[chosen] = True
            merged_mask = ~is_sel
            if n > k_top:
                if getattr(config, "selection", "mean") == "indexer":  # scores of either sign
                    band = np.abs(imp64) * FRAGILE_RTOL
                    lo, hi = pack_index_scores((imp64 - band).astype(np.float32), pos, log_n), pack_index_scores(
                        (imp64 + band).astype(np.float32), pos, log_n)
                    lo[n - 1] = hi[n - 1] = keys[n - 1]
                else:
                    lo = imp64 * (1 - FRAGILE_RTOL)
                    hi = imp64 * (1 + FRAGILE_RTOL)
                    lo[n - 1] = hi[n - 1] = np.float32(FORCED_IMPORTANCE)
                    lo, hi = (pack_importance(x.astype(np.float32), pos, log_n) for x in (lo, hi))
                fragile = bool(hi[~is_sel].max() > lo[is_sel].min())
            selected = nodes[is_sel]  # ascending: nodes increase with buffer position
            kept_importance = imp64[is_sel]
        else:
            merged_mask = np.ones(n, bool)
            selected = nodes[:0]
            kept_importance = np.zeros(0)
        traces.append(LayerTrace(l, nodes, s, selected, nodes[merged_mask], fragile, kept_importance,
                                 index_loss if l > 0 else 0.0))
        if merged_mask.any():
            s_m = s[:, merged_mask]
            m_new = np.maximum(m, s_m.max(axis=1))
            w = np.exp(s_m - m_new[:, None])
            decay = np.exp(m - m_new)
            S = S * decay + w.sum(axis=1)
            U = U * decay[:, None] + w @ V_l[nodes[merged_mask]]
            m = m_new
        parents = selected
    return QueryTrace(U / S[:, None], traces)


def ranking_rows(q64, b, t, heads, config):
    """SPEC 12: the ranking rows `[R, K]` float64 of query `t` of batch row `b` for the
    kv head whose query heads are `heads`, or None with `selection_block == 1`. `first`:
    the block's first query's heads; `previous`: the previous block's queries' heads (in
    position order), zeros for the first block."""
    block = getattr(config, "selection_block", 1)
    if block == 1:
        return None
    t0 = t - t % block
    if getattr(config, "block_source", "first") == "first":
        return q64[b, t0, heads]
    if t0 == 0:
        return np.zeros((block * q64[b, t, heads].shape[0], q64.shape[-1]))
    return q64[b, t0 - block:t0][:, heads].reshape(-1, q64.shape[-1])


def htree_attention_numpy(
    q,
    k,
    v,
    config=None,
    return_selected: bool = False,
    *,
    query_positions=None,
    return_fragile: bool = False,
    return_importance: bool = False,
    index=None,
    return_index_loss: bool = False,
):
    """float64 htree attention, the oracle.

    Args:
      q `[B,T,H,K]`, k `[B,T,H_kv,K]`, v `[B,T,H_kv,V]`: un-rotated, any float dtype
        (the tree layers are rounded to it, as the spec stores them).
      config: any object with `HTreeConfig`'s fields (None: the spec's defaults).
      return_selected: also return the selected node lists of every layer `l >= 1`,
        top layer first, each int64 `[B, T', H_kv, top_k]` ascending, `-1` padded.
      query_positions: optional 1-D positions `t` to evaluate (default all of `[0, T)`);
        outputs then have `T' = len(query_positions)` rows.
      return_fragile: also return bool `[B, T', H_kv]`: the query's selection could
        change under a `FRAGILE_RTOL` relative change of any importance value, so a
        float32 implementation may legitimately select differently there.
      return_importance: also return the importance of the selected nodes (SPEC 8),
        per layer `l >= 1` float64 `[B, T', H_kv, top_k]`, aligned with the
        selections, 0 where they are `-1` (returned after the selections).
      index: `(iq [B,T,H_I,D_I], ik [B,T,H_ik,D_I], iw [B,T,H_I])`, the indexer's
        inputs (SPEC 13), with `config.selection == "indexer"`.
      return_index_loss: also return SPEC 13's loss, float64 `[B, T', H_kv]` (last).

    Returns:
      `o` float64 `[B, T', H, V]`, then the selections and/or fragile flags if asked.
    """
    config = config or SPEC_DEFAULTS
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    B, T, H, K = q.shape
    H_kv = k.shape[2]
    G = H // H_kv
    alpha = K**-0.5 if config.scale is None else float(config.scale)
    positions = np.arange(T) if query_positions is None else np.asarray(query_positions)
    layers = build_tree_numpy(k, v, config)
    L = len(layers)
    bound = getattr(config, "selection", "mean") == "bound"
    groups = feature_groups(K, config.rope_dim) if bound else None
    radii = tree_radii([kl for kl, _ in layers], config, groups) if bound else None
    q64 = q.astype(np.float64)
    indexer = getattr(config, "selection", "mean") == "indexer"
    if indexer != (index is not None):
        raise ValueError("index (iq, ik, iw) goes with selection='indexer' (SPEC 13), and only with it")
    if indexer:
        iq, ik, iw = (np.asarray(x) for x in index)
        ik_layers = [kl for kl, _ in build_tree_numpy(ik, ik, config)]
        iq64, iw64 = iq.astype(np.float64), iw.astype(np.float64)
        H_ik = ik.shape[2]
        per_key = iq.shape[2] // H_ik  # index heads a key head
    index_loss = np.zeros((B, len(positions), H_kv))
    out = np.zeros((B, len(positions), H, v.shape[-1]))
    selected = [np.full((B, len(positions), H_kv, config.top_k), -1, np.int64) for _ in range(L - 1)]
    fragile = np.zeros((B, len(positions), H_kv), bool)
    exported = [np.zeros((B, len(positions), H_kv, config.top_k)) for _ in range(L - 1)]
    for b in range(B):
        for h_kv in range(H_kv):
            head_layers = [(K_l[b, :, h_kv], V_l[b, :, h_kv]) for K_l, V_l in layers]
            head_radii = None if radii is None else [rho[b, :, h_kv] for rho in radii]
            if indexer:
                c = h_kv // (H_kv // H_ik)
                ik_head = [x[b, :, c] for x in ik_layers]
                index_heads = slice(c * per_key, (c + 1) * per_key)
            for i, t in enumerate(positions):
                heads = slice(h_kv * G, (h_kv + 1) * G)
                index_rows = None
                if indexer:  # SPEC 13: the ranking query's (the block's first, SPEC 12)
                    t_rank = int(t) - int(t) % getattr(config, "selection_block", 1)
                    index_rows = (iq64[b, t_rank, index_heads], iw64[b, t_rank, index_heads], ik_head)
                tr = trace_query(q64[b, t, heads], head_layers, int(t), config, alpha, head_radii, groups,
                                 ranking_rows(q64, b, int(t), heads, config), index_rows)
                index_loss[b, i, h_kv] = tr.index_loss
                out[b, i, h_kv * G : (h_kv + 1) * G] = tr.output
                fragile[b, i, h_kv] = tr.fragile
                for j, lt in enumerate(tr.layers[:-1]):
                    selected[j][b, i, h_kv, : len(lt.selected)] = lt.selected
                    exported[j][b, i, h_kv, : len(lt.selected)] = lt.importance
    result = (out,)
    if return_selected:
        result += (selected,)
    if return_importance:
        result += (exported,)
    if return_fragile:
        result += (fragile,)
    if return_index_loss:
        result += (index_loss,)
    return result[0] if len(result) == 1 else result
