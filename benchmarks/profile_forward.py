"""Where the Pallas forward's time goes, per kernel, at one size.

    python -m benchmarks.profile_forward --T 131072 --top-k 512

Times (median of `--iters`, after a warm-up) the tree build once, and every layer's
launches for one chunk of query positions in the middle of the sequence (the top
layer's work grows linearly with t, so the middle chunk is the mean); per-chunk times
are scaled by the number of chunks. Also prints the counted floor per query.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from htree_jax.bench import B, H, H_KV, K, dense_fn, inputs, median_ms
from htree_jax import HTreeConfig
from pallas_kernels.forward import BlockSizes, candidate_count, prepare, top_layer_parents
from pallas_kernels.layer_forward import importance_keys_pallas, merge_pallas, select_top_k_layer_pallas


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, default=131072)
    p.add_argument("--top-k", type=int, default=512)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--interpret", action="store_true", help="CPU smoke test of this script")
    args = p.parse_args(argv)
    ip = args.interpret
    T, config = args.T, HTreeConfig(top_k=args.top_k)
    q, k, v = inputs(T)
    bs = BlockSizes()
    prep_fn = jax.jit(lambda q, k, v: prepare(q, k, v, config, bs, ip, None))
    tree_ms = median_ms(prep_fn, (q, k, v), args.iters)
    prep = prep_fn(q, k, v)
    st, Qc, P, L = prep.st, prep.chunk, prep.parents_width, len(prep.layers)
    chunks = prep.q5.shape[1] // Qc
    c = chunks // 2
    qc = prep.q5[:, c * Qc : (c + 1) * Qc]
    t = jnp.minimum(c * Qc + jnp.arange(Qc, dtype=jnp.int32), T - 1)[None, :, None, None]
    gp, vp = prep.q5.shape[3], prep.layers[0][1].shape[-1]
    parents = top_layer_parents(t, prep, L, (B, Qc, H_KV, P))
    state = (jnp.full((B, Qc, H_KV, gp), -jnp.inf, jnp.float32), jnp.zeros((B, Qc, H_KV, gp), jnp.float32),
             jnp.zeros((B, Qc, H_KV, gp, vp), jnp.float32))
    rows = [("tree build + padding (whole call)", tree_ms, 1)]
    for l in reversed(range(L)):
        kl, vl = prep.layers[l]
        n = candidate_count(parents, t, st.r, l)
        mean_n = float(jnp.mean(n))
        if l > 0:
            st_l = prep.st_top if l == L - 1 else st
            bq = st_l.block_queries
            blocks = lambda x, bq=bq: x[:, ::bq]
            keys_call = jax.jit(lambda *a, st_l=st_l: importance_keys_pallas(*a, st_l, ip))
            kargs = (qc, blocks(parents), blocks(n), kl, prep.cos, prep.sin)
            rows.append((f"layer {l} importance keys ({bq} queries/program, 2 score passes, mean n={mean_n:.0f})",
                         median_ms(keys_call, kargs, args.iters), chunks))
            keys = keys_call(*kargs)
            select_call = jax.jit(lambda *a: select_top_k_layer_pallas(*a, st, ip))
            sargs = (keys, parents, n)
            rows.append((f"layer {l} shared top-K (31-step search + compaction)",
                         median_ms(select_call, sargs, args.iters), chunks))
            nxt, tau = select_call(*sargs)
            merge_call = jax.jit(lambda *a, st_l=st_l: merge_pallas(*a, st_l, ip))
            margs = (qc, blocks(parents), blocks(n), keys, tau, kl, vl, prep.cos, prep.sin, state)
            rows.append((f"layer {l} merge ({bq} queries/program, 1 score pass + values)",
                         median_ms(merge_call, margs, args.iters), chunks))
            state = merge_call(*margs)
            parents = nxt[..., :P]
        else:
            bottom = jax.jit(lambda *a: merge_pallas(*a, st, ip, out_dtype=q.dtype))
            bargs = (qc, parents, n, None, None, kl, vl, prep.cos, prep.sin, state)
            rows.append((f"layer 0 merge + normalise (1 score pass + values, mean n={mean_n:.0f})",
                         median_ms(bottom, bargs, args.iters), chunks))
    dense_ms = float("nan") if ip else median_ms(dense_fn(config), (q, k, v), args.iters)
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}: T={T} top_k={args.top_k} "
          f"layers={config.layer_sizes(T)} B={B} H={H} H_kv={H_KV} K=V={K} bf16, score dots {st.precision}, "
          f"tile {st.tile}, {chunks} chunks of {Qc} positions")
    print("| stage | per chunk ms | chunks | total ms |\n|---|---|---|---|")
    total = 0.0
    for name, ms, times in rows:
        total += ms * times
        print(f"| {name} | {ms:.2f} | {times} | {ms * times:.1f} |")
    print(f"| sum | | | {total:.1f} |\n| dense cuDNN (whole attention) | | | {dense_ms:.1f} |")


if __name__ == "__main__":
    main()
