"""The decode cache's append of one token per row in one kernel: the token's key (and
value) row at the row's length, then each layer's changed node, the mean of its
existing children, bottom up (SPEC 1; `htree_jax.cache.append_to_cache` is the XLA
twin, which this equals bit for bit).

Per row and kv head one program walks the layers: the node holding position `t` at
layer `l` is `t // r^l`; its children that exist are those below `ceil((t + 1) /
r^(l-1))`. Their rows are summed child by child in float32, in order, scaled by
`child_reciprocals` of their count and rounded to the layer's dtype: the arithmetic of
`core.tree.pool_layer`, so the node equals `build_tree`'s. A layer's node reads the
node the program wrote one layer below, so a barrier (`plgpu.debug_barrier`) orders
each layer's store before the next layer's loads. Every layer is updated in place
(`input_output_aliases`). 16-bit and float32 tokens; FP8 tokens (their scales) and the
radii of `selection="bound"` stay in XLA (`htree_jax.cache`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from htree_jax.core.tree import child_reciprocals
from pallas_kernels.shared.common import compiler_params
from pallas_kernels.shared.importance import feature_pieces


def _node_mean(below_ref, node, existing_below, r: int, start: int, size: int, reciprocals):
    """The mean `[1, size]` float32 of node `node`'s children that exist (`< existing_below`)
    in features `[start, start + size)` of the layer below: summed child by child in
    order (a child that does not exist adds 0, as in the XLA twin), times the reciprocal
    of their count; 0 without children."""
    total = None
    count = jnp.clip(existing_below - node * r, 0, r)
    last = below_ref.shape[0] - 1
    for c in range(r):
        child = node * r + c
        row = below_ref[pl.ds(jnp.minimum(child, last), 1), pl.ds(start, size)].astype(jnp.float32)
        row = jnp.where(child < existing_below, row, 0.0)
        total = row if total is None else total + row
    reciprocal = functools.reduce(lambda acc, c: jnp.where(count == c + 1, jnp.float32(reciprocals[c]), acc),
                                  range(r), jnp.float32(0.0))
    return jnp.where(count > 0, total * reciprocal, 0.0)


def _append_kernel(pos_ref, count_ref, *refs, layers: int, arrays: int, r: int, interpret: bool):
    """Row `b`, kv head `h`: the token rows (`arrays` of them: keys, values) at `pos`, then
    each layer's changed node, where `count` is 1 (a row that overflows appends nothing)."""
    tokens = refs[:arrays]
    outs = refs[arrays + arrays * layers:]  # aliased to the inputs: read and written in place
    reciprocals = child_reciprocals(r)
    pos = pos_ref[0]

    @pl.when(count_ref[0] > 0)
    def _():
        for a in range(arrays):
            for start, size in feature_pieces(tokens[a].shape[-1]):
                outs[a * layers][pl.ds(pos, 1), pl.ds(start, size)] = tokens[a][:, pl.ds(start, size)]
        end = pos + 1
        for l in range(1, layers):
            if not interpret:
                plgpu.debug_barrier()  # the node one layer below is this program's store
            node = pos // r**l
            existing_below = (end + r ** (l - 1) - 1) // r ** (l - 1)
            for a in range(arrays):
                below, layer = outs[a * layers + l - 1], outs[a * layers + l]
                for start, size in feature_pieces(layer.shape[-1]):
                    mean = _node_mean(below, node, existing_below, r, start, size, reciprocals)
                    layer[pl.ds(node, 1), pl.ds(start, size)] = mean.astype(layer.dtype)


def append_token_pallas(layer_arrays, tokens, lengths, counts, r: int, interpret: bool = False):
    """Appends one token per row in place: `layer_arrays` a tuple per array (keys, and
    values unless read from the keys) of its layers `[B, N_l, H_kv, D]` (bottom first,
    the cache's), `tokens` the new rows `[B, H_kv, D]` per array in the layers' dtype,
    `lengths [B]` where each row appends, `counts [B]` 1 or 0 (0: that row changes
    nothing). Returns the layers updated, as `layer_arrays` (bit for bit
    `htree_jax.cache.append_to_cache`'s, the radii aside)."""
    layers, arrays = len(layer_arrays[0]), len(layer_arrays)
    B, _, H_kv, _ = layer_arrays[0][0].shape
    flat = [x for per_array in layer_arrays for x in per_array]
    scalar = pl.BlockSpec((None, 1), lambda b, h: (b, 0))
    token = lambda x: pl.BlockSpec((None, None, 1, x.shape[-1]), lambda b, h: (b, h, 0, 0))
    layer = lambda x: pl.BlockSpec((None, x.shape[1], None, x.shape[-1]), lambda b, h: (b, 0, h, 0))
    first = 2 + arrays
    out = pl.pallas_call(
        functools.partial(_append_kernel, layers=layers, arrays=arrays, r=r, interpret=interpret),
        grid=(B, H_kv),
        in_specs=[scalar, scalar] + [token(x) for x in tokens] + [layer(x) for x in flat],
        out_specs=[layer(x) for x in flat],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat],
        input_output_aliases={first + i: i for i in range(len(flat))},
        compiler_params=compiler_params(4, 1),
        interpret=interpret,
    )(lengths.astype(jnp.int32)[:, None], counts.astype(jnp.int32)[:, None],
      *[x[:, :, None, :] for x in tokens], *flat)
    return tuple(tuple(out[a * layers:(a + 1) * layers]) for a in range(arrays))
