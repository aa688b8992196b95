"""The top layer's importance and merge kernels grown from a flash-attention pass one
feature at a time (issue 33), each step timed on one chunk of the T=131072, top_k=512
shape: 8192 queries (t in [65536, 73728), n = t // 16 + 1 nodes each), H_kv=4 groups of
8 heads, K=V=128, 8192 nodes, bf16 operands. Each row of the table adds one feature.

    python -m benchmarks.probe_top_growth [--only name,...]
"""

from __future__ import annotations

import argparse
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from htree_jax.bench import median_ms

QC, HKV, G, K, NP, BQ, TILE = 8192, 4, 8, 128, 8192, 16, 64
INTERPRET = False
ROWS = BQ * G
ALPHA = 1 / math.sqrt(K)
LOG_N = 13
NEG = -1e30


def bf16_dot(a, b):
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def pack(imp, positions):
    bits = lax.bitcast_convert_type(imp, jnp.int32)
    return (bits & jnp.int32(-(1 << LOG_N))) | (~positions & jnp.int32((1 << LOG_N) - 1))


def scores_of(i, q, k_refs, dots, tile):
    sl = pl.ds(i * tile, tile)
    if dots == "bf16":
        return bf16_dot(q[0], k_refs[0][sl, :])
    if dots == "x3":
        kh, kl = k_refs[0][sl, :], k_refs[1][sl, :]
        return bf16_dot(q[0], kh) + (bf16_dot(q[0], kl) + bf16_dot(q[1], kh))
    if dots == "x3cat":  # one dot of 3K: [q_hi | q_hi | q_lo] . [k_hi | k_lo | k_hi]
        return bf16_dot(q[2], k_refs[2][sl, :])
    raise ValueError(dots)


def importance_kernel(qh_ref, ql_ref, q3_ref, n_ref, shift_ref, kh_ref, kl_ref, k3_ref, out_ref, keys_ref, *,
                      dots, mode, tile, exp2):
    q = (qh_ref[...].reshape(ROWS, K), ql_ref[...].reshape(ROWS, K), q3_ref[...].reshape(ROWS, 3 * K))
    n_q = n_ref[...].reshape(BQ)
    n_rows = jnp.broadcast_to(n_q[:, None], (BQ, G)).reshape(ROWS)
    num_tiles = (jnp.max(n_q) + tile - 1) // tile
    k_refs = (kh_ref, kl_ref, k3_ref)
    scale = ALPHA * (math.log2(math.e) if exp2 else 1.0)
    ex = jnp.exp2 if exp2 else jnp.exp
    if mode == "stats":
        def body(i, carry):
            m, l = carry
            pos = i * tile + jnp.arange(tile, dtype=jnp.int32)
            s = jnp.where(pos[None, :] < n_rows[:, None] - 1, scale * scores_of(i, q, k_refs, dots, tile), NEG)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            l = l * ex(m - m_new) + jnp.sum(ex(s - m_new[:, None]), axis=1)
            return m_new, l

        m, l = lax.fori_loop(0, num_tiles, body, (jnp.full((ROWS,), NEG, jnp.float32), jnp.zeros((ROWS,), jnp.float32)))
        out_ref[...] = (m + jnp.log2(l) if exp2 else m + jnp.log(l)).reshape(BQ, G)
        return
    shift = shift_ref[...].reshape(ROWS)
    head_sum = (jnp.arange(ROWS, dtype=jnp.int32)[None, :] // G == jnp.arange(BQ, dtype=jnp.int32)[:, None])

    def body(i, carry):
        pos = i * tile + jnp.arange(tile, dtype=jnp.int32)
        s = scale * scores_of(i, q, k_refs, dots, tile)
        w = jnp.where(pos[None, :] < n_rows[:, None] - 1, ex(s - shift[:, None]), 0.0)
        if mode == "keys_dot":  # the head sum as a product with a 0/1 matrix (one bf16 dot: cost only)
            imp = lax.dot_general(head_sum.astype(jnp.bfloat16), w.astype(jnp.bfloat16), (((1,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32)
        else:
            imp = jnp.sum(w.reshape(BQ, G, tile), axis=1)
        keys = jnp.where(pos[None, :] < n_q[:, None], pack(imp, pos), -1)
        if mode == "keys_nostore":
            return carry + jnp.sum(keys, axis=1)
        keys_ref[:, pl.ds(i * tile, tile)] = keys
        return carry

    total = lax.fori_loop(0, num_tiles, body, jnp.zeros((BQ,), jnp.int32))
    out_ref[...] = jnp.broadcast_to(total[:, None].astype(jnp.float32), (BQ, G))


def run_importance(args, dots, mode, tile=TILE, warps=8, stages=2, exp2=False):
    qspec = lambda d: pl.BlockSpec((BQ, None, G, d), lambda i, h: (i, h, 0, 0))
    vec = pl.BlockSpec((BQ, None, G), lambda i, h: (i, h, 0))
    kspec = lambda d: pl.BlockSpec((None, NP, d), lambda i, h: (h, 0, 0))
    call = pl.pallas_call(
        functools.partial(importance_kernel, dots=dots, mode=mode, tile=tile, exp2=exp2),
        grid=(QC // BQ, HKV),
        in_specs=[qspec(K), qspec(K), qspec(3 * K), pl.BlockSpec((BQ, None, 1), lambda i, h: (i, h, 0)), vec,
                  kspec(K), kspec(K), kspec(3 * K)],
        out_specs=[vec, pl.BlockSpec((BQ, None, NP), lambda i, h: (i, h, 0))],
        out_shape=[jax.ShapeDtypeStruct((QC, HKV, G), jnp.float32), jax.ShapeDtypeStruct((QC, HKV, NP), jnp.int32)],
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=INTERPRET,
    )
    return median_ms(jax.jit(call), args, 5)


def merge_kernel(q_ref, n_ref, keys_ref, tau_ref, k_ref, v_ref, o_ref, *, mask, tile, exp2):
    q = q_ref[...].reshape(ROWS, K)
    n_q = n_ref[...].reshape(BQ)
    n_rows = jnp.broadcast_to(n_q[:, None], (BQ, G)).reshape(ROWS)
    tau = tau_ref[...]
    num_tiles = (jnp.max(n_q) + tile - 1) // tile
    scale = ALPHA * (math.log2(math.e) if exp2 else 1.0)
    ex = jnp.exp2 if exp2 else jnp.exp
    row_query = jnp.arange(ROWS, dtype=jnp.int32) // G
    tau_rows = jnp.broadcast_to(tau, (BQ, G)).reshape(ROWS)

    def body(i, carry):
        m, l, acc = carry
        sl = pl.ds(i * tile, tile)
        pos = i * tile + jnp.arange(tile, dtype=jnp.int32)
        s = scale * bf16_dot(q, k_ref[sl, :])
        merged = pos[None, :] < n_rows[:, None] - 1
        if mask == "broadcast":
            kept_q = keys_ref[:, sl] >= tau
            merged = merged & ~jnp.broadcast_to(kept_q[:, None, :], (BQ, G, tile)).reshape(ROWS, tile)
        elif mask == "rows":  # each row loads its query's keys (a gather from L1)
            kept = keys_ref[row_query[:, None], pos[None, :]] >= tau_rows[:, None]
            merged = merged & ~kept
        s = jnp.where(merged, s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        c = ex(m - m_new)
        p = ex(s - m_new[:, None])
        l = l * c + jnp.sum(p, axis=1)
        acc = acc * c[:, None] + lax.dot_general(p.astype(jnp.bfloat16), v_ref[sl, :], (((1,), (0,)), ((), ())),
                                                 preferred_element_type=jnp.float32)
        return m_new, l, acc

    init = (jnp.full((ROWS,), NEG, jnp.float32), jnp.zeros((ROWS,), jnp.float32), jnp.zeros((ROWS, K), jnp.float32))
    m, l, acc = lax.fori_loop(0, num_tiles, body, init)
    o_ref[...] = (acc / l[:, None]).reshape(BQ, G, K)


def run_merge(args, mask, tile=TILE, warps=8, stages=2, exp2=False):
    call = pl.pallas_call(
        functools.partial(merge_kernel, mask=mask, tile=tile, exp2=exp2),
        grid=(QC // BQ, HKV),
        in_specs=[pl.BlockSpec((BQ, None, G, K), lambda i, h: (i, h, 0, 0)),
                  pl.BlockSpec((BQ, None, 1), lambda i, h: (i, h, 0)),
                  pl.BlockSpec((BQ, None, NP), lambda i, h: (i, h, 0)),
                  pl.BlockSpec((BQ, None, 1), lambda i, h: (i, h, 0)),
                  pl.BlockSpec((None, NP, K), lambda i, h: (h, 0, 0)),
                  pl.BlockSpec((None, NP, K), lambda i, h: (h, 0, 0))],
        out_specs=pl.BlockSpec((BQ, None, G, K), lambda i, h: (i, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((QC, HKV, G, K), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=INTERPRET,
    )
    return median_ms(jax.jit(call), args, 5)


def topk_kernel(keys_ref, n_ref, tau_ref, next_ref, *, mode, chunk):
    """Variants of the shared top-K of one (query, kv head): the 31-step search over all
    `NP` keys in registers, over the valid chunks of `chunk` keys loaded every step, or
    the compaction alone (`tau` given)."""
    n = n_ref[0]
    k = jnp.minimum(512, n)
    if mode in ("search_registers", "full"):
        keys = keys_ref[...]

        def step(i, tau):
            candidate = tau | (jnp.int32(1) << (30 - i))
            return jnp.where(jnp.sum((keys >= candidate).astype(jnp.int32)) >= k, candidate, tau)

        tau = lax.fori_loop(0, 31, step, jnp.int32(0))
    elif mode == "search_chunks":
        chunks = (n + chunk - 1) // chunk

        def step(i, tau):
            candidate = tau | (jnp.int32(1) << (30 - i))

            def count(c, total):
                return total + jnp.sum((keys_ref[pl.ds(c * chunk, chunk)] >= candidate).astype(jnp.int32))

            return jnp.where(lax.fori_loop(0, chunks, count, jnp.int32(0)) >= k, candidate, tau)

        tau = lax.fori_loop(0, 31, step, jnp.int32(0))
    else:
        tau = tau_ref[0]
    tau_ref[...] = jnp.full((1,), tau, jnp.int32)
    if mode in ("full", "compact"):
        keys = keys_ref[...]
        selected = keys >= tau
        positions = jnp.arange(NP, dtype=jnp.int32)
        rank = jnp.cumsum(selected.astype(jnp.int32)) - 1
        next_ref[jnp.where(selected, rank, k + positions - (rank + 1))] = jnp.where(selected, positions, -1)


def run_topk(args, mode, warps=2, chunk=1024):
    spec = lambda w: pl.BlockSpec((None, None, w), lambda i, h: (i, h, 0))
    call = pl.pallas_call(
        functools.partial(topk_kernel, mode=mode, chunk=chunk),
        grid=(QC, HKV),
        in_specs=[spec(NP), spec(1)],
        out_specs=[spec(1), spec(NP)],
        out_shape=[jax.ShapeDtypeStruct((QC, HKV, 1), jnp.int32), jax.ShapeDtypeStruct((QC, HKV, NP), jnp.int32)],
        input_output_aliases={},
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
        interpret=INTERPRET,
    )
    keys, n, tau = args
    return median_ms(jax.jit(lambda keys, n, tau: call(keys, n)), (keys, n, tau), 5)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="", help="semicolon-separated row names to run")
    p.add_argument("--interpret", action="store_true", help="CPU smoke test (a small chunk)")
    args = p.parse_args(argv)
    global QC, INTERPRET
    if args.interpret:
        QC, INTERPRET = 32, True
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (QC, HKV, G, K), jnp.float32)
    k = jax.random.normal(ks[1], (HKV, NP, K), jnp.float32) * 0.3
    v = jax.random.normal(ks[2], (HKV, NP, K), jnp.bfloat16)
    split = lambda x: (x.astype(jnp.bfloat16), (x - x.astype(jnp.bfloat16).astype(jnp.float32)).astype(jnp.bfloat16))
    qh, ql = split(q)
    kh, kl = split(k)
    q3, k3 = jnp.concatenate([qh, qh, ql], -1), jnp.concatenate([kh, kl, kh], -1)
    t = 65536 + jnp.arange(QC, dtype=jnp.int32)
    n = jnp.broadcast_to((t // 16 + 1)[:, None, None], (QC, HKV, 1))
    shift = jnp.full((QC, HKV, G), 3.0, jnp.float32)
    product = float(jnp.sum((t // 16 + 1).astype(jnp.float32))) * HKV * G * K * 2 / 1e12  # TFLOP, one product
    iargs = (qh, ql, q3, n, shift, kh, kl, k3)
    keys = jnp.where(jnp.arange(NP)[None, None, :] < n, jax.random.randint(ks[3], (QC, HKV, NP), 0, 2**30), -1)
    tau = jnp.full((QC, HKV, 1), 2**30 - 2**27, jnp.int32)  # ~1/8 kept
    margs = (qh, n, keys, tau, kh, v)
    targs = (keys, n, tau)
    rows = {
        "stats bf16": (lambda: run_importance(iargs, "bf16", "stats"), 1),
        "stats x3": (lambda: run_importance(iargs, "x3", "stats"), 3),
        "stats x3 exp2": (lambda: run_importance(iargs, "x3", "stats", exp2=True), 3),
        "stats x3cat": (lambda: run_importance(iargs, "x3cat", "stats"), 3),
        "stats x3 3 stages": (lambda: run_importance(iargs, "x3", "stats", stages=3), 3),
        "stats x3 tile 128": (lambda: run_importance(iargs, "x3", "stats", tile=128), 3),
        "keys x3 no store": (lambda: run_importance(iargs, "x3", "keys_nostore"), 3),
        "keys x3": (lambda: run_importance(iargs, "x3", "keys"), 3),
        "keys x3 head-sum dot": (lambda: run_importance(iargs, "x3", "keys_dot"), 3),
        "keys x3cat": (lambda: run_importance(iargs, "x3cat", "keys"), 3),
        "keys x3 exp2": (lambda: run_importance(iargs, "x3", "keys", exp2=True), 3),
        "merge no mask": (lambda: run_merge(margs, "none"), 2),
        "merge no mask exp2": (lambda: run_merge(margs, "none", exp2=True), 2),
        "merge mask broadcast": (lambda: run_merge(margs, "broadcast"), 2),
        "merge mask broadcast exp2 3 stages": (lambda: run_merge(margs, "broadcast", exp2=True, stages=3), 2),
        "merge mask rows": (lambda: run_merge(margs, "rows"), 2),
        "merge no mask 4 warps": (lambda: run_merge(margs, "none", warps=4), 2),
        "merge no mask exp2 4 warps 3 stages": (lambda: run_merge(margs, "none", exp2=True, warps=4, stages=3), 2),
        "merge mask broadcast exp2 4 warps 3 stages": (lambda: run_merge(margs, "broadcast", exp2=True, warps=4,
                                                                        stages=3), 2),
        "top-K, 31 steps in registers + full-permutation compaction (the kernel before issue 33), 2 warps": (
            lambda: run_topk(targs, "full"), 0),
        "top-K search only, registers, 2 warps": (lambda: run_topk(targs, "search_registers"), 0),
        "top-K search only, registers, 4 warps": (lambda: run_topk(targs, "search_registers", warps=4), 0),
        "top-K search only, valid chunks of 1024 from memory, 2 warps": (lambda: run_topk(targs, "search_chunks"), 0),
        "top-K search only, valid chunks of 512 from memory, 1 warp": (lambda: run_topk(targs, "search_chunks", 1,
                                                                                         512), 0),
        "top-K search only, valid chunks of 2048 from memory, 4 warps": (lambda: run_topk(targs, "search_chunks", 4,
                                                                                           2048), 0),
        "top-K compaction only, 2 warps": (lambda: run_topk(targs, "compact"), 0),
    }
    only = [x for x in args.only.split(";") if x]
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}; one chunk, one product = {product:.3f} TFLOP")
    print("| step | ms per chunk | x16 chunks | TFLOP/s of its products |\n|---|---|---|---|")
    for name, (fn, products) in rows.items():
        if only and name not in only:
            continue
        try:
            ms = fn()
            rate = f"{products * product / ms * 1e3:.0f}" if products else "-"
            print(f"| {name} | {ms:.3f} | {16 * ms:.1f} | {rate} |", flush=True)
        except Exception as e:
            print(f"| {name} | FAIL {type(e).__name__}: {str(e).splitlines()[0][:150]} | | |", flush=True)


if __name__ == "__main__":
    main()
