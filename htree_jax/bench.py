"""Forward benchmark: htree (Pallas) vs the JAX reference vs dense cuDNN attention (GPU).

    python -m htree_jax bench [--sizes 8192,32768,131072] [--long 524288]
    python benchmarks/bench_forward.py ...   (the same)
    python -m htree_jax bench --packed 8 [--sizes 131072] [--selection-block 16]   (packed documents, `run_packed`)

B=1, H=32, H_kv=4, K=V=128, bfloat16, causal. Times are medians of `--iters` runs after
one warm-up; `dense/htree` > 1 means htree is faster. Peak device memory is XLA's
compiled plan (arguments + outputs + temporaries) for each function.
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from htree_jax.attention import htree_attention
from htree_jax.cli import DefaultsHelpFormatter
from htree_jax.core.config import HTreeConfig
from htree_jax.core.rope import rope_absolute, rope_layout
from htree_jax.kernel_trace import kernel_ms
from htree_jax.memory import MemoryPlan
from htree_jax.reference import htree_attention_reference
from pallas_kernels.shared.configs import KernelConfigs
from pallas_kernels.shared.guarded import KernelCall
from pallas_kernels.wide.forward import bottom_merge, chunk_start, prepare_wide, select_and_merge, valid_count

B, H, H_KV, K, V = 1, 32, 4, 128, 128


def int_list(text: str) -> list[int]:
    """A size flag, `"8192,32768"` -> `[8192, 32768]`."""
    return [int(x) for x in text.split(",") if x]


def head_shapes(text: str) -> list[tuple[int, int]]:
    """A `--shapes` flag, `"32/4,32/8,4/1"` -> `[(32, 4), (32, 8), (4, 1)]`: the queries'
    heads over the keys' (`H / H_kv`, a whole GQA group)."""
    shapes = []
    for item in (x for x in text.split(",") if x):
        h, _, h_kv = item.partition("/")
        if not (h.isdigit() and h_kv.isdigit() and int(h_kv) > 0 and int(h) % int(h_kv) == 0):
            raise ValueError(f"--shapes: each is H/H_kv with H a multiple of H_kv > 0, got {item!r}")
        shapes.append((int(h), int(h_kv)))
    if not shapes:
        raise ValueError(f"--shapes: at least one H/H_kv, got {text!r}")
    return shapes


def gpu_header(benchmark: str, setting: str, command: str) -> str:
    """The first line a benchmark prints (date, device, jax, its setting, the command that
    reproduces it); refuses to run off a GPU, where there is nothing to time against."""
    if jax.default_backend() != "gpu":
        raise ValueError(f"the {benchmark} benchmark needs a CUDA GPU (it times cuDNN and the Pallas kernels)")
    return f"# {datetime.date.today()} {jax.devices()[0].device_kind}, jax {jax.__version__}, {setting}; command: {command}"


# A timed sample spans at least this long: calls shorter than it run back to back within
# one sample (one sync at its end), so that the host's dispatch and sync, about 0.1 ms,
# do not weigh on sub-millisecond calls (one-layer trees at T=4096).
MIN_SAMPLE_MS = 20.0


def run_header(script: str, argv=None) -> str:
    """The line a benchmark prints first, for RESULTS: `# <date> <device>, jax <version>:
    python <script> <arguments>` (`argv` as given to its `main`, None: the command line's)."""
    arguments = " ".join(argv if argv is not None else sys.argv[1:])
    return (f"# {time.strftime('%Y-%m-%d')} {jax.devices()[0].device_kind}, jax {jax.__version__}: "
            f"python {script} {arguments}")


def median_ms(fn, args, iters):
    """Median ms per call of `fn(*args)` over `iters` samples after one warm-up call; a
    sample is `ceil(MIN_SAMPLE_MS / first call's ms)` calls back to back, divided."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    reps = max(1, math.ceil(MIN_SAMPLE_MS / max((time.perf_counter() - t0) * 1e3, 1e-3)))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) * 1e3 / reps)
    return statistics.median(times)


def planned_gb(fn, args):
    """XLA's planned GiB of `fn(*args)` (`MemoryPlan.peak`); NaN where XLA gives none."""
    try:
        return MemoryPlan.of(jax.jit(fn).lower(*args).compile()).peak / 2**30
    except NotImplementedError:
        return float("nan")


def inputs(T, seed=0, batch: int = B, heads: tuple[int, int] = (H, H_KV)):
    """Random inputs: q, k, v independent standard normal, bfloat16 `[batch, T, heads, 128]`
    (`heads`: the queries' and the keys' `(H, H_kv)`)."""
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (batch, T, heads[0], K), jnp.bfloat16)
    k = jax.random.normal(ks[1], (batch, T, heads[1], K), jnp.bfloat16)
    v = jax.random.normal(ks[2], (batch, T, heads[1], V), jnp.bfloat16)
    return q, k, v


# `correlated_inputs`' defaults, printed in the benchmarks' headers.
CORRELATION = 0.999
NOISE = 0.5


def correlated_inputs(T, seed=0, rho: float = CORRELATION, noise: float = NOISE, dtype=jnp.bfloat16,
                      shape=None, batch: int = B, heads: tuple[int, int] = (H, H_KV)):
    """Inputs whose neighbouring queries attend alike, as in trained models (the premise of
    NSA's blockwise selection and of MoBA): a latent AR(1) process `z_t = rho * z_{t-1} +
    sqrt(1 - rho^2) * e_t` (unit variance, `K` features, `e_t` standard normal) shared by
    q and k, `q = z + noise * n_q`, `k = z + noise * n_k` with independent standard normal
    `n` per head, and `v` standard normal. `shape`: `(B, T, H, H_kv, K, V)`, by default the
    benchmarks' `(batch, T, *heads, 128, 128)`. Returns `q, k, v` in `dtype`.

    With `rho = 0.999` the latent forgets over ~1000 tokens: at T=131072 a block of 16
    consecutive queries needs about a ninth of the bottom layer's per-query gathers
    (`parent_overlap`, benchmarks/RESULTS.md)."""
    B_, T_, H_, H_kv, K_, V_ = shape or (batch, T, *heads, K, V)
    keys = jax.random.split(jax.random.key(seed), 5)
    z0 = jax.random.normal(keys[0], (B_, 1, K_), jnp.float32)
    steps = jnp.sqrt(1.0 - rho**2) * jax.random.normal(keys[1], (B_, T_ - 1, K_), jnp.float32)
    # z_t = rho * z_{t-1} + step_t as a parallel scan of affine maps (a, b): x -> a * x + b.
    a = jnp.full((1, T_ - 1, 1), rho, jnp.float32)
    compose = lambda f, g: (f[0] * g[0], g[0] * f[1] + g[1])
    _, b = jax.lax.associative_scan(compose, (jnp.broadcast_to(a, steps.shape), steps), axis=1)
    powers = jnp.cumprod(jnp.broadcast_to(a, (1, T_ - 1, 1)), axis=1)
    z = jnp.concatenate([z0, powers * z0 + b], axis=1)  # [B, T, K]
    q = z[:, :, None] + noise * jax.random.normal(keys[2], (B_, T_, H_, K_), jnp.float32)
    k = z[:, :, None] + noise * jax.random.normal(keys[3], (B_, T_, H_kv, K_), jnp.float32)
    v = jax.random.normal(keys[4], (B_, T_, H_kv, V_), jnp.float32)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


INPUTS = {"random": inputs, "correlated": correlated_inputs}


def input_kinds(choice: str) -> list[str]:
    """`--inputs random|correlated|both` -> the generators' names."""
    if choice not in ("random", "correlated", "both"):
        raise ValueError(f"--inputs must be random, correlated or both, got {choice!r}")
    return ["random", "correlated"] if choice == "both" else [choice]


def inputs_setting(kinds) -> str:
    """What the header says of the inputs."""
    text = ", ".join(kinds)
    if "correlated" in kinds:
        text += f" (correlated: latent AR(1) rho={CORRELATION}, q = z + {NOISE}*noise, k = z + {NOISE}*noise, v random)"
    return f"inputs {text}"


OVERLAP_BLOCKS = (4, 16, 64)


def parent_overlap(selected, block: int, kv_head: int = 0):
    """How alike neighbouring queries select: for blocks of `block` consecutive queries
    in the second half of the sequence (one kv head, batch row 0), the size of the union
    of their parent lists `selected [B, T, H_kv, top_k]` (`-1` padded) as a fraction of
    `block * top_k`, averaged over the blocks. 1: disjoint lists; `1 / block`: equal."""
    sel = selected[0, :, kv_head]  # [T, top_k]
    T, top_k = sel.shape
    half = sel[T // 2:][: (T - T // 2) // block * block]
    rows = jnp.sort(half.reshape(-1, block * top_k), axis=-1)
    distinct = (rows >= 0) & jnp.concatenate([jnp.ones_like(rows[:, :1], bool), rows[:, 1:] != rows[:, :-1]], -1)
    return float(jnp.mean(jnp.sum(distinct, axis=-1) / (block * top_k)))


def overlap_row(kind: str, config, T: int, selected) -> str:
    """A markdown row of the overlap table: per selecting layer (the parents of layer
    `l`, top first), the union fraction at each of `OVERLAP_BLOCKS`."""
    L = config.num_layers(T)
    cells = []
    for depth, sel in enumerate(selected):
        layer = L - 2 - depth
        fractions = " / ".join(f"{parent_overlap(sel, b):.2f}" for b in OVERLAP_BLOCKS)
        cells.append(f"parents of layer {layer}{' (bottom)' if layer == 0 else ''}: {fractions}")
    return f"| {kind} | {T} | {config.top_k} | {'; '.join(cells) or '- (one layer)'} |"


def dense_fn(config, seq_lengths=None):
    """Dense causal cuDNN attention with RoPE at absolute positions (of each row;
    `seq_lengths [B]`: each row's valid tokens)."""
    seq = None if seq_lengths is None else jnp.asarray(seq_lengths, jnp.int32)

    def f(q, k, v):
        qr = rope_absolute(q, config.rope_base).astype(q.dtype)
        kr = rope_absolute(k, config.rope_base).astype(k.dtype)
        return jax.nn.dot_product_attention(qr, kr, v, is_causal=True, implementation="cudnn",
                                            scale=config.score_scale(K), query_seq_lengths=seq,
                                            key_value_seq_lengths=seq)
    return jax.jit(f)


def run(sizes, long_sizes, top_ks, iters, reference_max_t, kinds=("random",), selections=("bound",),
        batch: int = B, selection_block: int = 1):
    """Rows per input kind, `top_k`, T and selection rule (`HTreeConfig.selection`: the
    rules of one (kind, top_k, T) one after the other in the same run, dense timed once),
    `batch` rows per call; `selection_block` (16: block selection, SPEC 12)."""
    rows, overlaps = [], []
    for kind in kinds:
        for top_k in top_ks:
            for T in sizes + long_sizes:
                args = INPUTS[kind](T, batch=batch)
                dense_ms = dense_gb = None
                for rule in selections:
                    config = HTreeConfig(top_k=top_k, selection=rule, selection_block=selection_block)
                    # The public entry point, as users call it (input checks, the non-finite guard).
                    htree = jax.jit(lambda q, k, v, c=config: htree_attention(q, k, v, c, backend="pallas"))
                    ref = jax.jit(lambda q, k, v, c=config: htree_attention_reference(q, k, v, c)[0])
                    row = dict(inputs=kind, T=T, top_k=top_k, selection=rule, layers=config.layer_sizes(T))
                    row["htree_ms"] = median_ms(htree, args, iters)
                    row["htree_gb"] = planned_gb(htree, args)
                    row["ref_ms"] = median_ms(ref, args, max(1, iters // 3)) if T <= reference_max_t else None
                    if rule == selections[0]:
                        dense = dense_fn(config)
                        try:
                            dense_ms, dense_gb = median_ms(dense, args, iters), planned_gb(dense, args)
                        except Exception as e:  # noqa: BLE001 - report, e.g. out of memory
                            print(f"dense T={T}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    row["dense_ms"], row["dense_gb"] = dense_ms, dense_gb
                    rows.append(row)
                    print(row, flush=True)
                    if rule == selections[0]:
                        _, selected = jax.jit(lambda q, k, v, c=config: htree_attention(
                            q, k, v, c, backend="pallas", return_selected=True))(*args)
                        overlaps.append(overlap_row(kind, config, T, selected))
                        del selected
    return rows, overlaps


def top_k_cell(row) -> str:
    """`top_k`, and the selection rule where it is not the default (`bound`; rows
    written before 2026-11-26 have no rule: the mean, then the default)."""
    rule = row.get("selection", "mean")
    return str(row["top_k"]) + ("" if rule == "bound" else f" {rule}")


def table(rows):
    fmt = lambda x, spec: "-" if x is None else format(x, spec)
    lines = ["| inputs | T | top_k | layers | htree pallas ms | reference ms | dense cuDNN ms | dense/htree | htree GB | "
             "dense GB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = None if r["dense_ms"] is None else r["dense_ms"] / r["htree_ms"]
        lines.append(
            f"| {r['inputs']} | {r['T']} | {top_k_cell(r)} | {', '.join(map(str, r['layers']))} | {r['htree_ms']:.1f} | "
            f"{fmt(r['ref_ms'], '.1f')} | {fmt(r['dense_ms'], '.1f')} | {fmt(ratio, '.3f')} | "
            f"{r['htree_gb']:.2f} | {fmt(r['dense_gb'], '.2f')} |")
    return "\n".join(lines)


def document_lengths(T: int, docs: int, equal: bool, seed: int = 0) -> list[int]:
    """`docs` lengths summing to `T`: equal, or cut at `docs - 1` distinct random points."""
    if equal:
        return [T // docs] * (docs - 1) + [T - (T // docs) * (docs - 1)]
    cuts = sorted(np.random.default_rng(seed).choice(np.arange(1, T), docs - 1, replace=False).tolist())
    return list(np.diff([0] + cuts + [T]).tolist())


def padded_documents(x, lengths):
    """`x [1, T, ...]` -> `[D, longest, ...]`, document `d` in row `d`, zero padded
    (`longest` rounded up to a multiple of 128: cuDNN's backward takes no other)."""
    longest, starts = -(-max(lengths) // 128) * 128, np.concatenate([[0], np.cumsum(lengths)[:-1]])
    rows = [jnp.pad(x[0, s:s + n], [(0, longest - n)] + [(0, 0)] * (x.ndim - 2)) for s, n in zip(starts, lengths)]
    return jnp.stack(rows)


def dense_documents_fn(config, lengths):
    """Dense cuDNN attention with the documents' structure: each document causal on its
    own, as a padded batch `[D, longest]` with its lengths (`jax.nn.dot_product_attention`
    has no packed-sequence form, and a `[T, T]` segment mask does not fit at 128K); RoPE
    positions count from each document's start. Returns `(fn, to_documents)`."""
    return dense_fn(config, lengths), lambda x: padded_documents(x, lengths)


def grad_of_sum(fn):
    """`fn`'s forward and backward, what the benchmarks time as "fwd+bwd": the gradient
    with respect to `q, k, v` of the float32 sum of `fn(q, k, v, *rest)` (not jitted)."""
    return jax.grad(lambda q, k, v, *rest: jnp.sum(fn(q, k, v, *rest).astype(jnp.float32)), argnums=(0, 1, 2))


def run_packed(T: int, docs: int, top_ks, iters: int, kinds=("random",), grad: bool = True, selection_block: int = 1):
    """One row of `T` tokens packed with `docs` documents (equal lengths, then random
    lengths) against the same tokens as `docs` unpacked rows (equal lengths only: the
    same shapes) and dense cuDNN with the documents' structure. Forward, and forward +
    backward with `grad`. htree is told the documents' count and longest length
    (`max_documents`, `max_document_len`), as a data pipeline knows them.
    `selection_block > 1`: block selection (SPEC 12) at that block."""
    lines = ["| inputs | documents | top_k | pass | htree packed ms | htree B=docs unpacked ms | packed/unpacked | "
             "dense documents ms | dense/packed |", "|---|---|---|---|---|---|---|---|---|"]
    for kind in kinds:
        q, k, v = INPUTS[kind](T)
        for equal in (True, False):
            lengths = document_lengths(T, docs, equal)
            seg = jnp.asarray(np.repeat(np.arange(docs), lengths)[None], jnp.int32)
            label = f"{docs} x {lengths[0]}" if equal else f"{docs} random ({min(lengths)}..{max(lengths)})"
            for top_k in top_ks:
                config = HTreeConfig(top_k=top_k, selection_block=selection_block)
                packed = lambda q, k, v, s, c=config, n=max(lengths): htree_attention(
                    q, k, v, c, backend="pallas", segment_ids=s, max_documents=docs, max_document_len=n)
                unpacked = lambda q, k, v, c=config: htree_attention(q, k, v, c, backend="pallas")
                dense, to_docs = dense_documents_fn(config, lengths)
                split = lambda x: x.reshape((docs, T // docs) + x.shape[2:])
                passes = [("forward", jax.jit(packed), jax.jit(unpacked), dense)]
                if grad:
                    passes.append(("fwd+bwd", *(jax.jit(grad_of_sum(f)) for f in (packed, unpacked, dense))))
                for name, p_fn, u_fn, d_fn in passes:
                    p_ms = median_ms(p_fn, (q, k, v, seg), iters)
                    u_ms = median_ms(u_fn, tuple(split(x) for x in (q, k, v)), iters) if equal else None
                    d_ms = median_ms(d_fn, tuple(to_docs(x) for x in (q, k, v)), iters)
                    fmt = lambda x: "-" if x is None else f"{x:.1f}"
                    lines.append(f"| {kind} | {label} | {top_k} | {name} | {p_ms:.1f} | {fmt(u_ms)} | "
                                 f"{'-' if u_ms is None else format(p_ms / u_ms, '.3f')} | {d_ms:.1f} | "
                                 f"{d_ms / p_ms:.3f} |")
                    print(lines[-1], flush=True)
    return "\n".join(lines)


# Latent attention (DeepSeek MLA, seeds 003/004): 128 query heads over one latent kv head,
# K = 512 latent + 64 RoPE features, V = 512 (the latent's first 512 features).
MLA = dict(B=1, H=128, H_kv=1, K=576, rope_dim=64, V=512)
IDEAL_DENSE_TFLOPS = 600.0


def mla_inputs(T: int, seed: int = 0):
    """Random bfloat16 inputs of the MLA shape."""
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (MLA["B"], T, MLA["H"], MLA["K"]), jnp.bfloat16)
    k = jax.random.normal(ks[1], (MLA["B"], T, MLA["H_kv"], MLA["K"]), jnp.bfloat16)
    v = jax.random.normal(ks[2], (MLA["B"], T, MLA["H_kv"], MLA["V"]), jnp.bfloat16)
    return q, k, v


def ideal_dense_ms(T: int, backward: bool = False) -> float:
    """Causal dense attention's FLOPs, `T^2 * H * (K + V)` forward (3.5x that with the
    backward), at `IDEAL_DENSE_TFLOPS`, in ms."""
    flops = T * T * MLA["H"] * (MLA["K"] + MLA["V"]) * (3.5 if backward else 1.0)
    return flops / (IDEAL_DENSE_TFLOPS * 1e12) * 1e3


def chunked_dense_fn(config, block: int = 512):
    """Dense causal attention in XLA, query blocks of `block` (cuDNN takes no K = 576):
    each block scores every key under the causal mask (twice the causal FLOPs, none of
    a `T x T` score matrix alive), rematerialised under autodiff; RoPE on the last
    `rope_dim` features at absolute positions, as htree's."""
    def f(q, k, v):
        qr = rope_absolute(rope_layout(q, config.rope_dim), config.rope_base, config.rope_dim).astype(q.dtype)
        kr = rope_absolute(rope_layout(k, config.rope_dim), config.rope_base, config.rope_dim).astype(k.dtype)
        B, T, H, K = q.shape
        kr, vv = kr[:, :, 0], v[:, :, 0]  # one latent kv head

        @jax.checkpoint
        def one(i):
            qb = lax.dynamic_slice_in_dim(qr, i * block, block, axis=1)  # [B, block, H, K]
            s = jnp.einsum("bqhk,btk->bhqt", qb, kr, preferred_element_type=jnp.float32) * config.score_scale(K)
            rows = i * block + jnp.arange(block)
            s = jnp.where(rows[:, None] >= jnp.arange(T)[None, :], s, -jnp.inf)
            p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
            return jnp.einsum("bhqt,btv->bqhv", p, vv, preferred_element_type=jnp.float32).astype(q.dtype)

        o = lax.map(one, jnp.arange(T // block))  # [T/block, B, block, H, V]
        return jnp.moveaxis(o, 0, 1).reshape(B, T, H, -1)
    return f


def bottom_merge_tflops(config, args, iters: int, value_dim: int | None = None) -> tuple[float, float]:
    """Useful TFLOP/s of the wide kernels' bottom merge (`pallas_kernels.wide.kernels`) on the
    middle chunk of one MLA-shaped call: every valid candidate's score (K features) and
    value (V) for each of the 128 heads, over the kernel's mean device time in `iters`
    profiled calls (`kernel_trace.kernel_ms`), and over the whole call's median wall time
    (dispatch included): `(kernel, call)`. `args = (q, k, v)`, or `(q, k, None)` with
    `value_dim`: values read from the latent keys."""
    q, k, v = args
    R = config.partial_rope(q.shape[-1])
    V = value_dim if v is None else v.shape[-1]
    bs = KernelConfigs.resolve(None, q.shape[-1], V)
    call = KernelCall(config, bs, value_dim=V, q_layout="given")
    plan = jax.jit(lambda q, k: prepare_wide(q, rope_layout(k, R), v, call))(q, k)

    def above(plan):
        queries, norms, t, parents, state = chunk_start(plan, plan.num_chunks // 2)
        for l in reversed(range(1, plan.num_layers)):
            state, parents = select_and_merge(plan, l, queries, norms, parents, t, state, False)
        return queries, parents, t, state

    queries, parents, t, state = jax.jit(above)(plan)
    merge = jax.jit(lambda plan, *a: bottom_merge(plan, *a, False, q.dtype))
    merge_args = (plan, queries, parents, t, state)
    jax.block_until_ready(merge(*merge_args))
    # The kernel's device time (profiler), not the call's wall time: the call also pays
    # the host's dispatch of the whole plan pytree and the XLA ops around the kernel.
    ms = kernel_ms(lambda: merge(*merge_args), "_merge_kernel", iters)
    call_ms = median_ms(merge, merge_args, iters)
    n = valid_count(plan, parents, t, 0)
    flops = 2.0 * float(jnp.sum(n)) * (q.shape[2] // k.shape[2]) * (q.shape[-1] + V)
    return flops / ms / 1e9, flops / call_ms / 1e9


MLA_VALUES = ("own", "keys")


def mla_value_forms(choice: str) -> list[str]:
    """`--values`: `own` (v its own array), `keys` (the keys' first V latent features,
    `htree_attention(q, k, None, value_dim=V)`: DeepSeek's absorbed form) or `both`."""
    return list(MLA_VALUES) if choice == "both" else [choice]


def run_mla(sizes, top_ks, iters: int, dense_max_t: int, grad: bool = True, values=("own",),
            selections=("bound",)):
    """`--shape mla`: htree forward (and forward+backward) at the MLA shape against the
    ideal dense time and a measured dense baseline (cuDNN where it takes the shape, else
    `chunked_dense_fn`), with XLA's planned memory; `values` (`mla_value_forms`): the
    value forms timed, each in the same run (the dense baseline reads `v` either way);
    `selections`: the rules timed (the top_k column names a rule other than the bound)."""
    lines = ["| T | top_k | values | pass | htree ms | ideal dense ms | ideal/htree | bottom merge TFLOP/s kernel (call) | "
             "dense ms (which) | dense/htree | htree GB | dense GB |", "|---" * 12 + "|"]
    for T in sizes:
        args = mla_inputs(T)
        dense_rows = {}
        for top_k, rule in ((t, s) for t in top_ks for s in selections):
            config = HTreeConfig(top_k=top_k, rope_dim=MLA["rope_dim"], selection=rule)
            for form in values:
                if form == "own":
                    htree = lambda q, k, v, c=config: htree_attention(q, k, v, c, backend="pallas")
                    form_args, fn_args = args, args
                else:  # the values are the keys' first V latent features: no `v` read
                    htree = lambda q, k, v, c=config: htree_attention(q, k, None, c, backend="pallas",
                                                                      value_dim=MLA["V"])
                    form_args, fn_args = args[:2] + (None,), args
                passes = [("forward", jax.jit(htree), False)]
                if grad:
                    passes.append(("fwd+bwd", jax.jit(grad_of_sum(htree)), True))
                rate = bottom_merge_tflops(config, form_args, iters, MLA["V"])
                for name, fn, backward in passes:
                    ms, gb = median_ms(fn, fn_args, iters), planned_gb(fn, fn_args)
                    if name not in dense_rows:
                        dense_rows[name] = measure_dense_mla(config, args, backward, iters, T <= dense_max_t)
                    d_ms, d_which, d_gb = dense_rows[name]
                    ideal = ideal_dense_ms(T, backward)
                    fmt = lambda x, spec: "-" if x is None else format(x, spec)
                    label = f"{top_k}{'' if rule == 'bound' else ' ' + rule}"
                    lines.append(f"| {T} | {label} | {form} | {name} | {ms:.1f} | {ideal:.1f} | {ideal / ms:.3f} | "
                                 f"{rate[0]:.1f} ({rate[1]:.1f}) | {fmt(d_ms, '.1f')} ({d_which}) | "
                                 f"{fmt(None if d_ms is None else d_ms / ms, '.3f')} | {gb:.2f} | {fmt(d_gb, '.2f')} |")
                    print(lines[-1], flush=True)
    return "\n".join(lines)


def measure_dense_mla(config, args, backward: bool, iters: int, run_it: bool):
    """`(ms, which, GB)` of the best dense attention that runs the MLA shape."""
    if not run_it:
        return None, "not run", None
    cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    for which, f in (("cuDNN", cudnn), ("XLA query-chunked", chunked_dense_fn(config))):
        fn = jax.jit(grad_of_sum(f) if backward else f)
        try:
            return median_ms(fn, args, max(1, iters // 2)), which, planned_gb(fn, args)
        except Exception as e:  # noqa: BLE001 - cuDNN refuses K = 576: say so, take the next
            print(f"dense {which}: {type(e).__name__}: {str(e)[:160]}", flush=True)
    return None, "failed", None


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="8192,32768,131072", help="sequence lengths T, comma-separated")
    p.add_argument("--long", default="524288",
                   help="more lengths, comma-separated, after --sizes (\"\" for none; the README's long row)")
    p.add_argument("--top-k", default="512,64", help="HTreeConfig.top_k values, comma-separated")
    p.add_argument("--iters", type=int, default=5, help="timed calls per measurement after one warm-up (median)")
    p.add_argument("--batch", type=int, default=B, help=f"batch rows B (default {B})")
    p.add_argument("--reference-max-t", type=int, default=32768,
                   help="time the JAX reference up to this T (it is slow and memory-hungry beyond)")
    p.add_argument("--inputs", default="random", help="random, correlated (`correlated_inputs`) or both")
    p.add_argument("--selection", default="bound",
                   help="HTreeConfig.selection rules, comma-separated (mean, bound): each timed in the same run")
    p.add_argument("--packed", type=int, default=0,
                   help="N > 0: one row of --sizes[0] tokens (default 131072) packed with N documents, equal and "
                        "random lengths, against N unpacked rows and dense cuDNN per document (`run_packed`)")
    p.add_argument("--no-grad", action="store_true", help="with --packed or --shape mla: the forward only")
    p.add_argument("--selection-block", type=int, default=1,
                   help="HTreeConfig.selection_block of the gqa shape: 1 (here the default, per-query selection, as "
                        "RESULTS' rows without this flag were measured) or 16 (block selection, SPEC 12: "
                        "HTreeConfig()'s default)")
    p.add_argument("--shape", default="gqa", choices=["gqa", "mla"],
                   help="mla: B=1, H=128, H_kv=1, K=576, rope_dim=64, V=512 (`run_mla`; --sizes default "
                        "32768,131072), against the ideal dense time and the best dense JAX runs")
    p.add_argument("--dense-max-t", type=int, default=32768, help="with --shape mla: the longest dense baseline")
    p.add_argument("--values", default="own", choices=MLA_VALUES + ("both",),
                   help="with --shape mla: own (v its own array), keys (v=None, value_dim=V: the keys' latent "
                        "features) or both (`mla_value_forms`)")


def overlap_table(overlaps) -> str:
    blocks = " / ".join(f"Bq={b}" for b in OVERLAP_BLOCKS)
    return "\n".join([f"Union of the parent lists of Bq consecutive queries / (Bq * top_k), second half of the "
                      f"sequence, kv head 0 ({blocks}):", "| inputs | T | top_k | overlap |", "|---|---|---|---|"]
                     + list(overlaps))


def run_bench(args, argv=()) -> int:
    kinds = input_kinds(args.inputs)
    if args.shape == "mla":
        sizes = int_list(args.sizes) if "--sizes" in " ".join(argv) else [32768, 131072]
        print(gpu_header("mla", ", ".join(f"{k}={v}" for k, v in MLA.items()) + " bfloat16, random inputs, "
                         f"ideal dense at {IDEAL_DENSE_TFLOPS:.0f} TFLOP/s", f"python -m htree_jax bench {' '.join(argv)}"))
        print(run_mla(sizes, int_list(args.top_k), args.iters, args.dense_max_t, not args.no_grad,
                      mla_value_forms(args.values), tuple(x for x in args.selection.split(",") if x)))
        return 0
    if args.packed:
        T = int_list(args.sizes)[0] if "--sizes" in " ".join(argv) else 131072
        print(gpu_header("packed", f"T={T} H={H} H_kv={H_KV} K=V={K} bfloat16, {inputs_setting(kinds)}",
                         f"python -m htree_jax bench {' '.join(argv)}"))
        print(run_packed(T, args.packed, int_list(args.top_k), args.iters, kinds, not args.no_grad,
                         args.selection_block))
        return 0
    print(gpu_header("forward", f"B={args.batch} H={H} H_kv={H_KV} K=V={K} bfloat16, {inputs_setting(kinds)}",
                     f"python -m htree_jax bench {' '.join(argv)}"))
    selections = tuple(x for x in args.selection.split(",") if x)
    rows, overlaps = run(int_list(args.sizes), int_list(args.long), int_list(args.top_k), args.iters,
                         args.reference_max_t, kinds, selections, args.batch, args.selection_block)
    print(table(rows))
    print(overlap_table(overlaps))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter, prog="bench_forward")
    add_bench_arguments(p)
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_bench(p.parse_args(argv), argv)
