"""Real text: does htree predict the next byte as well as dense attention, near and far
from a window's start, within and beyond the training length?

    python benchmarks/text_quality.py [--data DIR] [--seq-len 16384] [--steps 2000] \\
        [--eval-lens 16384,65536,262144] [--top-ks 64,512] [--rules bound,mean] \\
        [--train dense,htree,htree-warmup] [--out text_quality.json] [--png text_quality.png]

Trains the byte-level LM of `examples/train_tiny_lm.py --task text` (the default corpus:
Python's standard library source) for `--steps` steps at `--seq-len`, with each of
`--train`: `dense` (cuDNN), `htree` (the bound, `--train-top-k`, from scratch) and
`htree-warmup` (the same, its first half of the steps dense: `--dense-steps`). Then
evaluates each trained model's weights on the same held-out windows (`--eval-windows`
of each length) with dense attention and with htree for every rule and `top_k`, and
reports bits per byte overall and per position bucket (0-1K, 1K-4K, 4K-16K, 16K-64K,
64K-256K): a bucket's bits per byte below the first bucket's is what far context buys.
Dense runs at every length (cuDNN's flash attention keeps no `T x T` array). Prints one
markdown table, writes every figure to `--out` and draws bits per byte against position
(`--png`, one line per model and attention at the longest length).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from htree_jax.cli import DefaultsHelpFormatter

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT / "examples") not in sys.path:
    sys.path.insert(0, str(ROOT / "examples"))
import train_tiny_lm  # noqa: E402

BUCKETS = [(0, 1024), (1024, 4096), (4096, 16384), (16384, 65536), (65536, 262144)]


def bucket_name(lo: int, hi: int) -> str:
    k = lambda x: f"{x // 1024}K"
    return f"{k(lo) if lo else '0'}-{k(hi)}"


@nnx.jit
def position_losses(model, tokens, targets):
    """Cross-entropy in nats `[B, T]` float32 of each next byte."""
    logits = model(tokens).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def bits_per_byte(losses: np.ndarray) -> dict:
    """`{"overall": bits, bucket name: bits}` of position losses `[B, T]` (nats)."""
    T = losses.shape[1]
    out = {"overall": float(losses.mean() / math.log(2))}
    for lo, hi in BUCKETS:
        if lo < T:
            out[bucket_name(lo, hi)] = float(losses[:, lo:min(hi, T)].mean() / math.log(2))
    return out


def eval_windows(corpus, seq_len: int, count: int, seed: int):
    """The held-out windows every model is scored on at `seq_len` (fixed by `seed`)."""
    return corpus.eval_batch(np.random.default_rng(seed + seq_len), count, seq_len)


def model_args(a, attention: str, dense_steps: int = 0):
    """`train_tiny_lm` arguments of one trained model."""
    argv = ["--task", "text", "--seq-len", str(a.seq_len), "--steps", str(a.steps), "--batch", str(a.batch),
            "--d-model", str(a.d_model), "--layers", str(a.layers), "--heads", str(a.heads),
            "--kv-heads", str(a.kv_heads), "--compression-rate", "16", "--top-k", str(a.train_top_k),
            "--selection-block", "1",
            "--rope-base", str(a.rope_base), "--lr", str(a.lr), "--eval-size", "1", "--attention", attention,
            "--dense-steps", str(dense_steps), "--backend", a.backend, "--seed", str(a.seed),
            "--log-every", str(max(1, a.steps // 10))]
    if a.data:
        argv += ["--data", a.data]
    if a.no_progress:
        argv.append("--no-progress")
    if a.dtype:
        argv += ["--dtype", a.dtype]
    return train_tiny_lm.parse_args(argv)


def model_fields(a) -> dict:
    """The trained model's size and recipe, recorded with each row."""
    return dict(d_model=a.d_model, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads, lr=a.lr, batch=a.batch,
                seed=a.seed, train_top_k=a.train_top_k, eval_windows=a.eval_windows)


def evaluate(model, args, corpus, a, attention: str, **config) -> dict:
    """Bits per byte of `model`'s weights under `attention` (`config`: top_k, selection)
    at every `--eval-lens` length: `{T: {"overall", buckets...}}`."""
    scored = train_tiny_lm.build_model(args, attention=attention, **config)
    nnx.update(scored, nnx.state(model, nnx.Param))
    out = {}
    for T in a.eval_lens:
        tokens, targets = eval_windows(corpus, T, a.eval_windows, a.seed)
        losses = np.concatenate([np.asarray(position_losses(scored, jnp.asarray(tokens[i:i + 1]),
                                                            jnp.asarray(targets[i:i + 1])))
                                 for i in range(len(tokens))])
        out[T] = bits_per_byte(losses)
        print(f"  {attention} {config or ''} T={T}: {out[T]['overall']:.4f} bits/byte", flush=True)
    return out


def trained_label(row: dict) -> str:
    """The trained model's name in a plot: its recipe and, where recorded, its size."""
    m = row.get("model")
    return row["trained"] + (f" (d{m['d_model']} L{m['layers']})" if m else "")


def table(rows: list[dict]) -> str:
    names = [bucket_name(lo, hi) for lo, hi in BUCKETS]
    lines = ["| trained | evaluated with | T | overall | " + " | ".join(names) + " |",
             "|---|---|---|---|" + "---|" * len(names)]
    for r in rows:
        cells = [f"{r['bits'][n]:.3f}" if n in r["bits"] else "" for n in names]
        lines.append(f"| {trained_label(r)} | {r['evaluated']} | {r['T']} | {r['bits']['overall']:.4f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], png: str) -> None:
    """Bits per byte against position, one panel per evaluated length, one line per
    trained model and attention."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["T"] for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 5), squeeze=False)
    for ax, T in zip(axes[0], lengths):
        ax.set_prop_cycle(color=plt.cm.tab20.colors)  # a colour per line, up to 20
        for r in (r for r in rows if r["T"] == T):
            names = [bucket_name(lo, hi) for lo, hi in BUCKETS if bucket_name(lo, hi) in r["bits"]]
            ax.plot(range(len(names)), [r["bits"][n] for n in names], marker="o",
                    label=f"{trained_label(r)} / {r['evaluated']}")
        ax.set_xticks(range(len(names)), names)
        ax.set_xlabel("position in the window (bytes)")
        ax.set_ylabel("bits per byte (held out)")
        ax.set_title(f"real text, T={T}")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def parse_args(argv=None):
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter, description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=None, help="corpus directory (default: Python's standard library source)")
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=2, help="sequences of --seq-len bytes per step")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--rope-base", type=float, default=1e6)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--train", default="dense,htree,htree-warmup")
    p.add_argument("--train-top-k", type=int, default=64)
    p.add_argument("--eval-lens", default="16384,65536,262144")
    p.add_argument("--eval-windows", type=int, default=4)
    p.add_argument("--top-ks", default="64,512")
    p.add_argument("--rules", default="bound,mean")
    p.add_argument("--backend", default="auto")
    p.add_argument("--dtype", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--png", default=None)
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]
    a.eval_lens, a.top_ks = ints(a.eval_lens), ints(a.top_ks)
    a.rules = [x for x in a.rules.split(",") if x]
    a.train = [x for x in a.train.split(",") if x]
    for t in a.train:
        if t not in ("dense", "htree", "htree-warmup"):
            p.error(f"--train takes dense, htree and htree-warmup, got {t!r}")
    return a


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    rows = []
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, {time.strftime('%Y-%m-%d')}: "
          f"python benchmarks/text_quality.py {' '.join(argv if argv is not None else sys.argv[1:])}", flush=True)
    for trained in a.train:
        attention = "dense" if trained == "dense" else "htree"
        args = model_args(a, attention, a.steps // 2 if trained == "htree-warmup" else 0)
        corpus = train_tiny_lm.task_of(args)
        model, result = train_tiny_lm.train(args)
        label = trained if trained == "dense" else f"{trained} bound top_k={a.train_top_k}"
        evaluations = [("dense", "dense", {})] + [
            (f"htree {rule} top_k={k}", "htree", dict(top_k=k, selection=rule)) for rule in a.rules for k in a.top_ks]
        for name, how, config in evaluations:
            for T, bits in evaluate(model, args, corpus, a, how, **config).items():
                rows.append(dict(trained=label, evaluated=name, T=T, bits=bits, train_seconds=result["train_seconds"],
                                 final_train_loss=result["losses"][-1], steps=a.steps, seq_len=a.seq_len,
                                 step_ms=result["step_ms"], model=model_fields(a)))
            if a.out:  # after every evaluation: a time limit keeps what finished
                pathlib.Path(a.out).write_text(json.dumps(rows, indent=1))
    print(table(rows), flush=True)
    if a.png:
        plot(rows, a.png)
    return rows


if __name__ == "__main__":
    main()
