"""The whole model's training step, dense and htree in one call (issue 103).

    python benchmarks/bench_train_step.py [--models frontier,g4] [--sizes 65536,131072] \\
        [--inputs random,text] [--iters 5] [--top-k 512] [--json out.json]

What a user who trains a long-context model feels, not attention alone: for each model of
`MODELS` (`examples/train_tiny_lm.py`'s `TinyLM`: bytes in, RMSNorm, attention, MLP, the
frontier recipe's token shift; bfloat16 on a GPU), one training step (loss, gradients,
AdamW with the gradients clipped, as `train_tiny_lm` steps) with dense attention (cuDNN on
a GPU) and with htree (`HTreeConfig()`, the default, at `--top-k`), one row of `--batch`
sequences of each `--sizes` length: medians of `--iters` steps after a warm-up step,
both built from one seed in this one process. Inputs: `random` bytes, or `text` windows
of the frontier's corpus (the Python standard library's sources: correlated keys, as a
model meets them).

Prints a markdown table and one line per row; `--json` writes the rows (model, shape, T,
inputs, dense and htree ms, `dense_over_htree` > 1: htree faster, the card, jax and the
commit given by `--commit`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from htree_jax import HTreeConfig
from htree_jax.bench import median_ms, run_header
from htree_jax.cli import DefaultsHelpFormatter

ROOT = pathlib.Path(__file__).resolve().parents[1]
for folder in (ROOT, ROOT / "examples"):  # run as a script or imported as benchmarks.bench_train_step
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
import train_tiny_lm  # noqa: E402

# The models timed, as `train_tiny_lm` shape flags: the frontier's own (4 heads on one kv
# head, K = 128: G=4) and a G=4 model of 8 kv heads (32 heads of 128 features, Llama-3-8B's
# and Mistral-7B's attention shape) in two layers, so that it fits one card at 128K.
MODELS = {
    "frontier": dict(d_model=512, layers=6, heads=4, kv_heads=1),
    "g4": dict(d_model=4096, layers=2, heads=32, kv_heads=8),
}
INPUTS = ("random", "text")


def model_args(name: str, T: int, batch: int, attention: str, top_k: int):
    """`train_tiny_lm`'s arguments for model `name` at `T` tokens, `batch` rows, with
    `attention` ("dense" or "htree": `HTreeConfig()`'s fields, `top_k` replaced)."""
    shape = MODELS[name]
    default = HTreeConfig()
    argv = ["--task", "text", "--attention", attention, "--seq-len", str(T), "--batch", str(batch),
            "--d-model", str(shape["d_model"]), "--layers", str(shape["layers"]), "--heads", str(shape["heads"]),
            "--kv-heads", str(shape["kv_heads"]), "--compression-rate", str(default.compression_rate),
            "--top-k", str(top_k), "--selection", default.selection, "--selection-block",
            str(default.selection_block), "--block-source", default.block_source, "--grad-clip", "1.0",
            "--no-progress"]
    return train_tiny_lm.parse_args(argv)


def step_fn(args):
    """`(step, model, optimizer)`: one jitted training step of the model `args` describe
    (its loss, gradients and an AdamW update with the gradients clipped at 1.0)."""
    model = train_tiny_lm.build_model(args)
    transform = optax.chain(optax.clip_by_global_norm(args.grad_clip), optax.adamw(1e-4, weight_decay=0.01))
    optimizer = nnx.Optimizer(model, transform, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, tokens, targets):
        (loss, _), grads = nnx.value_and_grad(train_tiny_lm.query_loss, has_aux=True)(model, tokens, targets)
        optimizer.update(model, grads)
        return loss

    return step, model, optimizer


def batch_of(kind: str, args, seed: int):
    """`(tokens, targets)` `[batch, T]` int32: uniform random bytes, or `text` windows of
    the corpus's training documents."""
    rng = np.random.default_rng(seed)
    if kind == "random":
        data = rng.integers(0, train_tiny_lm.TextCorpus.vocab, (args.batch, args.seq_len + 1), dtype=np.int32)
        return jnp.asarray(data[:, :-1]), jnp.asarray(data[:, 1:])
    tokens, targets = train_tiny_lm.task_of(args).batch(rng, args.batch, args.seq_len)
    return jnp.asarray(tokens), jnp.asarray(targets)


def time_step(name: str, T: int, kind: str, a) -> dict:
    """One row: model `name` at `T` tokens on `kind` inputs, dense then htree."""
    row = dict(model=name, **MODELS[name], T=T, batch=a.batch, inputs=kind, top_k=a.top_k,
               device=jax.devices()[0].device_kind, jax=jax.__version__, commit=a.commit)
    for attention in ("dense", "htree"):
        args = model_args(name, T, a.batch, attention, a.top_k)
        step, model, optimizer = step_fn(args)
        tokens, targets = batch_of(kind, args, a.seed)
        row[f"{attention}_ms"] = median_ms(step, (model, optimizer, tokens, targets), a.iters)
        del step, model, optimizer
    row["dense_over_htree"] = row["dense_ms"] / row["htree_ms"]
    return row


def table(rows: list[dict]) -> str:
    lines = ["| model | heads / kv heads | T | inputs | dense ms | htree ms | dense / htree |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} (d{r['d_model']}, {r['layers']} layers) | {r['heads']} / {r['kv_heads']} | "
                     f"{r['T']} | {r['inputs']} | {r['dense_ms']:.1f} | {r['htree_ms']:.1f} | "
                     f"{r['dense_over_htree']:.2f}x |")
    return "\n".join(lines)


def names(text: str, allowed, flag: str) -> list[str]:
    chosen = [x for x in text.split(",") if x]
    bad = [x for x in chosen if x not in allowed]
    if bad or not chosen:
        raise SystemExit(f"{flag}: each of {', '.join(allowed)}, got {text!r}")
    return chosen


def parse_args(argv=None):
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter, description=__doc__.splitlines()[0])
    p.add_argument("--models", default="frontier,g4", help=f"models to time, comma-separated ({', '.join(MODELS)})")
    p.add_argument("--sizes", default="65536,131072", help="sequence lengths T, comma-separated")
    p.add_argument("--inputs", default="random,text", help=f"inputs, comma-separated ({', '.join(INPUTS)})")
    p.add_argument("--batch", type=int, default=1, help="rows a step")
    p.add_argument("--top-k", type=int, default=HTreeConfig().top_k, help="htree's top_k")
    p.add_argument("--iters", type=int, default=5, help="timed steps after one warm-up step (median)")
    p.add_argument("--seed", type=int, default=0, help="the inputs' and the models' seed")
    p.add_argument("--commit", default="", help="the tree's commit, written into every row")
    p.add_argument("--json", default=None, help="write the rows here")
    a = p.parse_args(argv)
    a.model_names = names(a.models, tuple(MODELS), "--models")
    a.input_kinds = names(a.inputs, INPUTS, "--inputs")
    try:
        a.size_list = [int(x) for x in a.sizes.split(",") if x]
    except ValueError:
        raise SystemExit(f"--sizes: comma-separated ints, got {a.sizes!r}") from None
    if not a.size_list or min(a.size_list) < 4 or a.batch < 1 or a.iters < 1 or a.top_k < 1:
        raise SystemExit("--sizes must be ints >= 4; --batch, --iters and --top-k >= 1")
    return a


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    print(run_header("benchmarks/bench_train_step.py", argv), flush=True)
    rows = []
    for name in a.model_names:
        for T in a.size_list:
            for kind in a.input_kinds:
                rows.append(time_step(name, T, kind, a))
                r = rows[-1]
                print(f"{name} T={T} {kind}: dense {r['dense_ms']:.1f} ms, htree {r['htree_ms']:.1f} ms, "
                      f"{r['dense_over_htree']:.2f}x", flush=True)
    print(table(rows))
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
