"""Probe: what limits the per-query bottom-layer merge? (GPU only; not a test.)

    python -m benchmarks.probe_bottom_merge

Stripped-down versions of the bottom merge (one program per (query, kv head), 16 rows,
512 random parents x 16 children of a 131072-token layer, bf16 K/V, online softmax),
differing in how RoPE at candidate-local positions is handled. Times one chunk of 4096
queries x 4 kv heads and scales to T=131072. Findings in benchmarks/RESULTS.md
(2026-11-22): without RoPE the gathers run at ~8 TB/s; any per-(query, slot) rotation
in the kernel, of the query or of the keys, costs ~2-3x.
"""
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import compiler_params

R = 16

def timeit(f, *a, iters=5):
    jax.block_until_ready(f(*a)); ts = []
    for _ in range(iters):
        t0 = time.perf_counter(); jax.block_until_ready(f(*a)); ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2] * 1e3

def make(variant, tile, Mp, rows, Kp, Vp, N):
    pc = tile // R
    def kernel(q_ref, qs_ref, par_ref, n_ref, k_ref, v_ref, c_ref, s_ref, o_ref):
        q = q_ref[...].astype(jnp.float32)  # [rows, Kp]
        qs = qs_ref[...].astype(jnp.float32)
        n = n_ref[0]
        nt = Mp // tile if variant == "static" else (n + tile - 1) // tile
        child = jnp.arange(R, dtype=jnp.int32)
        def body(i, carry):
            m, tot, acc = carry
            par = par_ref[pl.ds(i * pc, pc)]
            pos = i * tile + jnp.arange(tile, dtype=jnp.int32)
            valid = pos < n
            idx = jnp.where(valid, (par[:, None] * R + child[None, :]).reshape(tile), 0)
            kb = k_ref[idx, :]
            vb = v_ref[idx, :]
            if variant.startswith("unit"):  # one slot per product, unrolled over the tile
                mx = m; blocks = []
                for u in range(pc):
                    par1 = par_ref[pl.ds(i * pc + u, 1)]
                    idx1 = (par1[:, None] * R + child[None, :]).reshape(R)  # n = Mp - 3: every unit is valid
                    kb1 = k_ref[idx1, :]
                    ang = jnp.maximum(n - 1 - (i * pc + u) * R, 0)
                    if variant == "unit_qrot":
                        c = c_ref[pl.ds(ang, 1), :]; s = s_ref[pl.ds(ang, 1), :]
                        qq = (q * c + qs * s).astype(kb1.dtype)
                    elif variant == "unit_qrot_bf16":
                        c = c_ref[pl.ds(ang, 1), :].astype(jnp.bfloat16); s = s_ref[pl.ds(ang, 1), :].astype(jnp.bfloat16)
                        qq = q.astype(jnp.bfloat16) * c + qs.astype(jnp.bfloat16) * s
                    elif variant == "unit_krot_halves":
                        H2 = Kp // 2
                        c = c_ref[pl.ds(ang, 1), pl.ds(0, H2)]; s = s_ref[pl.ds(ang, 1), pl.ds(0, H2)]
                        klo = k_ref[idx1, pl.ds(0, H2)].astype(jnp.float32); khi = k_ref[idx1, pl.ds(H2, H2)].astype(jnp.float32)
                        qlo = q_ref[:, pl.ds(0, H2)]; qhi = q_ref[:, pl.ds(H2, H2)]
                        dn = (((1,), (1,)), ((), ()))
                        sc1 = (lax.dot_general(qlo, (klo * c - khi * s).astype(jnp.bfloat16), dn, preferred_element_type=jnp.float32)
                               + lax.dot_general(qhi, (klo * s + khi * c).astype(jnp.bfloat16), dn, preferred_element_type=jnp.float32)) * 0.088
                        blocks.append((sc1, idx1)); mx = jnp.maximum(mx, sc1.max(axis=1)); continue
                    elif variant == "unit_krot":
                        c = c_ref[pl.ds(ang, 1), :]; s = s_ref[pl.ds(ang, 1), :]
                        kh = k_ref[idx1, :].astype(jnp.float32)
                        kb1 = (kb1.astype(jnp.float32) * c + kh * s).astype(kb1.dtype)
                        qq = q.astype(kb1.dtype)
                    else:
                        qq = q.astype(kb1.dtype)
                    sc1 = lax.dot_general(qq, kb1, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * 0.088
                    blocks.append((sc1, idx1))
                    mx = jnp.maximum(mx, sc1.max(axis=1))
                a = jnp.exp(m - mx); tot = tot * a; acc = acc * a[:, None]
                for sc1, idx1 in blocks:
                    p = jnp.exp(sc1 - mx[:, None]); tot = tot + p.sum(axis=1)
                    acc = acc + jnp.dot(p.astype(jnp.bfloat16), v_ref[idx1, :], preferred_element_type=jnp.float32)
                return mx, tot, acc
            if variant == "span":  # keys stored in tile/R phase versions: one query rotation per tile
                ver = (jnp.arange(tile, dtype=jnp.int32) // R) * N
                kb = k_ref[jnp.where(valid, idx + ver, 0), :]
                ang = jnp.maximum(n - 1 - i * tile, 0)
                c = c_ref[pl.ds(ang, 1), :]; s = s_ref[pl.ds(ang, 1), :]
                sc = lax.dot_general((q * c + qs * s).astype(kb.dtype), kb, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)
            elif variant in ("static", "dynamic"):
                sc = lax.dot_general(q.astype(kb.dtype), kb, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            else:  # "rope": full-width query rotation per slot, slots stacked, block diagonal
                slots = i * pc + jnp.arange(pc, dtype=jnp.int32)
                ang = jnp.maximum(n - 1 - slots * R, 0)
                c = c_ref[ang, :][:, None, :]; s = s_ref[ang, :][:, None, :]
                qq = (q[None] * c + qs[None] * s).reshape(pc * rows, Kp).astype(kb.dtype)
                full = lax.dot_general(qq, kb, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).reshape(pc, rows, tile)
                own = jnp.arange(pc, dtype=jnp.int32)[:, None] == (jnp.arange(tile, dtype=jnp.int32) // R)[None, :]
                sc = jnp.sum(jnp.where(own[:, None, :], full, 0.0), axis=0)
            sc = jnp.where(valid[None, :], sc * 0.088, -jnp.inf)
            m2 = jnp.maximum(m, sc.max(axis=1))
            p = jnp.exp(sc - m2[:, None]); a = jnp.exp(m - m2)
            return m2, tot * a + p.sum(axis=1), acc * a[:, None] + jnp.dot(p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
        init = (jnp.full((rows,), -1e30, jnp.float32), jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, Vp), jnp.float32))
        _, tot, acc = lax.fori_loop(0, nt, body, init)
        o_ref[...] = (acc / tot[:, None]).astype(o_ref.dtype)
    return kernel

def run(variant, tile, Q=4096, HKV=4, N=131072, P=512, rows=16, Kp=128, Vp=128, warps=4, stages=2):
    rng = np.random.default_rng(0)
    Mp = P * R
    pars = np.sort(np.stack([rng.choice(N // R, P, replace=False) for _ in range(1024)]), axis=1)
    pars = np.resize(pars, (Q * HKV, P)).astype(np.int32).reshape(Q, HKV, P)
    key = jax.random.PRNGKey(0)
    q = jax.random.normal(key, (Q, HKV, rows, Kp), jnp.bfloat16)
    versions = tile // R if variant == "span" else 1
    k = jax.random.normal(key, (HKV, versions * N, Kp), jnp.bfloat16)
    v = jax.random.normal(key, (HKV, N, Vp), jnp.bfloat16)
    n = jnp.full((Q, HKV, 1), Mp - 3, jnp.int32)
    c = jnp.cos(jnp.arange(Mp)[:, None] * 0.01 * jnp.ones((1, Kp)))
    s = jnp.sin(jnp.arange(Mp)[:, None] * 0.01 * jnp.ones((1, Kp)))
    f = pl.pallas_call(make(variant, tile, Mp, rows, Kp, Vp, N), grid=(Q, HKV),
        in_specs=[pl.BlockSpec((None, None, rows, Kp), lambda b, h: (b, h, 0, 0))] * 2 + [
            pl.BlockSpec((None, None, P), lambda b, h: (b, h, 0)),
            pl.BlockSpec((None, None, 1), lambda b, h: (b, h, 0)),
            pl.BlockSpec((None, versions * N, Kp), lambda b, h: (h, 0, 0)),
            pl.BlockSpec((None, N, Vp), lambda b, h: (h, 0, 0)),
            pl.BlockSpec((Mp, Kp), lambda b, h: (0, 0)), pl.BlockSpec((Mp, Kp), lambda b, h: (0, 0))],
        out_specs=pl.BlockSpec((None, None, rows, Vp), lambda b, h: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((Q, HKV, rows, Vp), jnp.bfloat16),
        compiler_params=compiler_params(warps, stages))
    ms = timeit(jax.jit(f), q, q, jnp.asarray(pars), n, k, v, c, s)
    by = Q * HKV * Mp * (Kp + Vp) * 2
    print(f"{variant:8s} tile={tile:3d} warps={warps} stages={stages}: {ms:7.2f} ms/chunk of {Q} queries "
          f"({ms * 32:6.0f} ms for T=131072), {by / ms / 1e9:.1f} TB/s", flush=True)

if __name__ == "__main__":
    import sys
    if sys.argv[1:] == ["span"]:
        for variant, tile, w, st in [("dynamic", 64, 4, 2), ("unit_qrot", 32, 1, 2), ("span", 32, 1, 2),
                                     ("span", 64, 1, 2), ("span", 64, 2, 2), ("span", 64, 4, 2),
                                     ("span", 128, 2, 2), ("span", 128, 4, 2), ("span", 64, 2, 3)]:
            run(variant, tile, warps=w, stages=st)
        sys.exit()
    variants = [("static", 64, 4, 2), ("dynamic", 64, 4, 2), ("dynamic", 32, 4, 2), ("dynamic", 128, 4, 2),
                ("rope", 64, 4, 2), ("unit_none", 64, 4, 2), ("unit_qrot", 64, 4, 2), ("unit_qrot", 64, 2, 2),
                ("unit_krot", 64, 4, 2), ("unit_krot_halves", 64, 4, 2), ("unit_qrot_bf16", 64, 4, 2)]
    for variant, tile, w, st in variants:
        try:
            run(variant, tile, warps=w, stages=st)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(variant, tile, "FAIL", type(e).__name__, str(e)[:300], flush=True)
