"""Is the dense baseline the best of its kind? (issue 70: htree-trained byte LMs were
~10% better than the dense-trained one even where both compute dense attention.)

    python benchmarks/dense_baseline.py [--seq-len 4096] [--steps 400] [--out dense_baseline.json]

Two checks on a GPU:
1. Gradients: `jax.nn.dot_product_attention` (causal, GQA) through cuDNN in bfloat16 and
   XLA in bfloat16, and htree's one-layer kernels (exact attention) in bfloat16, against
   XLA in float32 on the same bfloat16-rounded inputs: relative Frobenius error of `o`,
   `dq`, `dk`, `dv`, for each kv-head count.
2. Training: the byte LM of `examples/train_tiny_lm.py --task text`, same seed, data and
   steps, with the dense attention computed each way (cuDNN bf16, XLA bf16, XLA with the
   whole model in float32, htree one-layer bf16): held-out bits per byte at the end.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from htree_jax import HTreeConfig, htree_attention
from htree_jax.bench import run_header
from htree_jax.cli import DefaultsHelpFormatter
from htree_jax.core.rope import rope_absolute

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT / "examples") not in sys.path:
    sys.path.insert(0, str(ROOT / "examples"))
import train_tiny_lm  # noqa: E402


def dense(implementation: str):
    """Causal attention with RoPE at absolute positions, as `train_tiny_lm.DenseAttention`."""
    def f(q, k, v):
        qr = rope_absolute(q, 1e6).astype(v.dtype)
        kr = rope_absolute(k, 1e6).astype(v.dtype)
        return jax.nn.dot_product_attention(qr, kr, v, is_causal=True, implementation=implementation)
    return f


def one_layer_htree(q, k, v):
    """htree with one layer: exact causal attention, through the Pallas kernels."""
    return htree_attention(q, k, v, HTreeConfig(top_k=q.shape[1] // 16, rope_base=1e6, selection_block=1), backend="pallas")


def gradient_errors(T: int, heads: int, kv_heads: int, dim: int, seed: int = 0) -> dict:
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (2, T, heads, dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (2, T, kv_heads, dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (2, T, kv_heads, dim), jnp.bfloat16)
    w = jax.random.normal(keys[3], (2, T, heads, dim), jnp.float32)

    def value_and_grads(fn, dtype):
        loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * w)
        args = [x.astype(dtype) for x in (q, k, v)]
        with jax.default_matmul_precision("highest"):
            o = jax.jit(fn)(*args)
            grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
        return [np.asarray(x, np.float64) for x in (o, *grads)]

    truth = value_and_grads(dense("xla"), jnp.float32)
    out = {}
    for name, fn in (("cudnn bf16", dense("cudnn")), ("xla bf16", dense("xla")), ("htree 1-layer bf16",
                                                                                   one_layer_htree)):
        got = value_and_grads(fn, jnp.bfloat16)
        out[name] = {part: float(np.linalg.norm(a - b) / np.linalg.norm(b))
                     for part, a, b in zip(("o", "dq", "dk", "dv"), got, truth)}
        print(f"T={T} H={heads} H_kv={kv_heads} K={dim} {name}: "
              + ", ".join(f"{p} {e:.2e}" for p, e in out[name].items()), flush=True)
    return out


def training_runs(a) -> list[dict]:
    common = ["--task", "text", "--seq-len", str(a.seq_len), "--steps", str(a.steps), "--batch", str(a.batch),
              "--d-model", str(a.d_model), "--layers", str(a.layers), "--heads", str(a.heads), "--kv-heads",
              str(a.kv_heads), "--rope-base", "1e6", "--lr", str(a.lr), "--eval-size", str(a.eval_size),
              "--eval-batch", "1", "--seed", str(a.seed), "--no-progress", "--log-every", str(max(1, a.steps // 4)),
              "--compression-rate", "16", "--top-k", str(a.seq_len // 16)]
    runs = [("dense cuDNN bf16", ["--attention", "dense", "--dense-implementation", "cudnn"]),
            ("dense XLA bf16", ["--attention", "dense", "--dense-implementation", "xla"]),
            ("dense XLA float32 (whole model)", ["--attention", "dense", "--dense-implementation", "xla",
                                                 "--dtype", "float32"]),
            ("htree one layer (exact) bf16", ["--attention", "htree", "--backend", "pallas"])]
    out = []
    for name, extra in runs:
        tic = time.perf_counter()
        result = train_tiny_lm.main(common + extra)
        out.append(dict(run=name, bits_per_byte=result["bits_per_byte"], final_train_loss=result["losses"][-1],
                        step_ms=result["step_ms"], seconds=time.perf_counter() - tic))
        print(f"{name}: held-out {result['bits_per_byte']:.4f} bits/byte, {result['step_ms']:.1f} ms/step", flush=True)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter, description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-training", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    print(run_header("benchmarks/dense_baseline.py", argv), flush=True)
    result = {"gradients": {f"H_kv={h_kv} K={dim}": gradient_errors(a.seq_len, 4, h_kv, dim)
                            for h_kv, dim in ((4, 64), (2, 64), (1, 128))}}
    if not a.skip_training:
        result["training"] = training_runs(a)
        print("| run | held-out bits/byte | last batch loss | ms/step |\n|---|---|---|---|")
        for r in result["training"]:
            print(f"| {r['run']} | {r['bits_per_byte']:.4f} | {r['final_train_loss']:.4f} | {r['step_ms']:.1f} |")
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
