"""Decode benchmark (GPU): per-token latency of `htree_jax.decode_step` against dense
decode attention over the same context.

    python benchmarks/bench_decode.py [--contexts 32768,131072,524288] [--batches 1,8] [--top-k 512,64]
                                      [--backends pallas,reference]

B rows, H=32, H_kv=4, K=V=128, bfloat16 (`--shape mla`: `run_mla`, latent attention's
H=128 over one kv head, K=576 with rope_dim=64, V=512, against the byte floor). Each side runs `--steps` consecutive jitted
steps with its cache donated (updated in place), one new token per row per step, the
context growing from `ctx - steps`; the figure is the median over `--repeats` of the
per-step mean. htree: `decode_step` (tree update + walk), per `--backends` (the Pallas
decode kernels, the JAX reference walk). Dense: write the token into a
`[B, ctx, H_kv, K]` cache and `jax.nn.dot_product_attention` of the one query over the
valid keys (cuDNN where it takes the shapes, else XLA). The htree cache is filled by
`build_tree` of random keys (a prefill of 512K tokens with the reference walk would take
long); with `strict_causal` the nodes past the current length change nothing.
"""

from __future__ import annotations

import argparse
import itertools
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from htree_jax import DecodeBlockSizes, HTreeCache, HTreeConfig, build_tree, decode_step, init_cache
from htree_jax.bench import gpu_header, int_list
from htree_jax.cli import DefaultsHelpFormatter
from htree_jax.core.blocks import recent_queries
from htree_jax.core.bounds import tree_radii
from htree_jax.core.quantize import FP8, quantize_rows

H, H_KV, K, V = 32, 4, 128, 128
DTYPE = jnp.bfloat16
MLA_DIMS = dict(H=128, H_kv=1, K=576, V=512)
# HBM bandwidth by device kind (vendor figures), for the dense decode's byte floor.
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}


def per_step_ms(step, state, steps: int, repeats: int):
    """Median over `repeats` of the mean time of `steps` consecutive calls; `step(i, state)
    -> state` consumes (donates) the state it is given."""
    state = jax.block_until_ready(step(0, state))  # compile, warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(steps):
            state = step(i, state)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - start) * 1e3 / steps)
    return statistics.median(times), state


FILL_ROWS = 8


def random_rows(seed: int, shape):
    """`jax.random.normal` of `shape` in blocks of `FILL_ROWS` rows: its float32 bits for
    64 rows of 131072 x 576 would take 18 GiB at once."""
    return jnp.concatenate([jax.random.normal(jax.random.key(seed + rows), (min(FILL_ROWS, shape[0] - rows),) + tuple(shape[1:]), DTYPE)
                            for rows in range(0, shape[0], FILL_ROWS)], axis=0)


def filled_cache(B, ctx, config, lengths, H_kv=H_KV, K=K, V=V, values_from_keys=False, token_dtype=None):
    """A cache whose tree is `build_tree` of `ctx` random tokens per row, each row at its
    `lengths[b]` (with `strict_causal`, the nodes past a row's length change nothing),
    with the tree's radii under `selection="bound"`; `values_from_keys`: no value
    layers (the values are the keys' first `V` latent features). `token_dtype=FP8`: the
    tokens stored in e4m3 with their scales (the nodes those of the bf16 tokens: the
    same work per step as nodes of the tokens read back). Block selection (SPEC 12): the
    recent queries random and no block's selection yet (`-1`): the rows' lengths must
    start a block (`block_start_lengths`), whose first step walks."""
    parts, scales = [], []
    for rows in range(0, B, FILL_ROWS):  # in row blocks (`random_rows`), the tree's sums too
        n = min(FILL_ROWS, B - rows)
        k = jax.random.normal(jax.random.key(rows), (n, ctx, H_kv, K), DTYPE)
        v = jax.random.normal(jax.random.key(B + rows), (n, ctx, H_kv, V), DTYPE)
        layers = build_tree(k, v, config)
        keys = tuple(kl for kl, _ in layers)
        radii = tuple(tree_radii(keys, config.compression_rate, config.rope_dim)[1:]) if config.selection == "bound" else ()
        values = tuple(vl for _, vl in layers)
        if token_dtype is not None:
            (k0, ks), (v0, vs) = quantize_rows(keys[0]), quantize_rows(values[0])
            keys, values = (k0,) + keys[1:], (v0,) + values[1:]
            ks, vs = jnp.swapaxes(ks, 1, 2), jnp.swapaxes(vs, 1, 2)  # `HTreeCache.scales`: [B, H_kv, N_0]
            scales.append((ks,) if values_from_keys else (ks, vs))
        parts.append((keys, values, radii))
        del k, v, layers
    join = lambda i: tuple(jnp.concatenate(layer, axis=0) for layer in zip(*(p[i] for p in parts)))
    values = () if values_from_keys else join(1)
    joined_scales = tuple(jnp.concatenate(x, axis=0) for x in zip(*scales))
    queries, selections = (), ()
    if config.selects_by_block:
        if np.any(np.asarray(lengths) % config.selection_block):
            raise ValueError("filled_cache: with block selection every row's length must start a block")
        queries = (random_rows(7, (B, recent_queries(config), H_kv, H // H_kv, K)),)
        selections = tuple(jnp.full((B, H_kv, config.top_k), -1, jnp.int32) for _ in range(len(keys) - 1))
    return HTreeCache(join(0), values, jnp.asarray(lengths, jnp.int32), join(2), V if values_from_keys else 0,
                      joined_scales, np.dtype(DTYPE).name if token_dtype is not None else "", queries, selections)


def block_start_lengths(lengths, config):
    """`lengths` rounded down to a block's start where `config` selects by block (SPEC 12)."""
    b = config.selection_block
    return np.asarray(lengths) - np.asarray(lengths) % b if config.selects_by_block else lengths


def start_lengths(B, ctx, steps, repeats, spread: bool):
    """Every row at `ctx - (repeats + 1) * steps - 1`, or (`spread`) uniform in
    `[ctx / 8, that]` (a fixed seed)."""
    top = ctx - (repeats + 1) * steps - 1
    if not spread:
        return np.full((B,), top, np.int32)
    return np.random.default_rng(0).integers(ctx // 8, top + 1, size=B).astype(np.int32)


def htree_case(B, ctx, config, steps, repeats, backend, spread=False, dims=None, block_sizes=None,
               values_from_keys=False, token_dtype=None):
    """`decode_step` under `jax.jit` with the cache donated (`dims`: `MLA_DIMS`-like, else
    the GQA shape; `block_sizes`: the decode kernels'; `values_from_keys`: a cache of
    keys only, `v_t=None`; `token_dtype=FP8`: the tokens in e4m3)."""
    d = dims or dict(H=H, H_kv=H_KV, K=K, V=V)
    cache = filled_cache(B, ctx, config, start_lengths(B, ctx, steps, repeats, spread), d["H_kv"], d["K"], d["V"],
                         values_from_keys, token_dtype)
    q_t = jax.random.normal(jax.random.key(2), (B, d["H"], d["K"]), DTYPE)
    k_t = jax.random.normal(jax.random.key(3), (B, d["H_kv"], d["K"]), DTYPE)
    v_t = None if values_from_keys else jax.random.normal(jax.random.key(4), (B, d["H_kv"], d["V"]), DTYPE)
    fn = jax.jit(lambda c: decode_step(q_t, k_t, v_t, c, config, backend=backend, block_sizes=block_sizes),
                 donate_argnums=0)

    def step(i, c):
        return fn(c)[1]
    ms, _ = per_step_ms(step, cache, steps, repeats)
    return ms


def cache_bytes(B, ctx, config, token_dtype) -> int:
    """The bytes of an empty `init_cache` of the GQA shape (no buffers made)."""
    shapes = jax.eval_shape(lambda: init_cache(B, ctx, H_KV, K, V, config, DTYPE, token_dtype=token_dtype))
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(shapes))


def decode_module(B, ctx, config, backend):
    from flax import nnx

    from htree_jax import HTreeAttention

    m = HTreeAttention(H, H * K, num_kv_heads=H_KV, head_dim=K, config=config, backend=backend, decode=True,
                       dtype=DTYPE, param_dtype=DTYPE, rngs=nnx.Rngs(0))
    m.init_cache(B, ctx)
    return m


def module_case(B, ctx, config, steps, repeats, backend):
    """The same step through `HTreeAttention(decode=True)` (projections included,
    in_features = H * K), the functional nnx way: `nnx.split` once, a jitted step over
    the module's state (donated), `nnx.merge` inside."""
    from flax import nnx

    m = decode_module(B, ctx, config, backend)
    m.cache.set_value(filled_cache(B, ctx, config, start_lengths(B, ctx, steps, repeats, False)))
    graphdef, state = nnx.split(m)
    x = jax.random.normal(jax.random.key(5), (B, 1, H * K), DTYPE)

    @functools.partial(jax.jit, donate_argnums=0)
    def fn(carry):
        module = nnx.merge(graphdef, carry[0])
        y = module(x)  # returned: an output nobody reads would be compiled away
        return nnx.state(module), y

    ms, _ = per_step_ms(lambda i, c: fn(c), (state, jnp.zeros((B, 1, H * K), DTYPE)), steps, repeats)
    return ms


def dense_module_case(B, ctx, steps, repeats):
    """Dense decode with the module's own projections (the same `LinearGeneral` layers,
    the same jitted nnx step): q, k, v projected, k, v written into a `[B, ctx, H_kv,
    K]` cache, cuDNN attention of the one query, the output projection. What the module
    column compares with."""
    from flax import nnx

    m = decode_module(B, 8, HTreeConfig(), "reference")  # only its projections are used
    graphdef, state = nnx.split(m)
    x = jax.random.normal(jax.random.key(5), (B, 1, H * K), DTYPE)
    kc = jax.random.normal(jax.random.key(0), (B, ctx, H_KV, K), DTYPE)
    vc = jax.random.normal(jax.random.key(1), (B, ctx, H_KV, V), DTYPE)
    start = ctx - (repeats + 1) * steps - 1

    @functools.partial(jax.jit, donate_argnums=0)
    def fn(carry):
        state, kc, vc, length, _ = carry
        module = nnx.merge(graphdef, state)
        o, kc, vc = dense_decode(module.query(x), kc, vc, module.key(x), module.value(x), length, "cudnn")
        return nnx.state(module), kc, vc, length + 1, module.out(o)

    carry = (state, kc, vc, jnp.asarray(start, jnp.int32), jnp.zeros((B, 1, H * K), DTYPE))
    ms, _ = per_step_ms(lambda i, c: fn(c), carry, steps, repeats)
    return ms


def dense_decode(q_t, kc, vc, k_t, v_t, length, implementation):
    """Dense decode attention: `k_t, v_t [B, 1, H_kv, D]` written at `length` into the
    `[B, ctx, H_kv, D]` caches, then the one query over the valid keys. Returns
    `(o, kc, vc)`."""
    kc = jax.lax.dynamic_update_slice_in_dim(kc, k_t, length, axis=1)
    vc = jax.lax.dynamic_update_slice_in_dim(vc, v_t, length, axis=1)
    lengths = jnp.full((q_t.shape[0],), length + 1, jnp.int32)
    o = jax.nn.dot_product_attention(q_t, kc, vc, key_value_seq_lengths=lengths, implementation=implementation)
    return o, kc, vc


def dense_case(B, ctx, steps, repeats):
    kc = jax.random.normal(jax.random.key(0), (B, ctx, H_KV, K), DTYPE)
    vc = jax.random.normal(jax.random.key(1), (B, ctx, H_KV, V), DTYPE)
    q_t = jax.random.normal(jax.random.key(2), (B, 1, H, K), DTYPE)
    k_t = jax.random.normal(jax.random.key(3), (B, 1, H_KV, K), DTYPE)
    v_t = jax.random.normal(jax.random.key(4), (B, 1, H_KV, V), DTYPE)
    start = ctx - (repeats + 1) * steps - 1

    def make(implementation):
        def fn(state):
            kc, vc, length = state
            o, kc, vc = dense_decode(q_t, kc, vc, k_t, v_t, length, implementation)
            return (kc, vc, length + 1), o
        return jax.jit(fn, donate_argnums=0)

    for implementation in ("cudnn", None):
        try:
            fn = make(implementation)
            state = (kc, vc, jnp.asarray(start, jnp.int32))
            ms, _ = per_step_ms(lambda i, s: fn(s)[0], state, steps, repeats)
            return ms, implementation or "xla"
        except Exception as e:  # noqa: BLE001 - cuDNN refuses some shapes: fall back to XLA
            print(f"dense B={B} ctx={ctx} {implementation}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            kc = jax.random.normal(jax.random.key(0), (B, ctx, H_KV, K), DTYPE)
            vc = jax.random.normal(jax.random.key(1), (B, ctx, H_KV, V), DTYPE)
    return float("nan"), "-"


def dense_latent_case(B, ctx, steps, repeats):
    """Dense decode at the MLA shape in DeepSeek's absorbed form: one latent cache `[B,
    ctx, 576]`, the new row written, the 128 heads' scores over every valid row, the
    values its first 512 features (XLA)."""
    d = MLA_DIMS
    kc = random_rows(0, (B, ctx, d["K"]))
    q_t = jax.random.normal(jax.random.key(2), (B, d["H"], d["K"]), DTYPE)
    k_t = jax.random.normal(jax.random.key(3), (B, 1, d["K"]), DTYPE)
    start = ctx - (repeats + 1) * steps - 1
    scale = d["K"] ** -0.5

    @functools.partial(jax.jit, donate_argnums=0)
    def fn(state):
        kc, length = state
        kc = jax.lax.dynamic_update_slice_in_dim(kc, k_t, length, axis=1)
        logits = jnp.einsum("bhk,btk->bht", q_t, kc, preferred_element_type=jnp.float32) * scale
        logits = jnp.where(jnp.arange(ctx)[None, None, :] <= length, logits, -jnp.inf)
        p = jax.nn.softmax(logits, axis=-1).astype(DTYPE)
        o = jnp.einsum("bht,btv->bhv", p, kc[..., :d["V"]], preferred_element_type=jnp.float32)
        return (kc, length + 1), o

    ms, _ = per_step_ms(lambda i, s: fn(s)[0], (kc, jnp.asarray(start, jnp.int32)), steps, repeats)
    return ms


def cache_read_ms(B, ctx, repeats):
    """One pass over a `[B, ctx, 576]` bfloat16 latent cache (a sum): the measured read floor."""
    kc = random_rows(0, (B, ctx, MLA_DIMS["K"]))
    fn = jax.jit(lambda x: jnp.sum(x, axis=(0, 1), dtype=jnp.float32))
    jax.block_until_ready(fn(kc))
    times = []
    for _ in range(max(3, repeats)):
        start = time.perf_counter()
        jax.block_until_ready(fn(kc))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run_mla(args) -> int:
    """`--shape mla`: per-token decode at latent attention's shape (H=128 over one kv
    head, K=576 with rope_dim=64, V=512; the cache keeps the values apart, and in the
    last column (`rows=64, keys only`) reads them from the keys: DeepSeek's absorbed
    form), against the dense decode's byte floor: every cached latent row (576 bfloat16)
    read once at the device's HBM rate (`HBM_BYTES_PER_S`), beside the measured one-pass
    read of such a cache and the measured dense (absorbed-form XLA) step."""
    kind = jax.devices()[0].device_kind
    rate = next((r for name, r in HBM_BYTES_PER_S.items() if name in kind), float("nan"))
    rows = [(int(x), False) for x in args.wide_rows.split(",") if x] + [(64, True)]
    cols = [f"htree rows={r}{', keys only' if from_keys else ''} ms" for r, from_keys in rows]
    lines = ["| context | B | top_k | layers | " + " | ".join(cols)
             + " | byte floor ms | read ms | dense ms | " + " | ".join(f"floor/{c.removeprefix('htree ').removesuffix(' ms')}" for c in cols) + " |",
             "|---" * (7 + 2 * len(rows)) + "|"]
    print(f"device {kind}: HBM rate {rate / 1e12:.2f} TB/s for the byte floor", flush=True)
    for B in int_list(args.batches):
        for ctx in int_list(args.contexts):
            floor = B * ctx * MLA_DIMS["K"] * 2 / rate * 1e3
            read = cache_read_ms(B, ctx, args.repeats)
            dense = dense_latent_case(B, ctx, args.steps, args.repeats) if not args.no_dense else float("nan")
            for top_k in int_list(args.top_k):
                config = HTreeConfig(top_k=top_k, rope_dim=64)
                ms = [htree_case(B, ctx, config, args.steps, args.repeats, "pallas", dims=MLA_DIMS,
                                 block_sizes=DecodeBlockSizes(wide_rows=r), values_from_keys=from_keys)
                      for r, from_keys in rows]
                lines.append(f"| {ctx} | {B} | {top_k} | {', '.join(map(str, config.layer_sizes(ctx)))} | "
                             + " | ".join(f"{x:.3f}" for x in ms) + f" | {floor:.3f} | {read:.3f} | {dense:.3f} | "
                             + " | ".join(f"{floor / x:.2f}" for x in ms) + " |")
                print(lines[-1], flush=True)
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    p.add_argument("--contexts", default="32768,131072,524288")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--top-k", default="512,64")
    p.add_argument("--backends", default="pallas,reference")
    p.add_argument("--selections", default="bound", help="HTreeConfig.selection rules, comma-separated")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-module", action="store_true", help="skip the HTreeAttention(decode=True) column")
    p.add_argument("--fp8", action="store_true",
                   help="also the pallas step from a cache of e4m3 tokens (init_cache(token_dtype=float8_e4m3fn)), "
                        "and its bytes against the bf16 cache's")
    p.add_argument("--spread", action="store_true",
                   help="also rows at lengths uniform in [ctx/8, ctx] (the pallas backend, batches > 1)")
    p.add_argument("--shape", default="gqa", choices=["gqa", "mla"], help="mla: `run_mla`")
    p.add_argument("--wide-rows", default="64,16", help="with --shape mla: DecodeBlockSizes.wide_rows to time")
    p.add_argument("--no-dense", action="store_true", help="with --shape mla: skip the measured dense step")
    args = p.parse_args(argv)
    dims = ("H={H} H_kv={H_kv} K={K} rope_dim=64 V={V}".format(**MLA_DIMS) if args.shape == "mla"
            else f"H={H} H_kv={H_KV} K=V={K}")
    print(gpu_header("decode", f"{dims} bfloat16; per-token decode",
                     f"python benchmarks/bench_decode.py {' '.join(sys.argv[1:] if argv is None else argv)}"),
          flush=True)
    if args.shape == "mla":
        return run_mla(args)
    parse = int_list
    backends = [b for b in args.backends.split(",") if b]
    extra = (([] if args.no_module else ["module pallas"]) + (["pallas, spread lengths"] if args.spread else [])
             + (["pallas fp8 tokens"] if args.fp8 else []))
    if not args.no_module:
        lines_note = ("module: HTreeAttention(decode=True) with its projections; dense module: the same "
                      "projections around cuDNN decode attention")
        print(lines_note, flush=True)
    columns = [f"htree {b} ms" for b in backends] + [f"htree {e} ms" for e in extra]
    module_cols = [] if args.no_module else ["dense module ms", "dense module/module"]
    lines = ["| context | B | top_k | selection | layers | " + " | ".join(columns) + " | dense ms | dense | "
             + " | ".join(f"dense/{c.split(' ms')[0].removeprefix('htree ')}" for c in columns)
             + "".join(f" | {c}" for c in module_cols) + " |",
             "|---" * (7 + 2 * len(columns) + len(module_cols)) + "|"]
    for B in parse(args.batches):
        for ctx in parse(args.contexts):
            d_ms, impl = dense_case(B, ctx, args.steps, args.repeats)
            dm_ms = None if args.no_module else dense_module_case(B, ctx, args.steps, args.repeats)
            for top_k, selection in itertools.product(parse(args.top_k), args.selections.split(",")):
                config = HTreeConfig(top_k=top_k, selection=selection, selection_block=1)
                h_ms = [htree_case(B, ctx, config, args.steps, args.repeats, b) for b in backends]
                if not args.no_module:
                    h_ms.append(module_case(B, ctx, config, args.steps, args.repeats, "pallas"))
                if args.spread:
                    h_ms.append(htree_case(B, ctx, config, args.steps, args.repeats, "pallas", spread=True)
                                if B > 1 else float("nan"))
                if args.fp8:
                    h_ms.append(htree_case(B, ctx, config, args.steps, args.repeats, "pallas", token_dtype=FP8))
                    bf16, fp8 = (cache_bytes(B, ctx, config, t) for t in (None, FP8))
                    ratio = h_ms[-1] / h_ms[backends.index("pallas")] if "pallas" in backends else float("nan")
                    print(f"B={B} ctx={ctx} top_k={top_k}: cache bytes bf16 {bf16 / 2**30:.2f} GiB, fp8 tokens "
                          f"{fp8 / 2**30:.2f} GiB ({fp8 / bf16:.3f}); fp8 step / bf16 step {ratio:.3f}", flush=True)
                lines.append(f"| {ctx} | {B} | {top_k} | {selection} | {', '.join(map(str, config.layer_sizes(ctx)))} | "
                             + " | ".join(f"{x:.3f}" for x in h_ms) + f" | {d_ms:.3f} | {impl} | "
                             + " | ".join(f"{d_ms / x:.2f}" for x in h_ms)
                             + ("" if dm_ms is None else f" | {dm_ms:.3f} | {dm_ms / h_ms[len(backends)]:.2f}")
                             + " |")
                print(lines[-1], flush=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
