"""The bottom merge grown from the gather probe (`gqa_sparse_feasibility.py`) one feature
at a time (issue 33), each step timed on one chunk of the real pipeline's inputs (the
middle chunk at T=131072: its queries, parents and keys from `prepare` and the top
layer, so the L2 sees the real overlap of neighbouring queries' parents).

    python -m benchmarks.probe_bottom_growth [--T 131072] [--top-k 512] [--steps name,...]

Steps (each adds to the one before unless said):
  list       per-candidate node indices loaded from a list (the probe), 8 query rows,
             the query unrotated, no mask
  rows16     16 query rows (G padded to a product's least rows, as the kernel has them)
  parents    nodes computed from the parent slots (16 children a parent)
  copies     keys read from the rotated copies (`rotate_phases`: copy offset per slot)
  rotate     the query rotated once per span (two table rows loaded at `n - 1 - p0`)
  mask       positions past `n` masked
  library    `merge_pallas` itself

`--layer 1` (a three-layer tree, e.g. `--top-k 64`): the importance pass of the layer below
the top, grown from the `rotate` step's scores without the values:
  one part   the keys' first bfloat16 part gathered, one product, online max / sum
  bf16x3     both parts gathered, the query split per span, three products (`BF16X3`)
  store      the scores stored (what the merge of the layer reads)
  library    `importance_keys_pallas(..., return_scores=True)` (with its XLA pass from the
             stored scores to the packed keys)
"""

from __future__ import annotations

import argparse
import functools
import statistics

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from htree_jax import HTreeConfig
from htree_jax.bench import H_KV, INPUTS, B, H, median_ms
from pallas_kernels.common import next_power_of_two, pad_axis
from pallas_kernels.importance import importance_keys_pallas
from pallas_kernels.merge import merge_pallas
from pallas_kernels.plan import BlockSizes, chunk_queries, group_rows, prepare, valid_candidates
from pallas_kernels.precision import Precisions, bf16_split
from pallas_kernels.rope import full_width_inputs
from pallas_kernels.top_layer import top_merge_pallas

STEPS = ("list", "rows16", "parents", "copies", "rotate", "mask")
# Other ways to rotate, each on top of `parents` (16 rows, nodes from parents, mask on):
#   hoisted      the rotated query computed once, outside the loop (wrong scores: what
#                the per-span rotation costs beyond its arithmetic)
#   incremental  copies, the query rotated by a constant -span each span (`q_{j+1} =
#                R(-span) q_j`, no table rows loaded in the loop; float32 drift)
#   slots        no copies (keys rotated by their child offset only), the query rotated by
#                a constant -r each parent slot (`R(-r)`), one product per slot
ROTATIONS = ("hoisted", "incremental", "slots")


def grown_kernel(q_ref, qh_ref, par_ref, idx_ref, n_ref, k_ref, v_ref, c_ref, s_ref, o_ref, *, upto, tile: int,
                 span: int, r: int, alpha: float):
    if upto in ROTATIONS:
        return rotation_kernel(q_ref, qh_ref, par_ref, n_ref, k_ref, v_ref, c_ref, s_ref, o_ref, how=upto, tile=tile,
                               span=span, r=r, alpha=alpha)
    has = lambda step: STEPS.index(step) <= upto
    n = n_ref[0]
    rows, kp = q_ref.shape
    q, qh = q_ref[...].astype(jnp.float32), qh_ref[...].astype(jnp.float32)
    q_plain = q.astype(jnp.bfloat16)
    versions = span // r
    N = k_ref.shape[0] // versions

    def body(i, carry):
        m, total, acc = carry
        for u in range(tile // span):
            p0 = i * tile + u * span
            if has("parents"):
                nodes = (par_ref[pl.ds(p0 // r, span // r)][:, None] * r
                         + jnp.arange(r, dtype=jnp.int32)[None, :]).reshape(span)
            else:
                nodes = idx_ref[pl.ds(p0, span)]
            copy = (jnp.arange(span, dtype=jnp.int32) // r) * N if has("copies") else 0
            keys = k_ref[nodes + copy, :]
            if has("rotate"):
                angle = jnp.maximum(n - 1 - p0, 0)
                qq = (q * c_ref[pl.ds(angle, 1), :] + qh * s_ref[pl.ds(angle, 1), :]).astype(jnp.bfloat16)
            else:
                qq = q_plain
            scores = alpha * lax.dot_general(qq, keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            if has("mask"):
                valid = p0 + jnp.arange(span, dtype=jnp.int32) < n
                scores = jnp.where(jnp.broadcast_to(valid[None, :], (rows, span)), scores, -jnp.inf)
            m, total, acc = fold((m, total, acc), scores, v_ref[nodes, :])
        return m, total, acc

    init = (jnp.full((rows,), -1e30, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, v_ref.shape[-1]), jnp.float32))
    _, total, acc = lax.fori_loop(0, (n + tile - 1) // tile, body, init)
    o_ref[...] = (acc / total[:, None]).astype(o_ref.dtype)


def fold(carry, scores, values):
    m, total, acc = carry
    m_new = jnp.maximum(m, jnp.max(scores, axis=1))
    decay = jnp.exp(m - m_new)
    w = jnp.exp(scores - m_new[:, None])
    acc = acc * decay[:, None] + lax.dot_general(w.astype(jnp.bfloat16), values, (((1,), (0,)), ((), ())),
                                                 preferred_element_type=jnp.float32)
    return m_new, total * decay + jnp.sum(w, axis=1), acc


def rotation_kernel(q_ref, qh_ref, par_ref, n_ref, k_ref, v_ref, c_ref, s_ref, o_ref, *, how, tile, span, r, alpha):
    n = n_ref[0]
    rows, kp = q_ref.shape
    q, qh = q_ref[...].astype(jnp.float32), qh_ref[...].astype(jnp.float32)
    versions = span // r
    N = k_ref.shape[0] // versions
    step = span if how != "slots" else r
    start = jnp.maximum(n - 1, 0)
    q0 = (q * c_ref[pl.ds(start, 1), :] + qh * s_ref[pl.ds(start, 1), :])
    qh0 = (qh * c_ref[pl.ds(start, 1), :] - q * s_ref[pl.ds(start, 1), :])
    # R(-step): the tables' row `step` with the sine negated.
    c_step, s_step = c_ref[pl.ds(step, 1), :], -s_ref[pl.ds(step, 1), :]
    q_fixed = q0.astype(jnp.bfloat16)

    def body(i, carry):
        state, qj, qhj = carry
        for u in range(tile // step):
            p0 = i * tile + u * step
            if how == "slots":
                nodes = par_ref[p0 // r] * r + jnp.arange(r, dtype=jnp.int32)
                keys = k_ref[nodes, :]
            else:
                nodes = (par_ref[pl.ds(p0 // r, span // r)][:, None] * r
                         + jnp.arange(r, dtype=jnp.int32)[None, :]).reshape(span)
                keys = k_ref[nodes + (jnp.arange(span, dtype=jnp.int32) // r) * N, :]
            qq = q_fixed if how == "hoisted" else qj.astype(jnp.bfloat16)
            scores = alpha * lax.dot_general(qq, keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            valid = p0 + jnp.arange(step, dtype=jnp.int32) < n
            scores = jnp.where(jnp.broadcast_to(valid[None, :], (rows, step)), scores, -jnp.inf)
            state = fold(state, scores, v_ref[nodes, :])
            if how != "hoisted":
                qj, qhj = qj * c_step + qhj * s_step, qhj * c_step - qj * s_step
        return state, qj, qhj

    init = (jnp.full((rows,), -1e30, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, v_ref.shape[-1]), jnp.float32))
    (_, total, acc), _, _ = lax.fori_loop(0, (n + tile - 1) // tile, body, (init, q0, qh0))
    o_ref[...] = (acc / total[:, None]).astype(o_ref.dtype)


IMPORTANCE_STEPS = ("one part", "bf16x3", "store")


def importance_kernel(q_ref, qh_ref, par_ref, n_ref, kh_ref, kl_ref, c_ref, s_ref, out_ref, shift_ref, *, upto: int,
                      span: int, r: int, alpha: float):
    n = n_ref[0]
    rows, _ = q_ref.shape
    q, qh = q_ref[...].astype(jnp.float32), qh_ref[...].astype(jnp.float32)
    N = kh_ref.shape[0] // (span // r)
    dims = (((1,), (1,)), ((), ()))
    dot = lambda a, b: lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)

    def body(i, carry):
        m, total = carry
        p0 = i * span
        nodes = (par_ref[pl.ds(p0 // r, span // r)][:, None] * r + jnp.arange(r, dtype=jnp.int32)[None, :]).reshape(span)
        nodes = nodes + (jnp.arange(span, dtype=jnp.int32) // r) * N
        angle = jnp.maximum(n - 1 - p0, 0)
        qq = q * c_ref[pl.ds(angle, 1), :] + qh * s_ref[pl.ds(angle, 1), :]
        if upto == 0:
            scores = dot(qq.astype(jnp.bfloat16), kh_ref[nodes, :])
        else:
            q_hi, q_lo = bf16_split(qq)
            k_hi, k_lo = kh_ref[nodes, :], kl_ref[nodes, :]
            scores = dot(q_hi, k_hi) + (dot(q_hi, k_lo) + dot(q_lo, k_hi))
        scores = alpha * scores
        if upto >= 2:
            out_ref[:, pl.ds(p0, span)] = scores
        positions = p0 + jnp.arange(span, dtype=jnp.int32)
        masked = jnp.where(jnp.broadcast_to((positions < n - 1)[None, :], (rows, span)), scores, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(masked, axis=1))
        safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        return m_new, total * jnp.exp(m - safe) + jnp.sum(jnp.exp(masked - safe[:, None]), axis=1)

    init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32))
    m, total = lax.fori_loop(0, (n + span - 1) // span, body, init)
    shift_ref[...] = m + jnp.log(total)


def run_importance(inputs, upto, warps, stages, span, r, alpha, iters, interpret=False):
    q, qh, parents, n, kh, kl, cos, sin = inputs
    Bq, Qc, Hkv, rows, kp = q.shape
    Mp = cos.shape[0]
    per_query = lambda *tail: pl.BlockSpec((None, None, None) + tail, lambda b, i, h: (b, i, h) + (0,) * len(tail))
    per_head = lambda x: pl.BlockSpec((None, None) + x.shape[2:], lambda b, i, h: (b, h, 0, 0))
    table = pl.BlockSpec(cos.shape, lambda b, i, h: (0, 0))
    call = pl.pallas_call(
        functools.partial(importance_kernel, upto=upto, span=span, r=r, alpha=alpha),
        grid=(Bq, Qc, Hkv),
        in_specs=[per_query(rows, kp), per_query(rows, kp), per_query(parents.shape[-1]), per_query(1), per_head(kh),
                  per_head(kl), table, table],
        out_specs=[per_query(rows, Mp), per_query(rows)],
        out_shape=[jax.ShapeDtypeStruct((Bq, Qc, Hkv, rows, Mp), jnp.float32),
                   jax.ShapeDtypeStruct((Bq, Qc, Hkv, rows), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
    )
    f = jax.jit(call)
    args = (q, qh, parents, n, kh, kl, cos, sin)
    out = f(*args)
    return lambda: median_ms(f, args, iters), out


def importance_growth(args, prep, q, T, config, c, ip):
    """`--layer 1`: the importance pass of the layer below the top, grown (see above)."""
    st, Qc, L = prep.st, prep.chunk, len(prep.layers) + 1
    if L != 3:
        raise ValueError("--layer 1 takes a three-layer tree (top, layer 1, bottom): e.g. T=131072, top_k=64")
    gp = group_rows(H // H_KV, BlockSizes())

    @jax.jit
    def layer_inputs(prep):
        qc, t, n_top, first, q_top, (keys, tau, parents) = chunk_queries(prep, c, T, L, ip)
        return pad_axis(qc, 3, gp), parents, valid_candidates(parents, t, 1, prep)

    q_rows, parents, n = layer_inputs(prep)
    k_imp = prep.layers[1][0]
    library = jax.jit(lambda *a: importance_keys_pallas(*a, st, ip, return_scores=True))
    largs = (q_rows, parents, n, k_imp, prep.cos, prep.sin)
    (qf, qh), (cos, sin) = full_width_inputs(q_rows.astype(jnp.float32), prep.cos, prep.sin)
    inputs = (qf, qh, parents, n, *k_imp, cos, sin)
    want = library(*largs)[1]
    moved = float(jnp.sum(n.astype(jnp.float32))) * sum(x.shape[-1] * x.dtype.itemsize for x in k_imp)
    timed = [("library importance_keys_pallas (scores kernel + XLA keys)", lambda: median_ms(library, largs,
                                                                                           args.iters))]
    for spec in args.variants.split(","):
        _, warps, stages = (int(x) for x in spec.split(":"))
        for upto, step in enumerate(IMPORTANCE_STEPS):
            try:
                fn, (scores, _) = run_importance(inputs, upto, warps, stages, st.span, st.r, st.alpha, args.iters, ip)
                label = f"{step}, span {st.span}, {warps} warps, {stages} stages"
                if step == "store":  # the stored scores against the library's, where valid
                    valid = jnp.arange(scores.shape[-1]) < n[..., None]
                    error = float(jnp.max(jnp.where(valid, jnp.abs(scores - want), 0.0)))
                    label += f" (max abs difference from the library's scores {error:.1e})"
                timed.append((label, fn))
            except Exception as e:
                print(f"| {step}, {warps} warps, {stages} stages | FAIL {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:120]} | | |", flush=True)
    rounds = [[fn() for _, fn in timed] for _ in range(args.rounds)]
    chunks = prep.q4.shape[1] // Qc
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}: T={T} top_k={config.top_k}, layer 1, chunk {c} of "
          f"{chunks} ({Qc} queries, mean n {float(jnp.mean(n)):.0f}), {moved / 1e12:.3f} TB of key rows (both "
          f"parts) a chunk")
    print("| step | ms a chunk | whole sequence ms | TB/s of both key parts | spread |\n|---|---|---|---|---|")
    for j, (name, _) in enumerate(timed):
        ms = statistics.median(r[j] for r in rounds)
        spread = max(r[j] for r in rounds) / min(r[j] for r in rounds) - 1
        print(f"| {name} | {ms:.2f} | {ms * chunks:.1f} | {moved / ms / 1e9:.2f} | {100 * spread:.0f}% |", flush=True)


def run_grown(inputs, upto, tile, warps, stages, span, r, alpha, iters, interpret=False):
    q, qh, parents, idx, n, k, v, cos, sin = inputs
    rows = q.shape[3] if upto in ROTATIONS or STEPS.index("rows16") <= upto else 8
    q, qh = q[:, :, :, :rows], qh[:, :, :, :rows]
    Bq, Qc, Hkv = q.shape[:3]
    per_query = lambda *tail: pl.BlockSpec((None, None, None) + tail, lambda b, i, h: (b, i, h) + (0,) * len(tail))
    per_head = lambda x: pl.BlockSpec((None, None) + x.shape[2:], lambda b, i, h: (b, h, 0, 0))
    table = pl.BlockSpec(cos.shape, lambda b, i, h: (0, 0))
    call = pl.pallas_call(
        functools.partial(grown_kernel, upto=upto, tile=tile, span=span, r=r, alpha=alpha),
        grid=(Bq, Qc, Hkv),
        in_specs=[per_query(rows, q.shape[-1]), per_query(rows, q.shape[-1]), per_query(parents.shape[-1]),
                  per_query(idx.shape[-1]), per_query(1), per_head(k), per_head(v), table, table],
        out_specs=per_query(rows, v.shape[-1]),
        out_shape=jax.ShapeDtypeStruct((Bq, Qc, Hkv, rows, v.shape[-1]), jnp.bfloat16),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
    )
    f = jax.jit(call)
    args = (q, qh, parents, idx, n, k, v, cos, sin)
    out = f(*args)
    return lambda: median_ms(f, args, iters), out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, default=131072)
    p.add_argument("--top-k", type=int, default=512)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default="64:2:2,128:4:3", help="tile:warps:stages for every step")
    p.add_argument("--layer", type=int, default=0, choices=[0, 1], help="0: the bottom merge; 1: layer 1's importance")
    p.add_argument("--interpret", action="store_true", help="CPU smoke test")
    args = p.parse_args(argv)
    ip = args.interpret
    T, config = args.T, HTreeConfig(top_k=args.top_k)
    q, k, v = INPUTS["random"](T)
    bs = BlockSizes()
    prep = jax.jit(lambda q, k, v: prepare(q, k, v, config, bs, ip, Precisions.for_dtype(q.dtype)))(q, k, v)
    st, Qc, L = prep.st, prep.chunk, len(prep.layers) + 1
    c = prep.q4.shape[1] // Qc // 2
    if args.layer == 1:
        return importance_growth(args, prep, q, T, config, c, ip)
    if L != 2:
        raise ValueError("the probe takes a two-layer tree (top layer, bottom): e.g. T=131072, top_k=512")
    G = H // H_KV
    gt, gp = next_power_of_two(G), group_rows(G, bs)

    @jax.jit
    def bottom_inputs(prep):
        qc, t, n_top, first, q_top, (keys, tau, parents) = chunk_queries(prep, c, T, L, ip)
        vp = prep.top_v.shape[-1]
        empty = (jnp.full((B, Qc, H_KV, gt), -jnp.inf), jnp.zeros((B, Qc, H_KV, gt)), jnp.zeros((B, Qc, H_KV, gt, vp)))
        state = top_merge_pallas(q_top, n_top, None, keys, tau, prep.top_k_merge, prep.top_v, empty, prep.st_top, ip)
        return pad_axis(qc, 3, gp), parents, valid_candidates(parents, t, 0, prep), tuple(pad_axis(x, 3, gp)
                                                                                          for x in state)

    q_rows, parents, n, state = bottom_inputs(prep)
    _, k_merge, v0 = prep.layers[0]
    library = jax.jit(lambda *a: merge_pallas(*a, st, ip, out_dtype=q.dtype))
    largs = (q_rows, parents, n, k_merge, v0, prep.cos, prep.sin, state)
    # The probe's inputs: the same queries (and rotate_half of them), parents, node lists, keys, values, tables.
    idx = (parents[..., :, None] * st.r + jnp.arange(st.r, dtype=jnp.int32)).reshape(*parents.shape[:3], -1)
    idx = jnp.where(jnp.arange(idx.shape[-1]) < n, idx, 0)
    (qf, qh), (cos, sin) = full_width_inputs(q_rows.astype(jnp.float32), prep.cos, prep.sin)
    inputs = (qf, qh, parents, idx, n, k_merge[0], v0, cos, sin)
    moved = float(jnp.sum(n.astype(jnp.float32))) * (k_merge[0].shape[-1] * 2 + v0.shape[-1] * 2)
    chunks = prep.q4.shape[1] // Qc
    want = library(*largs)[..., :G, :].astype(jnp.float32)
    timed = [("library merge_pallas (tile 64, 2 warps, 2 stages)", lambda: median_ms(library, largs, args.iters))]
    errors = [0.0]
    for spec in args.variants.split(","):
        tile, warps, stages = (int(x) for x in spec.split(":"))
        for upto, step in list(enumerate(STEPS)) + [(x, x) for x in ROTATIONS]:
            try:
                fn, out = run_grown(inputs, upto, tile, warps, stages, st.span, st.r, st.alpha, args.iters, ip)
                timed.append((f"{step}, tile {tile}, {warps} warps, {stages} stages", fn))
                errors.append(float(jnp.max(jnp.abs(out[..., :G, :].astype(jnp.float32) - want))))
            except Exception as e:
                print(f"| {step}, tile {tile}, {warps} warps, {stages} stages | FAIL {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:120]} | | |", flush=True)
    rounds = [[fn() for _, fn in timed] for _ in range(args.rounds)]
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}: T={T} top_k={args.top_k}, chunk {c} of {chunks} "
          f"({Qc} queries, mean n {float(jnp.mean(n)):.0f}), {moved / 1e12:.3f} TB of key and value rows a chunk")
    print("| step | ms a chunk | whole sequence ms | TB/s gathered | spread | max abs difference from the library's "
          "output |\n|---|---|---|---|---|---|")
    for j, (name, _) in enumerate(timed):
        ms = statistics.median(r[j] for r in rounds)
        spread = max(r[j] for r in rounds) / min(r[j] for r in rounds) - 1
        print(f"| {name} | {ms:.2f} | {ms * chunks:.1f} | {moved / ms / 1e9:.2f} | {100 * spread:.0f}% | "
              f"{errors[j]:.2e} |", flush=True)


if __name__ == "__main__":
    main()
