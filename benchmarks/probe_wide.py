"""The wide kernels alone at latent attention's shape (`pallas_kernels/wide.py`), on the
probe's terms (`../shared/probes/mla_sparse_feasibility.py`): Q queries of 128 heads
over one latent kv head, each with `Mp` valid candidates (random ascending parents of a
layer of `N` nodes), K = 512 latent + 64 RoPE, values the first 512 latent features,
bf16. Times the bottom merge, a selecting layer's merge (half the candidates kept),
and the importance pass, with their useful FLOPs (a score counts K = 576, a value 512;
the importance's two passes both count), then the forward end to end.

    python -m benchmarks.probe_wide [--Q 4096] [--N 131072] [--Mp 1024] [--variants 64:64:8:1,...]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from htree_jax import HTreeConfig, htree_attention
from htree_jax.bench import MLA, bottom_merge_tflops, ideal_dense_ms, median_ms, mla_inputs
from htree_jax.core.rope import rope_layout
from pallas_kernels.importance import feature_pieces
from pallas_kernels.plan import BlockSizes
from pallas_kernels.precision import Precisions, key_operands
from pallas_kernels.rope import full_width, padded_rope_table, rotate_copies, rotate_half
from pallas_kernels.wide import WideStatic, wide_importance_pallas, wide_merge_pallas
from pallas_kernels.wide_forward import wide_forward_pallas


def inputs(Q, N, Mp, r, tile, seed=0):
    rng = np.random.default_rng(seed)
    P = Mp // r
    parents = np.sort(np.stack([rng.choice(N // r, P, replace=False) for _ in range(min(Q, 256))]), axis=1)
    parents = jnp.asarray(np.resize(parents, (Q, P)).astype(np.int32))[None, :, None, :]
    n = jnp.full((1, Q, 1, 1), Mp, jnp.int32)
    ks = jax.random.split(jax.random.key(seed), 4)
    H, DL, DR = MLA["H"], 512, 64
    q_lat = jax.random.normal(ks[0], (1, Q, 1, H, DL), jnp.bfloat16)
    q_rope = jax.random.normal(ks[1], (1, Q, 1, H, DR), jnp.float32)
    lat = jax.random.normal(ks[2], (1, 1, N, DL), jnp.bfloat16)
    rope = jax.random.normal(ks[3], (1, 1, N, DR), jnp.bfloat16)
    cos, sin = padded_rope_table(Mp, DR, 10000.0, DR // 2)
    copies = rotate_copies(rope, cos, sin, r, tile // r)
    keys = jnp.asarray(rng.permutation(Mp).astype(np.int32))[None, None, None, :].repeat(Q, 1)
    tau = jnp.full((1, Q, 1, 1), Mp // 2, jnp.int32)
    return dict(queries=(q_lat, q_rope, rotate_half(q_rope)), parents=parents, n=n, lat=lat, copies=copies,
                tables=(full_width(cos), full_width(sin)), keys=keys, tau=tau)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--Q", type=int, default=4096)
    p.add_argument("--N", type=int, default=131072)
    p.add_argument("--Mp", type=int, default=1024)
    p.add_argument("--variants", default="64:64:8:1", help="rows:tile:warps:stages,...")
    p.add_argument("--forward", default="32768,131072", help="end-to-end forward sizes (top_k=64); '' for none")
    p.add_argument("--iters", type=int, default=3)
    args = p.parse_args(argv)
    pr = Precisions.for_dtype(jnp.bfloat16)
    H = MLA["H"]
    for variant in args.variants.split(","):
        rows, tile, warps, stages = (int(x) for x in variant.split(":"))
        a = inputs(args.Q, args.N, args.Mp, 16, tile)
        ws = WideStatic(r=16, tile=tile, rows=rows, alpha=576 ** -0.5, importance="softmax", strict_causal=True,
                        lat_pieces=feature_pieces(512), value_pieces=feature_pieces(512), precision=pr.scores,
                        importance_operands=pr.importance_operands, merge_precision=pr.merge,
                        merge_operands=pr.merge_operands, num_warps=warps, num_stages=stages)
        state = (jnp.full((1, args.Q, 1, H), -jnp.inf, jnp.float32), jnp.zeros((1, args.Q, 1, H), jnp.float32),
                 jnp.zeros((1, args.Q, 1, H, 512), jnp.float32))
        merge_keys = key_operands(a["copies"], pr.merge, pr.merge_operands)
        imp_keys = key_operands(a["copies"], pr.scores, pr.importance_operands)
        pair_flops = args.Q * H * args.Mp * 2
        merge = lambda keys, tau, st, queries, parents, n, lat, keys_parts, tables: wide_merge_pallas(
            queries, parents, n, keys, tau, lat, keys_parts, None, tables, st, ws,
            out_dtype=jnp.bfloat16 if keys is None else None, return_lse=keys is None)
        common = (a["queries"], a["parents"], a["n"], a["lat"])
        runs = {  # arrays as arguments: a closure would make them constants of the program
            "bottom merge": (lambda s, *x: merge(None, None, s, *x), (state, *common, merge_keys, a["tables"]),
                             pair_flops * (576 + 512)),
            "selecting merge (half kept)": (lambda kt, s, *x: merge(*kt, s, *x),
                                            ((a["keys"], a["tau"]), state, *common, merge_keys, a["tables"]),
                                            pair_flops * (576 + 512)),
            "importance (2 passes)": (lambda *x: wide_importance_pallas(*x, ws=ws),
                                      (*common, imp_keys, a["tables"]), pair_flops * 576 * 2),
        }
        for name, (fn, fn_args, flops) in runs.items():
            try:
                ms = median_ms(jax.jit(fn), fn_args, args.iters)
                print(f"rows={rows} tile={tile} warps={warps} stages={stages} {name}: {ms:.2f} ms, "
                      f"{flops / ms / 1e9:.1f} TFLOP/s useful", flush=True)
            except Exception as e:  # noqa: BLE001 - a variant that does not compile: say so, go on
                print(f"rows={rows} tile={tile} warps={warps} stages={stages} {name}: FAIL {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:200]}", flush=True)
    for T in [int(x) for x in args.forward.split(",") if x]:
        q, k, v = mla_inputs(T)
        config = HTreeConfig(top_k=64, rope_dim=MLA["rope_dim"])
        R = config.rope_dim
        forms = {  # values as their own array (what `bench --shape mla` runs), or the keys' first 512 latent features
            "own values": (lambda q, k, v: htree_attention(q, k, v, config, backend="pallas"), (q, k, v)),
            "values = latent keys": (lambda q, k: wide_forward_pallas(rope_layout(q, R), rope_layout(k, R), None, config,
                                                                      BlockSizes.for_dims(576, 512), value_dim=512)[0],
                                     (q, k)),
        }
        for form, (fn, fn_args) in forms.items():
            ms = median_ms(jax.jit(fn), fn_args, args.iters)
            rate = bottom_merge_tflops(config, (q, k, v if form == "own values" else None), args.iters, 512)
            print(f"forward T={T} top_k=64 {form}: {ms:.1f} ms, ideal dense {ideal_dense_ms(T):.1f} ms, "
                  f"ideal/htree {ideal_dense_ms(T) / ms:.3f}; bottom merge (middle chunk) {rate:.1f} TFLOP/s",
                  flush=True)
        del q, k, v


if __name__ == "__main__":
    main()
