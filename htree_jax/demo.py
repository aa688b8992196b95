"""`python -m htree_jax demo`: run htree through the public API and report on it."""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from htree_jax.attention import htree_attention
from htree_jax.backends import full_sequence_backend
from htree_jax.core.config import HTreeConfig
from htree_jax.core.rope import rope_absolute
from htree_jax.core.validation import check_qkv
from htree_jax.introspect import candidates_per_query
from reference_numpy import htree_attention_numpy

# Outputs within this of the float64 oracle count as agreement (values are O(1)).
AGREEMENT_TOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-len", "-T", type=int, default=4096, help="sequence length T (default 4096)")
    p.add_argument("--batch", "-B", type=int, default=1, help="batch size B")
    p.add_argument("--heads", type=int, default=8, help="query heads H")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads H_kv (H %% H_kv == 0)")
    p.add_argument("--head-dim", type=int, default=64, help="query/key head dim K (even)")
    p.add_argument("--value-dim", type=int, default=None, help="value head dim V (default: K)")
    p.add_argument("--compression-rate", type=int, default=16, help="children per node r")
    p.add_argument("--top-k", type=int, default=64, help="nodes refined per layer (demo default 64)")
    p.add_argument("--rope-base", type=float, default=10000.0, help="RoPE base (rotate-half, base^(-2i/R))")
    p.add_argument("--rope-dim", type=int, default=None,
                   help="features rotated, the last R of K (default: all K; HTreeConfig.rope_dim)")
    p.add_argument("--scale", type=float, default=None, help="score scale (default K**-0.5)")
    p.add_argument("--importance", default="softmax", help="softmax | shared_max")
    p.add_argument("--selection", default="bound", choices=["bound", "mean"],
                   help="node ranking (HTreeConfig.selection): bound (default, SPEC 11) or mean (the original rule)")
    p.add_argument("--selection-block", type=int, default=None,
                   help="HTreeConfig.selection_block: the compression rate (the default: a bottom node's queries "
                        "share each layer's selection, SPEC 12) or 1 (each query selects)")
    p.add_argument("--block-source", default="first", choices=["first", "previous"],
                   help="with block selection, whose queries rank a block (HTreeConfig.block_source)")
    p.add_argument("--no-strict-causal", action="store_true",
                   help="HTreeConfig(strict_causal=False): the rightmost node, whose mean includes tokens after "
                        "the query, enters the importance normaliser, so future keys may change a selection and "
                        "prefix runs and decoding no longer equal the full sequence (default: off, "
                        "strict_causal=True)")
    p.add_argument("--backend", default="auto", help="htree backend (auto | reference | pallas | pallas_interpret)")
    p.add_argument("--dtype", default="float32", choices=sorted(AGREEMENT_TOL), help="input dtype")
    p.add_argument("--seed", type=int, default=0, help="random seed of the inputs")
    p.add_argument("--oracle-samples", type=int, default=6, help="positions checked against the oracle")
    p.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up")
    p.add_argument("--packed", type=int, default=0,
                   help="N > 0: each row packs N documents of equal length (segment_ids); the oracle runs on "
                        "each sampled position's document alone")


class DemoError(ValueError):
    """A bad demo argument, reported with exit code 2."""


def _positive(args, *names):
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise DemoError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def oracle_agreement(o, selected, ref, ref_selected, fragile, tol):
    """Does htree's output agree with the oracle's on sampled queries? `o [B, P, H, V]`
    and `selected` (per layer `[B, P, H_kv, top_k]`) at the sampled positions, `ref`,
    `ref_selected`, `fragile [B, P, H_kv]` from `htree_attention_numpy`.

    A query may select differently, and then differ in output, only where the oracle
    flags a near-tie (`fragile`): that waiver covers that query's heads and nothing
    else. Returns `(agree, same [B, P, H_kv], err)`, `err` the largest output error over
    the queries not waived."""
    same = np.ones(fragile.shape, bool)
    for got, want in zip(selected, ref_selected):
        same &= (np.asarray(got) == want).all(axis=-1)
    G = o.shape[2] // fragile.shape[2]
    robust_heads = np.repeat(~fragile, G, axis=2)  # [B, P, H]
    diff = np.abs(np.asarray(o, np.float64) - ref)[robust_heads]
    err = float(diff.max()) if diff.size else 0.0
    return bool(np.all(same | fragile)) and err <= tol, same, err


def _median_ms(fn, repeats):
    fn()  # warm-up: compilation
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run_demo(args) -> int:
    _positive(args, "seq_len", "batch", "heads", "kv_heads", "head_dim", "value_dim", "repeats")
    if args.oracle_samples < 0:
        raise DemoError(f"--oracle-samples must be >= 0, got {args.oracle_samples}")
    config = HTreeConfig(
        compression_rate=args.compression_rate,
        top_k=args.top_k,
        rope_base=args.rope_base,
        scale=args.scale,
        importance=args.importance,
        strict_causal=not args.no_strict_causal,
        rope_dim=args.rope_dim,
        selection=args.selection,
        selection_block=args.selection_block,
        block_source=args.block_source,
    )
    B, T, H, H_kv, K = args.batch, args.seq_len, args.heads, args.kv_heads, args.head_dim
    V = args.value_dim or K
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(args.seed)
    q = jnp.asarray(rng.standard_normal((B, T, H, K)), dtype)
    k = jnp.asarray(rng.standard_normal((B, T, H_kv, K)), dtype)
    v = jnp.asarray(rng.standard_normal((B, T, H_kv, V)), dtype)
    if args.packed < 0 or args.packed > T:
        raise DemoError(f"--packed must be in [0, T = {T}], got {args.packed}")
    backend = full_sequence_backend(args.backend, check_qkv(q, k, v), config, packed=bool(args.packed), dtype=dtype)
    docs = args.packed or 1
    lengths = [T // docs] * (docs - 1) + [T - T // docs * (docs - 1)]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    segment_ids = np.tile(np.repeat(np.arange(docs), lengths)[None], (B, 1)).astype(np.int32) if args.packed else None
    # Say up front what takes time: the first call compiles (and, on a CPU, the
    # reference's gathers are slow), so the demo is otherwise silent for a while.
    print(f"compiling and running htree at T={T} on {jax.devices()[0].platform} (backend {backend}); on a 2-core CPU "
          "this and the oracle check take about a minute", flush=True)
    run = jax.jit(lambda q, k, v: htree_attention(q, k, v, config, backend=args.backend, return_selected=True,
                                                  segment_ids=segment_ids,
                                                  max_documents=docs if args.packed else None))
    o, selected = run(q, k, v)  # validates (ValueError/TypeError) before any work
    o = np.asarray(o)

    device = jax.devices()[0]
    print(f"htree-jax demo on {device.platform} ({device.device_kind}), jax {jax.__version__}")
    print(f"inputs   B={B} T={T} H={H} H_kv={H_kv} K={K} V={V} {dtype.name}, seed {args.seed}"
          + (f", packed: {docs} documents of {lengths[0]} tokens per row" if args.packed else ""))
    print(
        f"config   compression_rate={config.compression_rate} top_k={config.top_k} "
        f"(max_candidates M={config.max_candidates}) importance={config.importance} "
        f"strict_causal={config.strict_causal} selection_block={config.selection_block}"
        + (f" block_source={config.block_source}" if config.selects_by_block else "")
        + f", backend {args.backend} -> {backend}"
    )
    sizes = config.layer_sizes(T)
    print(f"tree     {len(sizes)} layer(s), nodes per layer bottom->top: {', '.join(map(str, sizes))}")

    cands = candidates_per_query(selected, config, T)
    dense_keys = np.arange(1, T + 1)
    print(
        f"reads    candidates scored per query (all layers): mean {cands.mean():.0f}, max {cands.max()}; "
        f"a dense query reads t+1 keys: mean {dense_keys.mean():.0f}, max {T} "
        f"(last position: {cands[:, -1].max()} vs {T}, {T / cands[:, -1].max():.1f}x fewer)"
    )

    agree = True
    if args.oracle_samples:
        count = min(args.oracle_samples, T)
        positions = np.unique(np.concatenate([[T - 1], rng.choice(T, size=count - 1, replace=False)]))
        tol = AGREEMENT_TOL[dtype.name]
        results = []
        for d, (s, n) in enumerate(zip(starts, lengths)):  # each document alone (one when unpacked)
            mine = positions[(positions >= s) & (positions < s + n)]
            if not len(mine):
                continue
            ref, ref_sel, fragile = htree_attention_numpy(
                np.asarray(q)[:, s:s + n], np.asarray(k)[:, s:s + n], np.asarray(v)[:, s:s + n], config,
                return_selected=True, query_positions=mine - s, return_fragile=True,
            )
            # A document's own layers are the row's lowest (the row's extra ones keep all).
            got_sel = [np.asarray(x)[:, mine] for x in selected[len(selected) - len(ref_sel):]]
            results.append(oracle_agreement(o[:, mine], got_sel, ref, ref_sel, fragile, tol) + (fragile,))
        agree = all(r[0] for r in results)
        same = np.concatenate([r[1].reshape(-1) for r in results])
        err = max(r[2] for r in results)
        fragile = np.concatenate([r[3].reshape(-1) for r in results])
        print(
            f"oracle   float64 NumPy oracle at {len(positions)} positions x {B * H_kv} (batch, kv-head): "
            f"selections identical for {same.sum()}/{same.size}, near-ties {fragile.sum()} (waived for those "
            f"queries only); max |o - oracle| over the other queries = {err:.2e} (tolerance {tol:.0e}): "
            f"{'AGREES' if agree else 'DISAGREES'}"
        )

    htree_ms = _median_ms(lambda: jax.block_until_ready(run(q, k, v)), args.repeats)
    line = f"time     median of {args.repeats} after warm-up: htree ({backend}) {htree_ms:.1f} ms"
    if args.packed:
        line += " (dense comparison: unpacked runs only)"
    elif V == K:
        alpha = config.score_scale(K)
        dense = jax.jit(
            lambda q, k, v: jax.nn.dot_product_attention(
                rope_absolute(q, config.rope_base).astype(dtype),
                rope_absolute(k, config.rope_base).astype(dtype),
                v, is_causal=True, scale=alpha,
            )
        )
        dense_ms = _median_ms(lambda: jax.block_until_ready(dense(q, k, v)), args.repeats)
        line += f", dense jax.nn.dot_product_attention {dense_ms:.1f} ms, dense/htree = {dense_ms / htree_ms:.2f}"
        if backend == "reference":
            line += (" (below 1 is expected here: the JAX reference gathers each query's candidates, which XLA "
                     "does not make cheap; htree's speed is the Pallas kernels' on a GPU, `python -m htree_jax bench`)")
    else:
        line += " (dense comparison needs V == K)"
    print(line)
    return 0 if agree else 1
