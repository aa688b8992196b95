"""Selection without retraining (issue 31, stage 1): train the tiny LM with dense attention
at one length, then evaluate the same weights with htree attention under each selection
rule (`HTreeConfig.selection`, docs/SPEC.md section 11) and `top_k`, at that length and
longer ones: how much long-range recall each rule keeps when a dense model adopts sparse
attention, the way sparse attention is most often adopted.

    python benchmarks/selection_transfer.py --out selection_transfer.json     # on a GPU

The dense run is `train_quality.py`'s recipe (its `DEFAULT_MODEL`, the length
curriculum); htree evaluates through `--backend` (default "reference": the rule "bound"
runs there so far, and both rules run there for a like comparison). The JSON is
rewritten after every evaluation, so a time limit keeps the finished ones.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import pickle
import sys
import time

import jax
import numpy as np
from flax import nnx
from htree_jax.cli import DefaultsHelpFormatter

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))

import train_tiny_lm  # noqa: E402
from train_quality import DEFAULT_MODEL  # noqa: E402


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter, description=__doc__.split("\n\n")[0])
    p.add_argument("--train-len", type=int, default=16384)
    p.add_argument("--eval-lens", type=ints, default=[16384, 32768])
    p.add_argument("--top-k", type=ints, default=[64, 512])
    p.add_argument("--selections", default="mean,bound")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--len-warmup-steps", type=int, default=500)
    p.add_argument("--tokens-per-step", type=int, default=131072)
    p.add_argument("--eval-size", type=int, default=64)
    p.add_argument("--eval-tokens", type=int, default=131072, help="tokens per evaluation call")
    p.add_argument("--backend", default="reference", help="htree's backend for the evaluations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget", type=float, default=float("inf"), help="seconds; later evaluations are skipped")
    p.add_argument("--out", default="selection_transfer.json")
    p.add_argument("--save-weights", help="write the trained dense weights here (a pickle of NumPy arrays)")
    p.add_argument("--load-weights", help="evaluate these weights (from --save-weights) instead of training")
    p.add_argument("extra", nargs="*", help="more train_tiny_lm flags (after --)")
    args = p.parse_args(argv)
    for name in ("train_len", "steps", "tokens_per_step", "eval_size", "eval_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")
    if args.tokens_per_step % args.train_len:
        raise SystemExit("--tokens-per-step must be a multiple of --train-len")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    start = time.perf_counter()
    example_argv = ["--attention", "dense", "--seq-len", str(args.train_len), "--steps", str(args.steps),
                    "--batch", str(args.tokens_per_step // args.train_len), "--eval-size", str(args.eval_size),
                    "--no-progress", "--seed", str(args.seed), "--len-warmup-steps", str(args.len_warmup_steps),
                    "--compression-rate", "16", "--selection-block", "1", "--backend", args.backend, *DEFAULT_MODEL,
                    *args.extra]
    print("# train_tiny_lm " + " ".join(example_argv), flush=True)
    example_args = train_tiny_lm.parse_args(example_argv)
    if args.load_weights:
        dense = train_tiny_lm.build_model(example_args)
        nnx.update(dense, pickle.loads(pathlib.Path(args.load_weights).read_bytes()))
        accuracy, loss = train_tiny_lm.eval_accuracy(dense, example_args, args.train_len)
        trained = dict(accuracy=accuracy, eval_loss=loss, weights=args.load_weights)
    else:
        dense, trained = train_tiny_lm.train(example_args)
    weights = nnx.state(dense, nnx.Param)
    if args.save_weights:
        pathlib.Path(args.save_weights).write_bytes(pickle.dumps(jax.tree.map(np.asarray, weights)))
    results = [dict(trained, evaluated="dense", eval_len=args.train_len)]
    out = pathlib.Path(args.out)
    out.write_text(json.dumps(results))
    for T in args.eval_lens:
        example_args.eval_batch = max(1, args.eval_tokens // T)
        runs = [("dense", None, None)] * (T != args.train_len)
        runs += [("htree", top_k, rule) for top_k in args.top_k for rule in args.selections.split(",")
                 if T > top_k * 16]
        for attention, top_k, rule in runs:
            if time.perf_counter() - start > args.time_budget:
                print(f"# time budget spent: skipped T={T} {attention} top_k={top_k} {rule}", flush=True)
                continue
            fields = {} if attention == "dense" else dict(top_k=top_k, selection=rule)
            model = train_tiny_lm.build_model(example_args, attention, **fields)
            nnx.update(model, weights)
            tic = time.perf_counter()
            accuracy, loss = train_tiny_lm.eval_accuracy(model, example_args, T)
            seconds = time.perf_counter() - tic
            results.append(dict(evaluated=attention, eval_len=T, top_k=top_k, selection=rule, accuracy=accuracy,
                                eval_loss=loss, eval_size=args.eval_size, eval_seconds=seconds,
                                train_len=args.train_len, backend=args.backend))
            print(f"T={T} {attention} top_k={top_k} selection={rule}: accuracy {accuracy:.3f}, loss {loss:.4f} "
                  f"({seconds:.0f} s)", flush=True)
            out.write_text(json.dumps(results))
    print("| eval T | attention | top_k | selection | accuracy |\n|---|---|---|---|---|")
    for r in results:
        accuracy = r["accuracy"]
        print(f"| {r['eval_len']} | {r['evaluated']} | {r.get('top_k') or '-'} | {r.get('selection') or '-'} "
              f"| {accuracy:.3f} |")
    return results


if __name__ == "__main__":
    main()
