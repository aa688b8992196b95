"""Training quality at long context (issue 21): `examples/train_tiny_lm.py` trained with
htree and with dense attention at several lengths, for the same steps on the same data,
then loss curves and accuracy against T in one figure.

    python benchmarks/train_quality.py --out benchmarks/train_quality.json      # on a GPU
    python benchmarks/train_quality.py --plot benchmarks/train_quality.json \\
        --png benchmarks/train_quality.png                                        # anywhere

The runs: for each T in `--seq-lens`, htree with each `--top-k` (`--top-k-long` also where
T > 8192; at T <= top_k * compression_rate htree is exact attention, so it is not run
there) and dense (cuDNN on a GPU). Each run has `--tokens-per-step` tokens per step
(batch = tokens / T), the same steps, model, seed and data stream. The JSON (a list of
`train_tiny_lm.main` results) is rewritten after every run, so a time limit keeps the
finished ones; `--time-budget` skips the runs that would start after it. Flags it does
not know go to every run (e.g. `--selection bound`: htree ranks nodes by score bounds,
`HTreeConfig.selection`; `--backend reference` where the kernels lack a rule).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

from htree_jax.cli import DefaultsHelpFormatter

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ("--d-model", "128", "--heads", "4", "--kv-heads", "2", "--layers", "2", "--rope-base", "1e6",
                 "--num-values", "16", "--num-keys", "64", "--pairs", "8", "--queries", "8")


def load_example():
    sys.path.insert(0, str(ROOT / "examples"))
    import train_tiny_lm

    return train_tiny_lm


def run_specs(seq_lens, top_ks, top_ks_long, long_from=8192, compression_rate=16, dense=True):
    """`[(T, attention, top_k)]`: htree at every `top_k` whose tree is sparse at T, plus
    `top_ks_long` where T > long_from, then dense, per T."""
    specs = []
    for T in seq_lens:
        for top_k in list(top_ks) + (list(top_ks_long) if T > long_from else []):
            if T > top_k * compression_rate:
                specs.append((T, "htree", top_k))
        if dense:
            specs.append((T, "dense", None))
    return specs


def train_all(args, extra) -> list[dict]:
    example = load_example()
    results = []
    out = pathlib.Path(args.out)
    start = time.perf_counter()
    specs = run_specs(args.seq_lens, args.top_k, args.top_k_long, compression_rate=args.compression_rate,
                      dense=not args.skip_dense)
    for T, attention, top_k in specs:
        if time.perf_counter() - start > args.time_budget:
            print(f"# time budget spent: skipped T={T} {attention} top_k={top_k}", flush=True)
            continue
        argv = ["--attention", attention, "--seq-len", str(T), "--steps", str(args.steps),
                "--batch", str(args.tokens_per_step // T), "--eval-size", str(args.eval_size),
                "--log-every", str(args.log_every), "--no-progress", "--seed", str(args.seed),
                "--len-warmup-steps", str(args.len_warmup_steps),
                "--compression-rate", str(args.compression_rate), *DEFAULT_MODEL, *extra]
        if top_k is not None:  # per query, as RESULTS' rows were trained
            argv += ["--top-k", str(top_k), "--selection-block", "1"]
        print("# train_tiny_lm " + " ".join(argv), flush=True)
        results.append(example.main(argv))
        out.write_text(json.dumps(results))
    return results


def smooth(values, window: int):
    """Trailing mean over `window` steps (shorter at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def label(result: dict) -> str:
    if result["attention"] == "dense":
        return "dense"
    # Runs written before the bound became the default (2026-11-26) name no rule: the mean.
    rule = result.get("selection") or "mean"
    warm = f" after {result['dense_steps']} dense" if result.get("dense_steps") else ""
    return f"htree top_k={result['top_k']}" + ("" if rule == "bound" else f" {rule}") + warm


def plot(results: list[dict], png: str | None = None, window: int = 20):
    """One loss panel per T (training loss, trailing mean over `window` steps) and final
    eval accuracy against T; saves `png` if given; returns the figure."""
    import matplotlib.pyplot as plt

    first_seed = min(r.get("seed", 0) for r in results)
    seq_lens = sorted({r["seq_len"] for r in results})
    labels = sorted({label(r) for r in results}, key=lambda s: (s != "dense", len(s), s))
    colors = {name: f"C{i}" for i, name in enumerate(labels)}
    fig, axes = plt.subplots(1, len(seq_lens) + 1, figsize=(4.2 * (len(seq_lens) + 1), 3.6))
    for ax, T in zip(axes, seq_lens):
        for r in results:
            if r["seq_len"] == T and r.get("seed", 0) == first_seed:
                ax.plot(smooth(r["losses"], window), color=colors[label(r)], label=label(r))
        warmup = next((r.get("len_warmup_steps", 0) for r in results if r["seq_len"] == T), 0)
        if warmup:
            ax.axvline(warmup, color="gray", ls=":", lw=1)
            ax.text(warmup, 0.93, f" T={T} from here", transform=ax.get_xaxis_transform(), fontsize=7,
                    color="gray")
        ax.set_title(f"T = {T} (seed {first_seed})")
        ax.set_xlabel("step")
        ax.set_ylabel(f"training loss (mean of {window} steps)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    ax = axes[-1]
    for name in labels:
        points = [(r["seq_len"], r["accuracy"]) for r in results if label(r) == name]
        by_T = {T: [a for t, a in points if t == T] for T in sorted({t for t, _ in points})}
        ax.plot(list(by_T), [sum(a) / len(a) for a in by_T.values()], "-", color=colors[name], label=name)
        ax.plot([t for t, _ in points], [a for _, a in points], "o", color=colors[name], ms=4)
    ax.axhline(results[0]["chance"], color="gray", ls=":", label="chance")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("T (tokens)")
    ax.set_ylabel("eval accuracy (all queries)")
    ax.set_ylim(0, 1.02)
    ax.set_title("eval accuracy (line: mean over seeds)")
    ax.legend(fontsize=8)
    r0 = results[0]
    fig.suptitle(f"{r0['task']}: {r0['pairs']} pairs, {r0['queries']} queries; d_model {r0['d_model']}, "
                 f"{r0['layers']} layers; {r0['steps']} steps of {r0['batch'] * r0['seq_len']} tokens, lengths "
                 f"256, 512, ... over the first {r0.get('len_warmup_steps', 0)}; "
                 f"{r0['dtype']}, {r0['device']}", fontsize=9)
    fig.tight_layout()
    if png:
        fig.savefig(png, dpi=110)
    return fig


def table(results: list[dict]) -> str:
    """The RESULTS.md table."""
    lines = ["| T | attention | seed | batch | eval accuracy | eval loss | ms / step | tokens / s | train s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['seq_len']} | {label(r)} | {r.get('seed', 0)} | {r['batch']} | {r['accuracy']:.3f} | "
                     f"{r['eval_loss']:.4f} | {r['step_ms']:.1f} | {r['tokens_per_second']:,.0f} | "
                     f"{r['train_seconds']:.0f} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter, description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--seq-lens", type=ints, default=[4096, 16384, 32768])
    p.add_argument("--top-k", type=ints, default=[64])
    p.add_argument("--top-k-long", type=ints, default=[512], help="also run where T > 8192")
    p.add_argument("--compression-rate", type=int, default=16)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--len-warmup-steps", type=int, default=500,
                   help="the example's length curriculum: 256, 512, ... tokens over these first steps")
    p.add_argument("--skip-dense", action="store_true")
    p.add_argument("--tokens-per-step", type=int, default=131072)
    p.add_argument("--eval-size", type=int, default=256)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget", type=float, default=float("inf"), help="seconds; later runs are skipped")
    p.add_argument("--out", default="train_quality.json")
    p.add_argument("--plot", help="JSONs written by training runs, comma-separated: draw them, train nothing")
    p.add_argument("--png", help="where to save the figure (with --plot)")
    args, extra = p.parse_known_args(argv)
    if not args.plot and args.seq_lens and any(args.tokens_per_step % T for T in args.seq_lens):
        p.error(f"--tokens-per-step ({args.tokens_per_step}) must be a multiple of every --seq-lens "
                f"{args.seq_lens}: each run's batch is tokens / T")
    return args, extra


def main(argv=None):
    args, extra = parse_args(argv)
    if args.plot:
        results = [r for path in args.plot.split(",") for r in json.loads(pathlib.Path(path).read_text())]
        plot(results, args.png)
    else:
        results = train_all(args, extra)
    print(table(results))
    return results


if __name__ == "__main__":
    main()
