"""Issue 73: the block merge by route (`BlockKernels.merge`): `--check` each route
against Pallas-Triton on small shapes, `--time` each at T=131072 (merge kernel, merge call,
whole forward) beside dense cuDNN. `--routes=a,b` picks routes, `--T=a,b` the lengths of `--time` (131072), `--kinds=` its
inputs (random,correlated). Needs a CUDA GPU.

    python benchmarks/bench_block_routes.py --check --time
"""
import sys, time
import jax, jax.numpy as jnp, numpy as np
from htree_jax import HTreeConfig, htree_attention
from htree_jax.backends import blocks_of
from htree_jax.bench import INPUTS, median_ms, dense_fn
from htree_jax.kernel_trace import kernel_times
from pallas_kernels.block.forward import block_forward_pallas
from pallas_kernels.shared.kernels import BlockKernels
from tests.conftest import random_qkv

ROUTES = next((a.split("=")[1].split(",") for a in sys.argv if a.startswith("--routes=")), ["pallas_triton", "mosaic_gpu"])
TIME = "--time" in sys.argv
LENGTHS = next((a.split("=")[1].split(",") for a in sys.argv if a.startswith("--T=")), ["131072"])
KINDS = next((a.split("=")[1].split(",") for a in sys.argv if a.startswith("--kinds=")), ["random", "correlated"])
print(jax.devices()[0].device_kind, jax.__version__, flush=True)

def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))

CASES = [  # r, top_k, T, H, H_kv, K, V, dtype, source
    (16, 8, 4096, 32, 4, 128, 128, jnp.bfloat16, "first"),
    (16, 32, 3000, 8, 1, 128, 128, jnp.bfloat16, "previous"),
    (16, 8, 2048, 16, 1, 64, 64, jnp.float16, "first"),
    (8, 8, 1500, 8, 2, 64, 128, jnp.bfloat16, "first"),
    (16, 8, 2048, 4, 2, 256, 256, jnp.bfloat16, "first"),
    (4, 4, 150, 8, 2, 64, 32, jnp.float32, "previous"),
]
if "--check" in sys.argv:
    for r, top_k, T, H, H_kv, K, V, dtype, source in CASES:
        rng = np.random.default_rng(T)
        q, k, v = (jnp.asarray(x, dtype) for x in random_qkv(rng, 1, T, H, H_kv, K, V))
        config = HTreeConfig(compression_rate=r, top_k=top_k, selection_block=r, block_source=source)
        blocks = jax.jit(lambda q, k, v: blocks_of(q, k, v, config))(q, k, v)
        base = None
        for route in ROUTES:
            t0 = time.time()
            try:
                o, lse = jax.jit(lambda q, k, v, s, rt=route: block_forward_pallas(q, k, v, s, config=config, merge=rt))(q, k, v, blocks)
                o = np.asarray(o.astype(jnp.float32)); lse = np.asarray(lse)
                if base is None:
                    base = (o, lse); msg = "base"
                else:
                    msg = f"o rel {rel(o, base[0]):.2e} lse max {np.nanmax(np.abs(lse - base[1])):.2e}"
                print(f"CHECK r={r} top_k={top_k} T={T} H={H}/{H_kv} K={K} V={V} {jnp.dtype(dtype).name} {source} {route}: {msg} ({time.time()-t0:.1f}s)", flush=True)
            except Exception as e:
                print(f"CHECK r={r} T={T} H={H}/{H_kv} K={K} V={V} {jnp.dtype(dtype).name} {route}: FAIL {type(e).__name__}: {str(e)[:1500]}", flush=True)
for T, kind in ((int(t), kind) for t in LENGTHS for kind in KINDS if TIME):
    q, k, v = INPUTS[kind](T)
    K, V = q.shape[-1], v.shape[-1]
    config = HTreeConfig(top_k=512, selection_block=16)
    dense = median_ms(dense_fn(HTreeConfig(top_k=512, selection_block=1)), (q, k, v), 10)
    blocks = jax.jit(lambda q, k, v: blocks_of(q, k, v, config))(q, k, v)
    row = dict(kind=kind, T=T, dense_ms=dense)
    for route in ROUTES:
        try:
            merge = jax.jit(lambda q, k, v, s, rt=route: block_forward_pallas(q, k, v, s, config=config, merge=rt)[0])
            row[f"{route}_merge_ms"] = median_ms(merge, (q, k, v, blocks), 10)
            try:
                times = kernel_times(lambda: merge(q, k, v, blocks), 3)
                row[f"{route}_kernels"] = sorted(((round(t / 1e3, 3), n[:60]) for n, (t, _) in times.items()), reverse=True)[:5]
            except Exception as e:
                row[f"{route}_kernels"] = f"{type(e).__name__}: {str(e)[:200]}"
            full = jax.jit(lambda q, k, v, m=BlockKernels(merge=route): htree_attention(
                q, k, v, config, backend="pallas", block_kernels=m))
            row[f"{route}_forward_ms"] = median_ms(full, (q, k, v), 10)
        except Exception as e:
            row[f"{route}"] = f"FAIL {type(e).__name__}: {str(e)[:600]}"
        print(row, flush=True)
    print("TIMING", row, flush=True)
