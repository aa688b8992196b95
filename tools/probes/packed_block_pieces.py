"""Block selection over packed rows against the same tokens as unpacked rows, piece by
piece: the blocks' selections, the merge, the backward and the packed tree's transpose,
each jitted alone on the same inputs (journal, 2026-12-02 (4): the top layer's walk).

    python tools/probes/packed_block_pieces.py [--T 131072] [--documents 8] [cpu]

The benchmark shape (H=32, H_kv=4, K=V=128, bf16, `top_k=512`, `selection_block=16`) on
the Mosaic GPU merge; `cpu`: a small shape (r=4, `top_k=4`) interpreted, Pallas-Triton.
Documents of equal length; ms are medians of 5 calls after a warm-up (1 call on the CPU).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from htree_jax.bench import median_ms
from htree_jax.core.config import HTreeConfig
from htree_jax.core.packing import pack_layout, virtual_length
from htree_jax.routes import Call, block_selections, packed_block_selections
from pallas_kernels.block.backward import block_backward_pallas
from pallas_kernels.block.forward import block_forward_pallas, block_static
from pallas_kernels.block.layout import PackedLayout
from pallas_kernels.shared.configs import BlockConfig, KernelConfigs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=131072)
    ap.add_argument("--documents", type=int, default=8)
    ap.add_argument("cpu", nargs="?", default=None)
    args = ap.parse_args(argv)
    interpret = args.cpu == "cpu"
    T, D = (256, 2) if interpret and args.T == 131072 else (args.T, args.documents)
    H, H_kv, K = (4, 2, 32) if interpret else (32, 4, 128)
    r = 4 if interpret else 16
    config = HTreeConfig(top_k=4 if interpret else 512, compression_rate=r, selection_block=r)
    merge = "pallas_triton" if interpret else "mosaic_gpu"
    iters = 1 if interpret else 5
    keys = jax.random.split(jax.random.key(0), 4)
    q, do = (jax.random.normal(key, (1, T, H, K), jnp.bfloat16) for key in keys[:2])
    k, v = (jax.random.normal(key, (1, T, H_kv, K), jnp.bfloat16) for key in keys[2:])
    n = T // D
    packing = pack_layout(jnp.asarray(np.repeat(np.arange(D), n)[None], jnp.int32), config,
                          virtual_length(config, T, D, n), n)
    tuning = KernelConfigs.resolve(None, K, K)
    rows = lambda x: x.reshape((D, n) + x.shape[2:])
    qu, ku, vu, dou = map(rows, (q, k, v, do))

    sel_p = jax.jit(lambda q, k, v: packed_block_selections(q, k, v, packing, config=config, tuning=tuning,
                                                            interpret=interpret)[:2])
    call = Call(config=config, tuning=tuning, interpret=interpret, selection_route="gqa")
    sel_u = jax.jit(lambda q, k, v: block_selections(q, k, v, call)[0])
    fwd_p = jax.jit(lambda q, k, v, s, f: block_forward_pallas(q, k, v, s, PackedLayout(packing, f), config=config,
                                                               merge=merge, interpret=interpret))
    fwd_u = jax.jit(lambda q, k, v, s: block_forward_pallas(q, k, v, s, config=config, merge=merge,
                                                            interpret=interpret))
    bwd_p = jax.jit(lambda q, k, v, o, l, do, s, f: block_backward_pallas(
        q, k, v, o, l, do, s, PackedLayout(packing, f), config=config, interpret=interpret))
    bwd_u = jax.jit(lambda q, k, v, o, l, do, s: block_backward_pallas(q, k, v, o, l, do, s, config=config,
                                                                       interpret=interpret))
    layout = PackedLayout(packing, jnp.zeros((1, packing.virtual_len // r), jnp.int32))  # the tree only
    st = layout.static(block_static(config, packing.virtual_len, H // H_kv, K, K, jnp.bfloat16,
                                    BlockConfig().backward_tile, BlockConfig().backward_num_warps))
    f32 = lambda x: x.astype(jnp.float32)
    tree = jax.jit(lambda k, v: layout.layers(f32(k), f32(v), config, st))
    transpose = jax.jit(lambda k, v, g: jax.vjp(lambda a, b: layout.layers(a, b, config, st),
                                                f32(k), f32(v))[1](g))

    s_p, firsts = sel_p(q, k, v)
    s_u = sel_u(qu, ku, vu)
    o_p, lse_p = fwd_p(q, k, v, s_p, firsts)
    o_u, lse_u = fwd_u(qu, ku, vu, s_u)
    print(f"T={T}, {D} documents, T_v={packing.virtual_len}, {packing.num_layers} layers, {merge}")
    print("| piece | packed ms | unpacked ms |\n|---|---|---|")
    for name, p_ms, u_ms in [
            ("selections", median_ms(sel_p, (q, k, v), iters), median_ms(sel_u, (qu, ku, vu), iters)),
            ("merge", median_ms(fwd_p, (q, k, v, s_p, firsts), iters), median_ms(fwd_u, (qu, ku, vu, s_u), iters)),
            ("backward", median_ms(bwd_p, (q, k, v, o_p, lse_p, do, s_p, firsts), iters),
             median_ms(bwd_u, (qu, ku, vu, o_u, lse_u, dou, s_u), iters)),
            ("tree's transpose", median_ms(transpose, (k, v, tree(k, v)), iters), None)]:
        print(f"| {name} | {p_ms:.1f} | {'-' if u_ms is None else format(u_ms, '.1f')} |", flush=True)


if __name__ == "__main__":
    main()
