"""One seed of the context-extension study end to end (issue 104): the short dense base,
each variant's extension at the long length, each scored; resumable by stage.

    python benchmarks/extension_seed.py --dir runs/seed0 --seed 0 [--base-len 16384] \\
        [--base-steps 2400] [--seq-len 65536] [--steps 300] \\
        [--variants dense,block:512,block:256,query:512] [--eval-lens 65536,262144] \\
        [--pieces OUT] [--from-pieces DIR]

Stages, in order, each skipped where `--dir` holds its result (a stage writes its result
last, whole or not at all, so a stopped run leaves only finished stages):
- `base`: `examples/train_tiny_lm.py` dense at `--base-len` by the frontier's recipe
  (`BASE_RECIPE`: d_model 512, 6 layers, 4 heads on 1 kv head of 128, RoPE base 1e6, peak
  learning rate 1e-3, gradients clipped at 1.0, `--base-batch` rows) for `--base-steps`
  steps, seed `--seed`: the checkpoint `base/` in `--dir` (`train_tiny_lm.save_model`);
- one stage a variant (`benchmarks/extension.py`'s `extend`: the base continued at
  `--seq-len` for `--steps` steps, the same batches, schedule and clipping for each,
  scored on the frontier's held-out windows at `--eval-lens` with its own attention):
  `<variant>.json` there, its rows against the dense extension's (dense runs first);
- the table: every variant's rows in `rows.json` there, printed as Markdown (bits per
  byte against dense at each length, the step time and the whole extension's wall time
  against dense's).
Each stage prints a line when it starts and ends, and every `--progress-every` steps
its step, the seconds spent and about how many are left (from its steps so far).

A device machine's disk goes when the machine does: `--pieces OUT` writes the base
checkpoint there as bfloat16 pieces of at most 16 MiB (what a device call brings back)
with an index, and `--from-pieces DIR` rebuilds the base from them before the
stages, so a later allotment resumes without training the base again.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax.numpy as jnp
import numpy as np

from htree_jax.bench import run_header
from htree_jax.cli import DefaultsHelpFormatter

ROOT = pathlib.Path(__file__).resolve().parents[1]
for folder in (ROOT, ROOT / "examples"):  # run as a script or imported as benchmarks.extension_seed
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
import train_tiny_lm  # noqa: E402
from benchmarks import extension, frontier  # noqa: E402

# The frontier's dense recipe (RESULTS, "The frontier at compression_rate 16"), less the
# length, steps, batch and seed this script takes.
BASE_RECIPE = ["--task", "text", "--attention", "dense", "--d-model", "512", "--layers", "6", "--heads", "4",
               "--kv-heads", "1", "--rope-base", "1e6", "--lr", "1e-3", "--grad-clip", "1.0"]
PIECE_BYTES = 16 << 20  # what one file of a device call's $OUT may hold
INDEX = "base.index.json"


def progress(stage: str, steps: int, every: int):
    """`train_tiny_lm.train`'s `on_step`: a line every `every` steps (and at the last)
    with the stage, the step, the seconds since its first step and about how many are
    left at the pace so far."""
    start = time.perf_counter()

    def on_step(step: int, model) -> None:
        if step % every and step != steps:
            return
        spent = time.perf_counter() - start
        left = spent / step * (steps - step)
        print(f"[{stage}] step {step}/{steps}, {spent:.0f} s, about {left:.0f} s left", flush=True)

    return on_step


def flat_params(params: dict, prefix=()):
    """`[(path, array)]` of a nested dict of arrays, each path a tuple of its keys (ints
    stay ints: `nnx.List` entries)."""
    for key in params:
        value = params[key]
        if isinstance(value, dict):
            yield from flat_params(value, prefix + (key,))
        else:
            yield prefix + (key,), value


def write_pieces(checkpoint: pathlib.Path, out: pathlib.Path, piece_bytes: int = PIECE_BYTES) -> list[pathlib.Path]:
    """The checkpoint `checkpoint` (`train_tiny_lm.save_model`'s) as bfloat16 pieces of
    at most `piece_bytes` in `out`: `base.bf16.000`, ... and `INDEX` (each parameter's
    path, shape and offset; the model's flags). Returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    entries, chunks, offset = [], [], 0
    for path, value in flat_params(train_tiny_lm.read_params(checkpoint)):
        data = np.asarray(value, jnp.bfloat16).tobytes()
        entries.append(dict(path=list(path), shape=list(np.shape(value)), offset=offset, bytes=len(data)))
        chunks.append(data)
        offset += len(data)
    whole = b"".join(chunks)
    files = []
    for i in range(0, max(len(whole), 1), piece_bytes):
        files.append(out / f"base.bf16.{i // piece_bytes:03d}")
        files[-1].write_bytes(whole[i:i + piece_bytes])
    flags = json.loads((checkpoint / train_tiny_lm.CHECKPOINT_FLAGS).read_text())
    frontier.write(out / INDEX, dict(params=entries, pieces=[f.name for f in files], model=flags))
    return files + [out / INDEX]


def read_pieces(pieces: pathlib.Path, checkpoint: pathlib.Path) -> None:
    """Rebuilds the checkpoint `write_pieces` wrote to `pieces` in `checkpoint` (its
    parameters the bfloat16 values, as float32)."""
    index = json.loads((pieces / INDEX).read_text())
    whole = b"".join((pieces / name).read_bytes() for name in index["pieces"])
    params: dict = {}
    for entry in index["params"]:
        raw = np.frombuffer(whole[entry["offset"]:entry["offset"] + entry["bytes"]], jnp.bfloat16)
        node = params
        for key in entry["path"][:-1]:
            node = node.setdefault(key, {})
        node[entry["path"][-1]] = raw.astype(np.float32).reshape(entry["shape"])
    train_tiny_lm.write_params(checkpoint, params)
    frontier.write(checkpoint / train_tiny_lm.CHECKPOINT_FLAGS, index["model"])


def base_stage(a, directory: pathlib.Path) -> None:
    """Trains and saves the dense base unless `directory/base` holds it."""
    base = directory / "base"
    if (base / train_tiny_lm.CHECKPOINT_FLAGS).is_file():
        print(f"[base] found in {base}: not trained again", flush=True)
        return
    print(f"[base] dense at {a.base_len} tokens, {a.base_steps} steps, seed {a.seed}", flush=True)
    argv = BASE_RECIPE + ["--seq-len", str(a.base_len), "--batch", str(a.base_batch), "--steps", str(a.base_steps),
                          "--seed", str(a.seed), "--eval-every", str(max(1, a.base_steps // 10)),
                          "--log-every", str(a.progress_every), "--no-progress", "--save", str(base)]
    if a.data:
        argv += ["--data", a.data]
    if a.base_args:
        argv += a.base_args.split()
    train_tiny_lm.train(train_tiny_lm.parse_args(argv), on_step=progress("base", a.base_steps, a.progress_every))
    print(f"[base] saved to {base}", flush=True)


def extension_options(a, directory: pathlib.Path):
    """`benchmarks/extension.py`'s options for extending `directory/base`."""
    return extension.parse_args(["--checkpoint", str(directory / "base"), "--seq-len", str(a.seq_len),
                                 "--steps", str(a.steps), "--eval-every", str(a.eval_every),
                                 "--eval-windows", str(a.eval_windows), "--eval-lens", a.eval_lens,
                                 "--backend", a.backend, "--seed", str(a.seed), "--index-warmup", str(a.index_warmup)]
                                + (["--data", a.data] if a.data else []))


def result_path(directory: pathlib.Path, variant: dict) -> pathlib.Path:
    return directory / f"{variant['name'].replace(' ', '_').replace('=', '')}.json"


def extension_stage(a, directory: pathlib.Path, variant: dict, windows, dense_rows: list) -> list[dict]:
    """The variant's rows: read from its file in `directory`, or extended, scored on
    `windows()` (the scoring windows, made once) and written there."""
    path = result_path(directory, variant)
    if path.is_file():
        print(f"[{variant['name']}] found in {path}: not run again", flush=True)
        return json.loads(path.read_text())
    print(f"[{variant['name']}] from the base at {a.seq_len} tokens, {a.steps} steps", flush=True)
    rows = extension.extend(extension_options(a, directory), variant, windows(), dense_rows,
                            on_step=progress(variant["name"], a.steps, a.progress_every))
    frontier.write(path, rows)
    return rows


def run_seed(a) -> list[dict]:
    """Every stage of `a.dir` in order (the finished ones read back); the rows."""
    directory = pathlib.Path(a.dir)
    directory.mkdir(parents=True, exist_ok=True)
    if a.from_pieces and not (directory / "base" / train_tiny_lm.CHECKPOINT_FLAGS).is_file():
        read_pieces(pathlib.Path(a.from_pieces), directory / "base")
        print(f"[base] rebuilt from the pieces in {a.from_pieces}", flush=True)
    tic = time.perf_counter()
    base_stage(a, directory)
    if a.pieces:
        files = write_pieces(directory / "base", pathlib.Path(a.pieces))
        print(f"[base] {len(files)} files in {a.pieces}", flush=True)
    made = {}

    def windows():
        if not made:
            made.update(extension.scoring_windows(extension_options(a, directory)))
        return made

    rows, dense = [], []
    for variant in a.variants:
        new = extension_stage(a, directory, variant, windows, dense)
        if not dense and variant["attention"] == "dense":
            dense = new
        rows += new
    frontier.write(directory / "rows.json", rows)
    print(f"[seed {a.seed}] every stage done ({time.perf_counter() - tic:.0f} s this call)", flush=True)
    print(table(rows), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """`extension.table` with each variant's whole extension time (its steps' wall time)
    against the dense extension's."""
    lines = extension.table(rows).split("\n")
    lines[0] += " extension s (dense / this) |"
    lines[1] += "---|"
    for i, name in enumerate(dict.fromkeys(r["variant"] for r in rows)):
        first = next(r for r in rows if r["variant"] == name)
        ratio = (f" ({first['dense_train_seconds'] / first['train_seconds']:.2f}x)"
                 if "dense_train_seconds" in first else "")
        lines[2 + i] += f" {first['train_seconds']:.0f}{ratio} |"
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter, description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="the seed's directory: its stages' results, read back if there")
    p.add_argument("--seed", type=int, default=0, help="the base's initialisation and batches, the extensions' batches")
    p.add_argument("--data", default=None, help="the corpus (default: the Python standard library's sources)")
    p.add_argument("--base-len", type=int, default=16384, help="the base's training length")
    p.add_argument("--base-steps", type=int, default=2400, help="the base's steps")
    p.add_argument("--base-batch", type=int, default=2, help="the base's rows a step")
    p.add_argument("--base-args", default="", help="more train_tiny_lm flags for the base (e.g. a smaller model)")
    p.add_argument("--seq-len", type=int, default=65536, help="the extended length")
    p.add_argument("--steps", type=int, default=300, help="each extension's steps")
    p.add_argument("--variants", default="dense,block:512,block:256,query:512",
                   help="benchmarks/extension.py's variants, dense first")
    p.add_argument("--eval-lens", default="65536,262144", help="lengths scored")
    p.add_argument("--eval-windows", type=int, default=8, help="held-out windows of each length")
    p.add_argument("--eval-every", type=int, default=0, help="each extension's held-out curve every N steps")
    p.add_argument("--backend", default="auto", help="htree's backend")
    p.add_argument("--index-warmup", type=int, default=0,
                   help="indexer:K variants: steps of the indexer alone first (extension.py's --index-warmup)")
    p.add_argument("--progress-every", type=int, default=100, help="a progress line every N steps")
    p.add_argument("--pieces", default=None, help="write the base as bfloat16 pieces of <= 16 MiB here")
    p.add_argument("--from-pieces", default=None, help="rebuild the base from pieces there first")
    a = p.parse_args(argv)
    try:
        a.variants = [extension.parse_variant(x) for x in a.variants.split(",") if x]
    except ValueError as e:
        p.error(str(e))
    if a.index_warmup < 0:
        p.error("--index-warmup must be >= 0")
    extension.name_warm_up(a.variants, a.index_warmup)
    if not a.variants or a.variants[0]["attention"] != "dense":
        p.error("--variants: dense first (the others are measured against it)")
    for name in ("base_len", "base_steps", "base_batch", "seq_len", "steps", "eval_windows", "progress_every"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return a


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    print(run_header("benchmarks/extension_seed.py", argv), flush=True)
    return run_seed(a)


if __name__ == "__main__":
    main()
