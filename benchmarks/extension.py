"""Context extension: a short-trained dense checkpoint continued at a longer length, with
dense attention and with htree, scored and timed beside each other (issue 85).

    python benchmarks/extension.py --checkpoint ck/seed0 --seq-len 65536 --steps 300 \\
        [--variants dense,block:512,block:256,query:512] [--eval-lens 65536,262144] \\
        [--eval-windows 8] [--eval-every 50] [--out extension.json]

The path a long-context model is made by: pretrain short, then continue at the long
length. For each variant `examples/train_tiny_lm.py` continues the checkpoint's model
(`--init`) at `--seq-len` for `--steps` steps by the checkpoint's recipe (its batch in
tokens: `batch * seq_len` of the checkpoint, so fewer rows at the longer length; one
warm-up and cosine schedule, gradients clipped), logging the held-out curve every
`--eval-every` steps and the median wall time of its steps. Variants: `dense`
(`jax.nn.dot_product_attention`, cuDNN on a GPU), `block:K` (block selection,
`selection_block = compression_rate`, `block_source="first"`, `top_k=K`), `query:K`
(per-query selection, `top_k=K`), `indexer:K` (block selection ranked by a learned
indexer, SPEC 13: its projections fresh, trained by its loss beside the model's; on the
JAX reference, the kernels not taking it yet). Each extended model is then scored on the frontier's
held-out windows (`benchmarks/frontier.py`'s draw, `--window-seed`) at each of
`--eval-lens` with its own attention. Prints one markdown table (bits per byte and step
time against the dense extension's, all in this one process: the same machine and
call); writes every row to `--out`.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

from htree_jax.bench import run_header
from htree_jax.cli import DefaultsHelpFormatter

ROOT = pathlib.Path(__file__).resolve().parents[1]
for folder in (ROOT, ROOT / "examples"):  # run as a script or imported as benchmarks.extension
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
import train_tiny_lm  # noqa: E402
from benchmarks import frontier  # noqa: E402
from benchmarks.text_quality import eval_windows  # noqa: E402


def parse_variant(text: str) -> dict:
    """`"dense"`, `"block:K"`, `"query:K"` or `"indexer:K"` (block selection ranked by a
    learned indexer, SPEC 13, trained beside the model from a fresh start) -> `{name,
    attention, top_k, block, selection}` (`selection` None: the run's `--selection`)."""
    kind, _, k = text.partition(":")
    if kind == "dense" and not k:
        return dict(name="dense", attention="dense", top_k=None, block=False, selection=None)
    if kind in ("block", "query", "indexer") and k.isdigit() and int(k) > 0:
        name = {"block": "block", "query": "per-query", "indexer": "indexer"}[kind]
        return dict(name=f"{name} top_k={k}", attention="htree", top_k=int(k), block=kind != "query",
                    selection="indexer" if kind == "indexer" else None)
    raise ValueError(f"--variants: each is dense, block:K, query:K or indexer:K (K a positive int), got {text!r}")


def name_warm_up(variants: list[dict], steps: int) -> None:
    """Each indexer variant's name says its warm-up (`--index-warmup`): part of what its
    rows measure, and its stage's file in `extension_seed.py`."""
    for variant in variants:
        if variant["selection"] == "indexer" and steps:
            variant["name"] += f" (warm-up {steps})"


def extension_args(a, variant: dict, trained: dict):
    """`train_tiny_lm` arguments that continue `a.checkpoint` at `a.seq_len` as `variant`."""
    rows = max(1, int(trained["batch"]) * int(trained["seq_len"]) // a.seq_len)
    argv = ["--task", "text", "--init", a.checkpoint, "--attention", variant["attention"], "--steps", str(a.steps),
            "--seq-len", str(a.seq_len), "--batch", str(rows), "--lr", str(a.lr), "--grad-clip", str(a.grad_clip),
            "--backend", a.backend, "--eval-size", str(a.eval_size), "--eval-batch", "1",
            "--eval-every", str(a.eval_every), "--seed", str(a.seed), "--log-every", str(max(1, a.steps // 10)),
            "--no-progress", "--compression-rate", str(a.compression_rate),
            "--selection", variant.get("selection") or a.selection]
    if variant.get("selection") == "indexer" and a.index_warmup:
        argv += ["--index-warmup-steps", str(a.index_warmup)]
    if variant["top_k"] is not None:
        argv += ["--top-k", str(variant["top_k"])]
    if variant["attention"] == "htree":  # each variant names its selection
        argv += (["--selection-block", str(a.compression_rate), "--block-source", "first"] if variant["block"]
                 else ["--selection-block", "1"])
    if a.data:
        argv += ["--data", a.data]
    return train_tiny_lm.parse_args(argv)


def scoring_windows(a) -> dict:
    """`{T: (tokens, targets)}`: the frontier's held-out windows at each scored length
    (`--eval-lens`; default the extended length and 4x it)."""
    args = frontier.checkpoint_args(a.checkpoint, a.data, a.backend)
    lens = a.eval_lens or [a.seq_len, 4 * a.seq_len]
    return {T: eval_windows(train_tiny_lm.task_of(args), T, a.eval_windows, a.window_seed) for T in lens}


def extend(a, variant: dict, windows: dict, dense_rows: list[dict] = (), on_step=None) -> list[dict]:
    """One variant's extension of `a.checkpoint` (`extension_args`) scored on `windows`:
    a row a scored length, against the dense extension's rows `dense_rows` (the dense
    variant without them: against itself). `on_step(step, model)`: `train_tiny_lm.train`'s."""
    trained = train_tiny_lm.checkpoint_flags(a.checkpoint, flag="--checkpoint")["trained"]
    tic = time.perf_counter()
    model, result = train_tiny_lm.train(extension_args(a, variant, trained), on_step=on_step)
    bits = frontier.score_model(model, windows)
    rows = [dict(kind="extension", checkpoint=a.checkpoint, variant=variant["name"], seq_len=a.seq_len,
                 steps=a.steps, trained_steps=trained.get("steps"), trained_seq_len=trained.get("seq_len"),
                 T=T, bits=value, step_ms=result["step_ms"], train_seconds=result["train_seconds"],
                 curve=result["eval_curve"], lr=a.lr, windows=a.eval_windows, device=result["device"])
            for T, value in bits.items()]
    dense = {r["T"]: r for r in (dense_rows or (rows if variant["attention"] == "dense" else []))}
    for row in rows:
        if row["T"] in dense:
            d = dense[row["T"]]
            row.update(dense_bits=d["bits"], change=100 * (row["bits"] / d["bits"] - 1), dense_step_ms=d["step_ms"],
                       speedup=d["step_ms"] / row["step_ms"], dense_train_seconds=d["train_seconds"])
    print(f"{variant['name']}: " + ", ".join(f"T={T} {b:.4f} bits/byte" for T, b in bits.items())
          + f", {result['step_ms']:.1f} ms/step ({time.perf_counter() - tic:.0f} s)", flush=True)
    return rows


def extension_rows(a) -> list[dict]:
    """`{variant, T, bits, dense_bits, change, step_ms, dense_step_ms, speedup, curve}`
    for each variant at each scored length (dense first: the others are against it)."""
    train_tiny_lm.checkpoint_flags(a.checkpoint, flag="--checkpoint")  # named by its own flag if missing
    windows = scoring_windows(a)
    rows, dense = [], []
    for variant in a.variants:
        new = extend(a, variant, windows, dense)
        if not dense and variant["attention"] == "dense":
            dense = new
        rows += new
        frontier.write(a.out, rows)
    return rows


def table(rows: list[dict]) -> str:
    """A row per variant: bits per byte (against the dense extension) at each length, and
    the step time (the dense extension's over this one's)."""
    lens = sorted({r["T"] for r in rows})
    head = ["variant"] + [f"bits/byte at {T} (vs dense)" for T in lens] + ["ms/step (dense / this)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in dict.fromkeys(r["variant"] for r in rows):
        at = {r["T"]: r for r in rows if r["variant"] == name}
        change = lambda r: f" ({r['change']:+.2f}%)" if "change" in r else ""
        first = at[lens[0]]
        speed = f" ({first['speedup']:.2f}x)" if "speedup" in first else ""
        cells = [name] + [f"{at[T]['bits']:.4f}{change(at[T])}" if T in at else "" for T in lens]
        lines.append("| " + " | ".join(cells + [f"{first['step_ms']:.1f}{speed}"]) + " |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter, description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a dense model written by train_tiny_lm --save")
    p.add_argument("--data", default=None, help="the corpus, where it is elsewhere than the checkpoint says")
    p.add_argument("--seq-len", type=int, required=True, help="the extended length")
    p.add_argument("--steps", type=int, required=True, help="steps at the extended length, every variant")
    p.add_argument("--variants", default="dense,block:512,block:256,query:512")
    p.add_argument("--compression-rate", type=int, default=frontier.DEFAULT_RATE)
    p.add_argument("--selection", choices=("bound", "mean"), default="bound")
    p.add_argument("--lr", type=float, default=3e-4, help="the continued run's peak learning rate")
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--index-warmup", type=int, default=0,
                   help="indexer:K variants: steps of the indexer alone before the extension's (train_tiny_lm "
                        "--index-warmup-steps)")
    p.add_argument("--eval-every", type=int, default=0, help="the held-out curve every N steps (0: the end only)")
    p.add_argument("--eval-size", type=int, default=2, help="held-out rows of the curve's points")
    p.add_argument("--eval-lens", default="", help="lengths scored (default: the extended length and 4x it)")
    p.add_argument("--eval-windows", type=int, default=8)
    p.add_argument("--window-seed", type=int, default=0, help="the windows' draw (frontier.py's)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--seed", type=int, default=0, help="the continued runs' batches (the same for every variant)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    try:
        a.variants = [parse_variant(x) for x in a.variants.split(",") if x]
    except ValueError as e:
        p.error(str(e))
    a.eval_lens = [int(x) for x in a.eval_lens.split(",") if x]
    if a.index_warmup < 0:
        p.error("--index-warmup must be >= 0")
    name_warm_up(a.variants, a.index_warmup)
    if not a.variants or a.steps < 1 or a.seq_len < 1 or a.eval_windows < 1:
        p.error("--variants: at least one; --steps, --seq-len, --eval-windows: at least 1")
    if a.variants[0]["attention"] != "dense" and any(v["attention"] == "dense" for v in a.variants):
        p.error("--variants: dense first (the others are measured against it)")
    return a


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    print(run_header("benchmarks/extension.py", argv), flush=True)
    rows = extension_rows(a)
    print(table(rows), flush=True)
    return rows


if __name__ == "__main__":
    main()
