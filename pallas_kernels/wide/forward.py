"""The Pallas forward for wide groups (`wide/kernels.py`: G >= 32 heads per kv head, latent
attention's shape): the tree built once per real kv head, each layer's keys split into
their latent and RoPE parts, then per chunk of queries, per layer top down (the top
layer's parents virtual), the wide importance, the shared top-K and the wide merge.

Memory beyond inputs, tree and output: per layer the RoPE part in `tile / r` rotated
float32 copies and their operand parts (`R` features, 64 at the MLA shape: the latent
part is read as stored), the radii with `selection="bound"`; per chunk of `Qc` queries
the state (`B * Qc * H * (Wv + 2)` float32), the queries' RoPE part and its rotate-half
(float32), every row's scores (for the importance and the merge; with the bound, both
kinds) and the packed keys (`B * Qc * H_kv * Mp * (G + 3)` 4-byte words, `2 G` with the
bound).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from htree_jax.core.bounds import tree_radii
from htree_jax.core.config import HTreeConfig
from htree_jax.core.indexing import candidate_count, num_parents, top_layer_parents
from pallas_kernels.shared import shared_memory
from pallas_kernels.shared.common import LayerStatic, check_query_layout, WideBound, next_power_of_two, pad_axis, pad_rope_halves, wide_head_dims
from pallas_kernels.shared.common import dividing_chunk
from pallas_kernels.shared.common import check_selections_only, head_block
from pallas_kernels.shared.configs import BlockSizes, KernelConfigs
from pallas_kernels.shared.guarded import KernelCall
from pallas_kernels.shared.importance import feature_pieces
from pallas_kernels.shared.precision import Precisions, key_operands
from pallas_kernels.shared.rope import full_width, padded_rope_table, rotate_copies, rotate_half
from pallas_kernels.shared.shared_memory import program_shape
from pallas_kernels.shared.top_k import kept_values, select_top_k_pallas
from pallas_kernels.shared.tree_build import PoolBlockSizes, pool_layer_pallas
from pallas_kernels.wide.kernels import (WideLayer, WideStatic, combine_importance, wide_importance_pallas,
                                        wide_merge_pallas)


@dataclasses.dataclass(frozen=True)
class FeatureSplit:
    """Where the latent and RoPE parts of a feature axis lie: in `rope_layout` order
    `[lat_lo, rope_lo, lat_hi, rope_hi]`, `u = (K - R) / 2` unrotated features in each
    half; with `given`, in the caller's order (SPEC 7: the last `R` features rotate), so
    each part is one contiguous slice of the features as given."""

    head_dim: int  # K
    rope_dim: int  # R (K when every feature rotates)
    given: bool = False

    @property
    def unrotated(self) -> int:
        return self.head_dim - self.rope_dim

    def latent(self, x):
        """`[..., K]` -> the unrotated features `[..., K - R]`, in their original order."""
        if self.given:
            return x[..., :self.unrotated]
        u, half = self.unrotated // 2, self.head_dim // 2
        return jnp.concatenate([x[..., :u], x[..., half:half + u]], axis=-1)

    def rope(self, x):
        """`[..., K]` -> the rotated features `[..., R]` as rotate-half halves."""
        if self.given:
            return x[..., self.unrotated:]
        u, half = self.unrotated // 2, self.head_dim // 2
        return jnp.concatenate([x[..., u:half], x[..., half + u:]], axis=-1)

    def values(self, x, value_dim: int):
        """The values `[..., V]` that are the first `V` latent features of the keys `x`."""
        return self.latent(x)[..., :value_dim]

    def join(self, latent, rope):
        """Inverse of `latent` and `rope`: the features `[..., K]` in this split's order."""
        if self.given:
            return jnp.concatenate([latent, rope], axis=-1)
        u, h = self.unrotated // 2, self.rope_dim // 2
        return jnp.concatenate([latent[..., :u], rope[..., :h], latent[..., u:], rope[..., h:]], axis=-1)


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def pool_any(x, r: int, interpret: bool):
    """`pool_layer_pallas` of `x [B, H_kv, N, D]` for any `D` (padded to a power of two
    for the pooling only)."""
    D = x.shape[-1]
    return pool_layer_pallas(pad_axis(x, -1, next_power_of_two(D)), r, PoolBlockSizes(), interpret)[..., :D]


def wide_eligible(G: int, K: int, V: int, tuning: KernelConfigs, packing) -> bool:
    """The wide kernels take groups of 32 or more heads, and of 16 at head dims past 256
    (`wide_head_dims`: the virtual-head kernels pad K = 576 to 1024, and in float32 their
    bottom merge asks 270336 B of shared memory, H100), with `wide_rows > 0`
    and one document per row (any query positions, importance export too); other calls
    run the virtual-head kernels."""
    wide_group = G >= 32 or (G >= 16 and wide_head_dims(K, V))
    return wide_group and tuning.wide.rows > 0 and packing is None


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["layers", "tables", "queries", "positions"],
                   meta_fields=["ws", "st_select", "chunk", "num_chunks", "seq_len", "parents_width", "value_dim",
                                "log_n", "split", "latent_width", "rope_half", "bound"])
@dataclasses.dataclass(frozen=True)
class WidePlan:
    """What every chunk's launches share: the layers as the kernels read them (bottom
    first: `lat`, `rope_imp`, `rope_merge`, `values`, with the bound `radii`), the RoPE
    tables `[Mp, Wr]`, the queries as given `[B, chunks * Qc, H, K]` (zero rows past the
    real ones only where the chunks do not divide them: each chunk's parts are made from
    its rows, `query_parts`, so nothing of the queries' full length is copied); the
    queries' positions among the tree's tokens `[chunks * Qc]` (the last repeated past
    the real queries)."""

    layers: list
    tables: tuple
    queries: jax.Array
    positions: jax.Array
    ws: WideStatic
    st_select: LayerStatic
    chunk: int  # Qc
    num_chunks: int
    seq_len: int  # T, the tree's tokens
    parents_width: int  # P
    value_dim: int  # V
    log_n: int
    split: FeatureSplit  # the queries' (`given`: in the caller's feature order)
    latent_width: int  # the latent parts' padded width (Wl, at least 16)
    rope_half: int  # hp: each RoPE half padded
    bound: bool  # selection="bound": the queries' norms too

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def importance_step(tile: int, r: int, Wl: int, hp: int, itemsize: int, bound: bool) -> int:
    """The wide importance kernel's candidates a step: `tile` halved (a multiple of r, at
    least 16) until one step's gathered tiles fit `shared_memory.WIDE_STAGED_BYTES`: the
    latent part as stored, the RoPE part at 4 bytes a feature (float32, or `BF16X3`'s two
    bfloat16 parts) and, with the bound, the radii alike (H200, MLA shape, bound: 241664 B
    asked at 64)."""
    per_candidate = Wl * itemsize + 4 * 2 * hp
    width = Wl + hp if bound else 0
    candidates = [(tile, 1)]
    while candidates[-1][0] > max(16, r) and candidates[-1][0] // 2 % r == 0:
        candidates.append((candidates[-1][0] // 2, 1))
    footprint = lambda c: shared_memory.staged_tiles(c[0], per_candidate, 1, width)
    return shared_memory.first_fitting(candidates, footprint, shared_memory.WIDE_STAGED_BYTES)[0]


def prepare_wide(q, k, v, call: KernelCall, precisions: Precisions | None = None, positions=None,
                 score_chunks: bool = True) -> WidePlan:
    """The tree, keys and queries as the wide kernels read them for `call` (its config,
    the kernels' configs, interpret mode, `value_dim` and `q_layout`; the rest as
    `wide_forward_pallas` takes them). `score_chunks`: the chunks hold the importance's stored
    scores (sized with them); a backward with saved selections stores none, and its
    chunks, sized without, stay as large as its node gradients want (64K, fwd+bwd:
    5627 ms with them counted, journal 2026-11-27 (5))."""
    config, tuning, interpret = call.config, call.tuning, call.interpret
    value_dim, q_layout = call.value_dim, call.q_layout
    B, S, H, K = q.shape
    T, H_kv = k.shape[1], k.shape[2]
    G = H // H_kv
    precisions = precisions or Precisions.for_dtype(q.dtype)
    R = config.partial_rope(K) or K
    split = FeatureSplit(K, R)  # the keys'
    r, top_k = config.compression_rate, config.top_k
    # At least 16 candidates a step (a dot's least width), as below the top elsewhere.
    tile = max(16, r, min(next_power_of_two(tuning.wide.tile), config.max_candidates))
    hp = next_power_of_two(R // 2, 16)
    Wl = round_up(split.unrotated, 16)
    V = value_dim if v is None else v.shape[-1]
    if v is None and V > split.unrotated:
        raise ValueError(f"value_dim {V} must be at most the latent features K - rope_dim = {split.unrotated}")
    Wv = round_up(V, 16)
    rows, tile = program_shape(head_block(G, tuning.wide.rows), tile, r, Wl, hp, Wv if v is not None else 0,
                               jnp.dtype(q.dtype).itemsize)
    P = round_up(top_k, tile // r)
    Mp = P * r
    # The merges' pipeline depth where their gathered tiles fit (`shared_memory.staged_tiles`
    # within `WIDE_STAGED_BYTES`): 16-bit inputs with the values read from the keys at
    # the MLA shape; separate values double a step's tiles (353024 B of shared memory
    # asked with 2 stages on an H200).
    own_values = Wv if v is not None else 0
    merge_tiles = shared_memory.staged_tiles(tile, Wl + 2 * hp + own_values, jnp.dtype(k.dtype).itemsize)
    deep = shared_memory.fits(merge_tiles, tuning.wide.num_stages, shared_memory.WIDE_STAGED_BYTES)
    narrow = jnp.dtype(q.dtype).itemsize == 2
    imp_tile = importance_step(tile, r, Wl, hp, jnp.dtype(k.dtype).itemsize, config.ranks_by_bound)
    ws = WideStatic(
        r=r, tile=tile, rows=rows, alpha=config.score_scale(K),
        importance=config.importance, strict_causal=config.strict_causal, lat_pieces=feature_pieces(Wl),
        value_pieces=feature_pieces(Wv), precision=precisions.scores,
        importance_operands=precisions.importance_operands, merge_precision=precisions.merge,
        merge_operands=precisions.merge_operands, num_warps=tuning.wide.num_warps,
        num_stages=tuning.wide.num_stages if deep else 1,
        importance_stages=tuning.wide.importance_stages if narrow else 1, importance_tile=imp_tile)
    st_select = LayerStatic(r=r, tile=tile, group=G, alpha=ws.alpha, importance=config.importance,
                            strict_causal=config.strict_causal, log_n=config.log_n, top_k=top_k,
                            precision=precisions.scores, num_warps=tuning.layer.select_num_warps)

    # The tree, per real kv head: latent part, RoPE part (halves padded), values.
    per_head = lambda x: jnp.swapaxes(x, 1, 2)  # [B, N, H_kv, D] -> [B, H_kv, N, D]
    Wl_stored = max(Wl, 16)  # without unrotated features, a 16-wide stand-in no product reads
    parts = [per_head(pad_axis(split.latent(k), -1, Wl_stored)), per_head(pad_rope_halves(split.rope(k), hp))]
    if v is not None:
        parts.append(per_head(pad_axis(v, -1, Wv)))
    tree = [parts]
    for _ in config.layer_sizes(T)[1:]:
        tree.append([pool_any(x, r, interpret) for x in tree[-1]])
    cos, sin = padded_rope_table(Mp, R, config.rope_base, hp)
    imp_spec = (precisions.scores, precisions.importance_operands)
    merge_spec = (precisions.merge, precisions.merge_operands)
    layers = []
    for l, parts in enumerate(tree):
        copies = rotate_copies(parts[1], cos, sin, r, tile // r)
        layers.append(dict(lat=parts[0], values=parts[2] if v is not None else None,
                           rope_imp=key_operands(copies, *imp_spec) if l > 0 else None,
                           rope_merge=key_operands(copies, *merge_spec), radii=None))
    if config.ranks_by_bound:
        rope_unpadded = lambda x: jnp.concatenate([x[..., :R // 2], x[..., hp:hp + R // 2]], axis=-1)
        keys = [split.join(per_head(p[0][..., :split.unrotated]), per_head(rope_unpadded(p[1]))) for p in tree]
        rho = tree_radii(keys, r, config.partial_rope(K))  # [B, N, H_kv, (K - R) + R/2]
        for l in range(1, len(tree)):
            x = per_head(rho[l])
            layers[l]["radii"] = (key_operands(pad_axis(x[..., :split.unrotated], -1, Wl_stored), *imp_spec),
                                  key_operands(pad_axis(x[..., split.unrotated:], -1, hp), *imp_spec))

    # Chunks of queries: the state, the queries' parts, every row's importance scores
    # and the packed keys per chunk. (The queries' parts and norms, `query_parts`, are made
    # per chunk: 2 (Wl + 2 hp) + 4 hp bytes a head, counted with the state.)
    stored = (2 if config.ranks_by_bound else 1) if score_chunks else 0
    per_query = 4 * B * H_kv * (G * (2 * Wv + 2 * 2 * hp + Wl + 4 + Mp * stored) + 3 * Mp)
    Qc = int(max(1, min(S, tuning.chunk_budget_bytes // per_query)))
    if q.size * q.dtype.itemsize >= tuning.chunk_budget_bytes:
        Qc = dividing_chunk(S, Qc, 1)  # no padded copy of the queries
    num_chunks = -(-S // Qc)
    positions = jnp.arange(S, dtype=jnp.int32) if positions is None else jnp.asarray(positions, jnp.int32)
    positions = jnp.concatenate([positions, jnp.broadcast_to(positions[-1:], (num_chunks * Qc - S,))])
    return WidePlan(layers, (full_width(cos), full_width(sin)), pad_axis(q, 1, num_chunks * Qc), positions, ws,
                    st_select, Qc, num_chunks, T, P, V, config.log_n, FeatureSplit(K, R, q_layout == "given"),
                    Wl_stored, hp, config.ranks_by_bound)


def query_parts(plan: WidePlan, q):
    """Queries `[B, Q, H, K]` (`rope_layout` order) as the wide kernels read them: the
    latent part `[B, Q, H_kv, G, latent_width]` as stored, the RoPE part `[.., 2 hp]`
    float32 (halves padded apart) and, with the bound, their feature-group norms
    (`|q|` of each latent feature, each RoPE pair's norm; else None)."""
    B, Q, H, _ = q.shape
    H_kv = plan.layers[0]["lat"].shape[1]
    rows = lambda x: x.reshape(B, Q, H_kv, H // H_kv, x.shape[-1])
    hp = plan.rope_half
    q_lat = rows(pad_axis(plan.split.latent(q), -1, plan.latent_width))
    q_rope = rows(pad_rope_halves(plan.split.rope(q).astype(jnp.float32), hp))
    norms = None
    if plan.bound:
        norms = (jnp.abs(q_lat), jnp.sqrt(q_rope[..., :hp] ** 2 + q_rope[..., hp:] ** 2))
    return q_lat, q_rope, norms


def chunk_start(plan: WidePlan, c):
    """Chunk `c`'s queries `(q_lat, q_rope, rotate_half(q_rope))`, their norms (the
    bound's, else None), positions `t [1, Qc, 1, 1]`, the top layer's virtual parents
    `[B, Qc, H_kv, P]` and the empty state."""
    Qc = plan.chunk
    q_lat, qr, norms = query_parts(plan, lax.dynamic_slice_in_dim(plan.queries, c * Qc, Qc, axis=1))
    B, _, H_kv, G, _ = qr.shape
    queries = (q_lat, qr, rotate_half(qr))
    t = lax.dynamic_slice_in_dim(plan.positions, c * Qc, Qc)[None, :, None, None]
    parents = top_layer_parents(t[..., 0], plan.ws.r, plan.num_layers, plan.parents_width)
    Wv = sum(size for _, size in plan.ws.value_pieces)
    state = (jnp.full((B, Qc, H_kv, G), -jnp.inf, jnp.float32), jnp.zeros((B, Qc, H_kv, G), jnp.float32),
             jnp.zeros((B, Qc, H_kv, G, Wv), jnp.float32))
    return queries, norms, t, jnp.broadcast_to(parents, (B, Qc, H_kv, plan.parents_width)), state


def valid_count(plan: WidePlan, parents, t, layer: int):
    """`n` per query (SPEC 2.1), `[B, Qc, H_kv, 1]` int32."""
    return candidate_count(num_parents(parents), t, plan.ws.r, layer).astype(jnp.int32)


def select_and_merge(plan: WidePlan, layer: int, queries, norms, parents, t, state, interpret: bool,
                     export: bool = False):
    """A layer above the bottom: importance, shared top-K, the merge of what it did not
    keep (none where `state` is None: selections only). Returns `(state, next parents
    [B, Qc, H_kv, P])`, and with `export` the kept nodes' importance `[B, Qc, H_kv,
    top_k]` (SPEC 8)."""
    kl, ws = plan.layers[layer], plan.ws
    n = valid_count(plan, parents, t, layer)
    bound = None if norms is None else WideBound(*norms, *kl["radii"])
    ranked, shift, scores = wide_importance_pallas(queries, parents, n, kl["lat"], kl["rope_imp"], plan.tables, ws,
                                                   interpret, bound=bound)
    keys = combine_importance(ranked, shift, n, plan.st_select, export)
    if export:
        keys, imp = keys
    next_parents, tau = select_top_k_pallas(keys, parents, n, plan.st_select, interpret)
    if state is not None:
        layer_in = WideLayer(parents, n, keys, tau, kl["lat"], (), kl["values"], plan.tables)
        state = wide_merge_pallas(queries, layer_in, state, ws, interpret, scores=scores)
    result = (state, next_parents[..., :plan.parents_width])
    return result + (kept_values(keys, tau, imp, plan.st_select.top_k),) if export else result


def bottom_merge(plan: WidePlan, queries, parents, t, state, interpret: bool, out_dtype):
    """The bottom layer: every valid candidate merged, then `(o [B, Qc, H_kv, G, V],
    lse [B, Qc, H_kv, G])`."""
    kl = plan.layers[0]
    n = valid_count(plan, parents, t, 0)
    layer = WideLayer(parents, n, None, None, kl["lat"], kl["rope_merge"], kl["values"], plan.tables)
    o, lse = wide_merge_pallas(queries, layer, state, plan.ws, interpret, out_dtype=out_dtype, return_lse=True)
    return o[..., :plan.value_dim], lse


def wide_forward_pallas(q, k, v, *, config: HTreeConfig, block_sizes: BlockSizes | KernelConfigs | None = None,
                        interpret: bool = False, precisions: Precisions | None = None, return_lse: bool = False,
                        positions=None, return_importance: bool = False, value_dim: int | None = None,
                        q_layout: str = "rope_layout", selections_only: bool = False):
    """htree attention for wide groups. `q [B, S, H, K]`, `k [B, T, H_kv, K]` in
    `rope_layout` order (validated by the caller; `q_layout="given"`: `q` in the
    caller's order, each chunk's parts sliced from it, no permuted copy of q); `v [B, T, H_kv, V]`, or None with
    `value_dim = V`: the values are the first `V` latent features of `k` (read from the
    keys, no copy); `positions [S]` the queries' positions among the `T` tokens (None:
    `S = T`, all of them). `block_sizes` as `htree_forward_pallas` takes them. Returns
    what `htree_forward_pallas` does: `(o, selections[, lse][, importance])`;
    `selections_only`: no merge runs and `o` is None (refused with `return_lse`)."""
    B, S, H, K = q.shape
    check_selections_only(selections_only, return_lse)
    check_query_layout(q_layout, wide=True)
    tuning = KernelConfigs.resolve(block_sizes, K, value_dim if v is None else v.shape[-1])
    call = KernelCall(config, tuning, interpret, value_dim=value_dim, q_layout=q_layout)
    plan = prepare_wide(q, k, v, call, precisions, positions)
    Qc, num_chunks, V = plan.chunk, plan.num_chunks, plan.value_dim

    def chunk(c):
        queries, norms, t, parents, state = chunk_start(plan, c)
        state = None if selections_only else state
        selections, exported = [], []
        for l in reversed(range(1, plan.num_layers)):
            state, parents, *imp = select_and_merge(plan, l, queries, norms, parents, t, state, interpret,
                                                    return_importance)
            selections.append(parents[..., :config.top_k])
            exported += imp
        merged = None if selections_only else bottom_merge(plan, queries, parents, t, state, interpret, q.dtype)
        return merged, selections, exported

    merged, sels, imps = lax.map(chunk, jnp.arange(num_chunks, dtype=jnp.int32))
    per_query = lambda x: jnp.moveaxis(x, 0, 1).reshape((B, num_chunks * Qc) + x.shape[3:])[:, :S]
    o, lse = (None, None) if merged is None else merged
    result = (None if o is None else per_query(o).reshape(B, S, H, V), [per_query(s)[..., :config.top_k] for s in sels])
    if return_lse:
        result += (per_query(lse).reshape(B, S, H),)
    if return_importance:
        result += ([per_query(x) for x in imps],)
    return result


__all__ = ["FeatureSplit", "WidePlan", "bottom_merge", "chunk_start", "prepare_wide", "query_parts", "select_and_merge",
           "wide_eligible", "wide_forward_pallas"]
