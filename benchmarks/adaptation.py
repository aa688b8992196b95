"""Adaptation: a dense-trained checkpoint, training continued with htree, scored part way.

    python benchmarks/adaptation.py --checkpoint ck/seed0 [--top-ks 64,128] [--selection bound] \\
        [--compression-rate 16] [--shares 0.01,0.03,0.1] [--lr 3e-4] [--eval-lens 16384,65536] \\
        [--eval-windows 8] [--control] [--out adaptation.json]

The recipe a user converting a dense model follows (DeepSeek's sparse attention was
trained this way, from a dense checkpoint): for each `top_k`, `examples/train_tiny_lm.py`
continues the checkpoint's model with htree (`--init`, the checkpoint's batch and
length) for the largest of `--shares` of the steps the checkpoint was trained for, one
learning-rate schedule (warm-up, cosine to 0) over that run, gradients clipped; after
each share's step count it scores the model on the frontier's held-out windows
(`benchmarks/frontier.py`'s, the same `--window-seed`) with htree at that
configuration. Beside them, the checkpoint itself on the same windows: dense, and htree
with no adaptation (share 0); with `--control`, the checkpoint continued dense by the
same recipe and scored after the same steps, which separates adaptation from more
training. Prints one markdown table; writes every row to `--out`.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

from htree_jax.bench import run_header
from htree_jax.cli import DefaultsHelpFormatter

ROOT = pathlib.Path(__file__).resolve().parents[1]
for folder in (ROOT, ROOT / "examples"):  # run as a script or imported as benchmarks.adaptation
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
import train_tiny_lm  # noqa: E402
from benchmarks import frontier  # noqa: E402
from benchmarks.text_quality import eval_windows  # noqa: E402


def step_counts(shares, trained_steps: int) -> list[int]:
    """The step counts the shares of `trained_steps` come to (at least 1 each), ascending."""
    return sorted({max(1, round(share * trained_steps)) for share in shares})


def adaptation_args(a, top_k: int | None, steps: int, trained: dict):
    """`train_tiny_lm` arguments that continue `a.checkpoint` with htree at `top_k`, or
    (`top_k=None`, the control) with dense attention, by the same recipe."""
    attention = ["--attention", "dense"] if top_k is None else [
        "--attention", "htree", "--top-k", str(top_k), "--compression-rate", str(a.compression_rate),
        "--selection", a.selection, "--selection-block", "1"]
    argv = ["--task", "text", "--init", a.checkpoint, *attention, "--steps", str(steps),
            "--seq-len", str(trained["seq_len"]), "--batch", str(trained["batch"]), "--lr", str(a.lr),
            "--grad-clip", str(a.grad_clip), "--backend", a.backend, "--eval-size", str(a.eval_size),
            "--seed", str(a.seed), "--log-every", str(max(1, steps // 10)), "--no-progress"]
    if a.data:
        argv += ["--data", a.data]
    return train_tiny_lm.parse_args(argv)


def adaptation_rows(a) -> list[dict]:
    """`{kind, checkpoint, config, top_k, share, steps, T, bits, dense_bits, change}` for
    the checkpoint (share 0, and dense), each `top_k` after each share, and with
    `a.control` the checkpoint continued dense by the same recipe (`top_k` None): what
    the same steps give without the change of attention."""
    args = frontier.checkpoint_args(a.checkpoint, a.data, a.backend)
    trained = train_tiny_lm.checkpoint_flags(a.checkpoint)["trained"]
    total = int(trained["steps"])
    lens = a.eval_lens or [int(trained["seq_len"]), 4 * int(trained["seq_len"])]
    windows = {T: eval_windows(train_tiny_lm.task_of(args), T, a.eval_windows, a.window_seed) for T in lens}
    dense_model = train_tiny_lm.build_model(args, attention="dense")
    train_tiny_lm.load_params(dense_model, a.checkpoint)
    dense = frontier.score_model(dense_model, windows)
    rows = []
    rate = "" if a.compression_rate == frontier.DEFAULT_RATE else f" r={a.compression_rate}"
    name = lambda top_k: "dense continued" if top_k is None else f"htree {a.selection} top_k={top_k}{rate}"

    def add(top_k, steps, bits):
        for T, value in bits.items():
            rows.append(dict(kind="adaptation", checkpoint=a.checkpoint, config=name(top_k),
                             rule="dense" if top_k is None else a.selection, top_k=top_k,
                             compression_rate=None if top_k is None else a.compression_rate, share=steps / total,
                             steps=steps, T=T, bits=value, dense_bits=dense[T], change=100 * (value / dense[T] - 1),
                             lr=a.lr, windows=a.eval_windows))
        print(f"{name(top_k)} after {steps} steps ({100 * steps / total:g}% of {total}): "
              + ", ".join(f"T={T} {b:.4f} ({100 * (b / dense[T] - 1):+.2f}%)" for T, b in bits.items()), flush=True)
        frontier.write(a.out, rows)

    print(f"{a.checkpoint}: dense " + ", ".join(f"T={T} {b:.4f}" for T, b in dense.items()), flush=True)
    counts = step_counts(a.shares, total)
    for top_k in ([None] if a.control else []) + a.top_ks:   # the control first: a run cut short keeps it
        tic = time.perf_counter()
        if top_k is not None:
            configuration = dict(attention="htree", fields=dict(top_k=top_k, selection=a.selection,
                                                                compression_rate=a.compression_rate))
            add(top_k, 0, frontier.score(args, dense_model, configuration, windows))

        def on_step(step, model, top_k=top_k):
            if step in counts:
                add(top_k, step, frontier.score_model(model, windows))

        train_tiny_lm.train(adaptation_args(a, top_k, counts[-1], trained), on_step)
        print(f"{name(top_k)}: {time.perf_counter() - tic:.0f} s", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """A row per (top_k, steps): bits per byte and the change against dense at each length."""
    lens = sorted({r["T"] for r in rows})
    head = ["configuration", "steps (share of the dense run's)"] + [f"bits/byte at {T} (vs dense)" for T in lens]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for config, steps in dict.fromkeys((r["config"], r["steps"]) for r in rows):
        at = {r["T"]: r for r in rows if r["config"] == config and r["steps"] == steps}
        share = at[lens[0]]["share"] if lens[0] in at else 0.0
        cells = [config, f"{steps} ({100 * share:g}%)"]
        cells += [f"{at[T]['bits']:.4f} ({at[T]['change']:+.2f}%)" if T in at else "" for T in lens]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter, description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a dense model written by train_tiny_lm --save")
    p.add_argument("--data", default=None, help="the corpus, where it is elsewhere than the checkpoint says")
    p.add_argument("--top-ks", default="64,128")
    p.add_argument("--selection", choices=("bound", "mean"), default="bound")
    p.add_argument("--compression-rate", type=int, default=frontier.DEFAULT_RATE,
                   help="the htree runs' tree (the library's default; the checkpoint's own flag is not used)")
    p.add_argument("--shares", default="0.01,0.03,0.1", help="shares of the checkpoint's steps scored after")
    p.add_argument("--lr", type=float, default=3e-4, help="the continued run's peak learning rate")
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-lens", default="", help="lengths scored (default: the training length and 4x it)")
    p.add_argument("--eval-windows", type=int, default=8)
    p.add_argument("--window-seed", type=int, default=0, help="the windows' draw (frontier.py's)")
    p.add_argument("--eval-size", type=int, default=2, help="the training run's own final evaluation")
    p.add_argument("--backend", default="auto")
    p.add_argument("--seed", type=int, default=0, help="the continued run's batches")
    p.add_argument("--control", action="store_true",
                   help="also continue the checkpoint dense by the same recipe (what the steps give without htree)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    a.top_ks = [int(x) for x in a.top_ks.split(",") if x]
    a.shares = [float(x) for x in a.shares.split(",") if x]
    a.eval_lens = [int(x) for x in a.eval_lens.split(",") if x]
    if not a.top_ks or not a.shares or any(not 0 < s <= 1 for s in a.shares):
        p.error("--top-ks and --shares: at least one each, shares in (0, 1]")
    if a.eval_windows < 1:
        p.error("--eval-windows must be >= 1")
    return a


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    print(run_header("benchmarks/adaptation.py", argv), flush=True)
    rows = adaptation_rows(a)
    print(table(rows), flush=True)
    return rows


if __name__ == "__main__":
    main()
