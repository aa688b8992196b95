"""The frontier: how much quality htree gives up for how much speed, per configuration.

    python benchmarks/frontier.py --checkpoints ck/seed0,ck/seed1 [--eval-lens 16384,65536] \\
        [--eval-windows 8] [--top-ks 64,128,256,512] [--rules bound,mean] \\
        [--block-sources first,previous] [--speed-T 131072] [--out frontier.json] [--png frontier.png]

Quality: each checkpoint (a model `examples/train_tiny_lm.py --task text --save DIR`
wrote; several = seeds of one recipe) is scored on the same held-out windows
(`--eval-windows` of each `--eval-lens` length, by default the training length and 4x it)
with dense attention (cuDNN on a GPU) and with htree for every rule and `top_k`, and with
block selection (SPEC 12, `selection_block = compression_rate`) for every
`--block-sources` and `--block-top-ks`: bits per byte, and the change against dense,
mean and spread (max - min) over the checkpoints.

Speed (a GPU; `--speed-T`, the benchmark shape: B=1, H=32, H_kv=4, K=V=128, bfloat16,
random inputs): each htree configuration's forward and forward+backward (`jax.grad` of
`sum(o * w)`) against cuDNN's, medians after warm-up, in the same call. Block selection
has no kernels yet: its row gives the count instead (`count_speedup`: the larger of its
FLOPs at `--count-tflops` and its gathered bytes at `--count-tbps`, against cuDNN's
measured time at `--speed-T` and `--count-long-T`), as the per-query rows do beside
their measured time.

`--quality-only` / `--speed-only` run one half; `--merge A.json,B.json` joins the rows
of earlier runs (quality and speed from separate device calls) into one table and
picture. Prints one markdown table; writes every row to `--out`; draws `--png`:
x = forward speed-up over cuDNN at `--speed-T` (measured, or counted for block
selection), y = bits-per-byte change at the training length, a line per rule.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from htree_jax import HTreeConfig, htree_attention
from htree_jax.bench import B, H, H_KV, K, V, dense_fn, inputs, median_ms, run_header
from htree_jax.cli import DefaultsHelpFormatter

ROOT = pathlib.Path(__file__).resolve().parents[1]
for folder in (ROOT, ROOT / "examples"):  # run as a script or imported as benchmarks.frontier
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
import train_tiny_lm  # noqa: E402
from benchmarks.text_quality import eval_windows, position_losses  # noqa: E402


DEFAULT_RATE = HTreeConfig().compression_rate


def configurations(top_ks, rules, block_sources, block_top_ks, block_rules,
                   compression_rate: int = DEFAULT_RATE) -> list[dict]:
    """Every configuration a frontier row is made of: dense, then htree per rule and
    `top_k`, then block selection (`selection_block = compression_rate`) per source,
    rule and `top_k`, every htree one with the tree's `compression_rate` (named in the
    configuration's name where it is not the library's default). Each `{name,
    attention, rule, fields}`, `fields` the `HTreeConfig` fields the model is scored with
    (and, timed, the kernels run with)."""
    out = [dict(name="dense", attention="dense", rule="dense", fields={})]
    rate = "" if compression_rate == DEFAULT_RATE else f" r={compression_rate}"
    for rule in rules:
        for k in top_ks:
            out.append(dict(name=f"htree {rule} top_k={k}{rate}", attention="htree", rule=rule + rate,
                            fields=dict(top_k=k, selection=rule, compression_rate=compression_rate, selection_block=1)))
    for source in block_sources:
        for rule in block_rules:
            for k in block_top_ks:
                out.append(dict(name=f"block {source} {rule} top_k={k}{rate}", attention="htree",
                                rule=f"block {source} {rule}{rate}", block=True,
                                fields=dict(top_k=k, selection=rule, block_source=source,
                                            compression_rate=compression_rate, selection_block=compression_rate)))
    return out


def checkpoint_args(directory: str, data: str | None, backend: str):
    """`train_tiny_lm` arguments of a saved model (its shape from the checkpoint)."""
    argv = ["--task", "text", "--init", directory, "--steps", "0", "--backend", backend, "--no-progress"]
    if data:
        argv += ["--data", data]
    return train_tiny_lm.parse_args(argv)


def score(args, params_model, configuration: dict, windows: dict) -> dict:
    """Bits per byte `{T: float}` of the checkpoint's weights under `configuration` on
    `windows` (`{T: (tokens, targets)}`, each `[n, T]`), one window a call."""
    model = train_tiny_lm.build_model(args, attention=configuration["attention"], **configuration["fields"])
    nnx.update(model, nnx.state(params_model, nnx.Param))
    return score_model(model, windows)


def score_model(model, windows: dict) -> dict:
    """Bits per byte `{T: float}` of `model` on `windows` (`{T: (tokens, targets)}`,
    each `[n, T]`), one window a call."""
    out = {}
    for T, (tokens, targets) in windows.items():
        losses = [np.asarray(position_losses(model, jnp.asarray(tokens[i:i + 1]), jnp.asarray(targets[i:i + 1])))
                  for i in range(len(tokens))]
        out[T] = float(np.concatenate(losses).mean() / math.log(2))
    return out


@contextlib.contextmanager
def gpu_reference_chunks(budget: int = 1 << 30):
    """Block selection runs on the JAX reference: on a GPU, with `budget`-byte query
    chunks (`htree_jax.reference.chunk_budget_bytes`) for the time of the block, unless
    the caller set its own."""
    name = "HTREE_REFERENCE_CHUNK_BYTES"
    if jax.default_backend() != "gpu" or name in os.environ:
        yield
        return
    os.environ[name] = str(budget)
    try:
        yield
    finally:
        del os.environ[name]


def quality_rows(a, configs) -> list[dict]:
    """`{checkpoint, config, T, bits}` for every checkpoint, configuration and length."""
    with gpu_reference_chunks():
        return _quality_rows(a, configs)


def _quality_rows(a, configs) -> list[dict]:
    rows = []
    for directory in a.checkpoints:
        args = checkpoint_args(directory, a.data, a.backend)
        corpus = train_tiny_lm.task_of(args)
        trained = train_tiny_lm.checkpoint_flags(directory, flag="--checkpoints")["trained"]
        train_len = int(trained.get("seq_len") or a.eval_lens[0])
        lens = a.eval_lens or [train_len, 4 * train_len]
        windows = {T: eval_windows(corpus, T, a.eval_windows, a.window_seed) for T in lens}
        model = train_tiny_lm.build_model(args, attention="dense")
        train_tiny_lm.load_params(model, directory)
        for configuration in configs:
            tic = time.perf_counter()
            bits = score(args, model, configuration, windows)
            for T, value in bits.items():
                rows.append(dict(kind="quality", checkpoint=directory, seed=trained.get("seed"), train_len=train_len,
                                 config=configuration["name"], rule=configuration["rule"],
                                 top_k=configuration["fields"].get("top_k"),
                                 compression_rate=configuration["fields"].get("compression_rate"), T=T, bits=value,
                                 windows=a.eval_windows))
            print(f"{directory} {configuration['name']}: " + ", ".join(f"T={T} {b:.4f}" for T, b in bits.items())
                  + f" ({time.perf_counter() - tic:.0f} s)", flush=True)
            write(a.out, rows)
    return rows


# ---- speed: measured (kernels) and counted (the floor of a configuration) ----------------


def candidates_per_query(config: HTreeConfig, T: int) -> np.ndarray:
    """`[L, T]`: the candidates query `t` scores on each layer (top first), each
    selecting layer keeping `min(top_k, n)` (SPEC 2.1)."""
    r, L = config.compression_rate, config.num_layers(T)
    t = np.arange(T)
    parents = t // r ** (L - 1) // r + 1
    out = []
    for l in reversed(range(L)):
        n = (parents - 1) * r + (t // r**l) % r + 1
        out.append(n)
        parents = np.minimum(config.top_k, n)
    return np.stack(out)


def counted_ms(config: HTreeConfig, T: int, tflops: float, tbps: float) -> dict:
    """The forward's floor at the benchmark shape: FLOPs (each query head scores and
    merges each candidate, `2K + 2V`; the bound one more `K`; `block_source="previous"`
    ranks with `b` queries' rows, as many products again above layer 0) at `tflops`, and
    gathered bytes (bfloat16 keys and values of each candidate, once per query, or once
    per block with `selection_block = b`; plus q, o) at `tbps`; the larger is the floor."""
    n = candidates_per_query(config, T)  # [L, T]
    per_query = float(n.sum(axis=0).mean())
    above = float(n[:-1].sum(axis=0).mean()) if len(n) > 1 else 0.0
    flops_per_head = per_query * (2 * K + 2 * V) + (above * K if config.ranks_by_bound else 0.0)
    if config.selects_by_block and config.block_source == "previous":
        flops_per_head += above * 2 * K
    flops = B * T * H * flops_per_head
    gathers = per_query / (config.selection_block if config.selects_by_block else 1)
    bytes_ = B * T * H_KV * gathers * (K + V) * 2 + B * T * H * (K + V) * 2
    ms = max(flops / (tflops * 1e12), bytes_ / (tbps * 1e12)) * 1e3
    return dict(candidates=per_query, flops=flops, bytes=bytes_, floor_ms=ms)


def dense_flops(T: int) -> float:
    """Causal dense attention's forward FLOPs at the benchmark shape."""
    return B * H * (T * (T + 1) / 2) * (2 * K + 2 * V)


def grad_of(fn):
    def loss(q, k, v, w):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * w)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def count_row(configuration: dict, dense_ms: dict, a) -> dict:
    """A configuration's counted floor at `--speed-T` and `--count-long-T`, and its
    speed-up over cuDNN's measured forward there (`dense_ms {T: {"forward": ms}}`)."""
    config = HTreeConfig(**configuration["fields"])
    row = dict(kind="speed", config=configuration["name"], rule=configuration["rule"], top_k=config.top_k,
               compression_rate=config.compression_rate)
    for T in (a.speed_T, a.count_long_T):
        counted = counted_ms(config, T, a.count_tflops, a.count_tbps)
        row[f"count_{T}"] = dict(counted, speedup=dense_ms[T]["forward"] / counted["floor_ms"],
                                 flops_ratio=dense_flops(T) / counted["flops"])
    return row


def speed_rows(a, configs) -> list[dict]:
    """Per htree configuration: measured forward and forward+backward ms against cuDNN's
    at `--speed-T` (configurations with kernels), and the counted floor's speed-up at
    `--speed-T` and `--count-long-T` (every configuration)."""
    rows, dense_ms = [], {}
    for T in (a.speed_T, a.count_long_T):
        args = inputs(T)
        dense = dense_fn(HTreeConfig())
        dense_ms[T] = dict(forward=median_ms(dense, args, a.iters))
        if T == a.speed_T:
            w = jnp.ones(args[0].shape[:3] + (V,), jnp.float32)
            dense_ms[T]["backward"] = median_ms(grad_of(dense), (*args, w), a.iters)
        print(f"dense cuDNN T={T}: {dense_ms[T]}", flush=True)
    rows.append(dict(kind="dense_speed", dense_ms=dense_ms, device=jax.devices()[0].device_kind))
    args = inputs(a.speed_T)
    w = jnp.ones(args[0].shape[:3] + (V,), jnp.float32)
    # block selection first: counted only, so a time limit still leaves every count
    for configuration in sorted(configs[1:], key=lambda c: not c.get("block")):
        row = count_row(configuration, dense_ms, a)
        if not configuration.get("block"):
            config = HTreeConfig(**configuration["fields"])
            fwd = jax.jit(lambda q, k, v, c=config: htree_attention(q, k, v, c, backend="pallas"))
            row["forward_ms"] = median_ms(fwd, args, a.iters)
            row["backward_ms"] = median_ms(grad_of(lambda q, k, v, c=config: htree_attention(
                q, k, v, c, backend="pallas")), (*args, w), a.iters)
            row["forward_speedup"] = dense_ms[a.speed_T]["forward"] / row["forward_ms"]
            row["backward_speedup"] = dense_ms[a.speed_T]["backward"] / row["backward_ms"]
        print(row, flush=True)
        rows.append(row)
        write(a.out, rows)
    return rows


def merged(rows: list[dict], configs, a) -> list[dict]:
    """Rows of several runs joined: the first of each (checkpoint, configuration, length)
    kept (a run that scored dense again adds nothing), and a counted row for each
    configuration the speed runs did not reach (from their measured cuDNN times)."""
    seen, out = set(), []
    for r in rows:
        key = (r["kind"], r.get("checkpoint"), r.get("config"), r.get("T"))
        if key not in seen:
            seen.add(key)
            out.append(r)
    dense = next((r for r in out if r["kind"] == "dense_speed"), None)
    if dense is not None:
        dense_ms = {int(T): ms for T, ms in dense["dense_ms"].items()}
        have = {r["config"] for r in out if r["kind"] == "speed"}
        out += [count_row(c, dense_ms, a) for c in configs[1:] if c["name"] not in have]
        # a speed run that timed cuDNN at one length only (`--count-long-T` = `--speed-T`)
        # gets the count at the other from the first run's cuDNN times
        by_name = {c["name"]: c for c in configs[1:]}
        for r in out:
            if r["kind"] == "speed" and f"count_{a.count_long_T}" not in r and r["config"] in by_name:
                counted = count_row(by_name[r["config"]], dense_ms, a)
                r[f"count_{a.count_long_T}"] = counted[f"count_{a.count_long_T}"]
    return out


# ---- the table and the picture -------------------------------------------------------------


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per (training length, configuration): bits per byte at each length
    (mean, spread over the checkpoints trained at that length) and its change against
    dense on the same checkpoints, beside its speed. Models trained at different lengths
    are never averaged together."""
    quality = [r for r in rows if r["kind"] == "quality"]
    speed = {r["config"]: r for r in rows if r["kind"] == "speed"}
    dense = {(r["checkpoint"], r["T"]): r["bits"] for r in quality if r["config"] == "dense"}
    out = []
    for train_len, name in dict.fromkeys((r["train_len"], r["config"]) for r in quality):
        mine = [r for r in quality if r["config"] == name and r["train_len"] == train_len]
        entry = dict(config=name, rule=mine[0]["rule"], top_k=mine[0]["top_k"], train_len=train_len, lengths={})
        for T in sorted({r["T"] for r in mine}):
            at = [r for r in mine if r["T"] == T]
            bits = [r["bits"] for r in at]
            change = [100 * (r["bits"] / dense[(r["checkpoint"], T)] - 1) for r in at if (r["checkpoint"], T) in dense]
            entry["lengths"][T] = dict(bits=statistics.mean(bits), bits_spread=max(bits) - min(bits),
                                       change=statistics.mean(change) if change else None,
                                       change_min=min(change) if change else None,
                                       change_max=max(change) if change else None, seeds=len(at),
                                       train_len=train_len)
        entry["speed"] = speed.get(name)
        out.append(entry)
    # by training length, then rule (in the order first seen), then top_k
    first_seen = {key: i for i, key in enumerate(dict.fromkeys((e["train_len"], e["rule"]) for e in out))}
    return sorted(out, key=lambda e: (e["train_len"], first_seen[(e["train_len"], e["rule"])], e["top_k"] or 0))


def table(summary: list[dict], speed_T: int, long_T: int) -> str:
    """One markdown table: a row per (training length, configuration), the lengths
    scored as multiples of the training length."""
    multiples = sorted({T / e["train_len"] for e in summary for T in e["lengths"]})
    head = ["trained at", "configuration"] + [
        f"bits/byte at {'the training length' if m == 1 else f'{m:g}x it'} (change vs dense, seeds' range)"
        for m in multiples] + [f"forward x cuDNN at {speed_T}", f"fwd+bwd x cuDNN at {speed_T}",
                               f"counted x cuDNN at {speed_T}", f"counted x cuDNN at {long_T}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in summary:
        cells = [str(e["train_len"]), e["config"]]
        by_multiple = {T / e["train_len"]: (T, x) for T, x in e["lengths"].items()}
        for m in multiples:
            T, x = by_multiple.get(m, (None, None))
            if x is None:
                cells.append("")
            elif x["change"] is None or e["config"] == "dense":
                cells.append(f"{x['bits']:.4f} (±{x['bits_spread'] / 2:.4f}, {x['seeds']} seed"
                             f"{'s' if x['seeds'] > 1 else ''}; T={T})")
            else:
                cells.append(f"{x['bits']:.4f} ({x['change']:+.1f}%: {x['change_min']:+.1f}..{x['change_max']:+.1f}, "
                             f"{x['seeds']} seed{'s' if x['seeds'] > 1 else ''})")
        s = e["speed"] or {}
        cells.append(f"{s['forward_speedup']:.2f}x" if "forward_speedup" in s else "-")
        cells.append(f"{s['backward_speedup']:.2f}x" if "backward_speedup" in s else "-")
        for T in (speed_T, long_T):
            c = s.get(f"count_{T}") or s.get(f"count_{str(T)}")
            cells.append(f"{c['speedup']:.2f}x" if c else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(summary: list[dict], png: str, speed_T: int, device: str = "GPU") -> None:
    """x: forward speed-up over cuDNN at `speed_T` (measured; counted for block selection,
    drawn dashed), y: bits-per-byte change at the training length; a line per rule."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    train_lens = sorted({e["train_len"] for e in summary})
    for train_len, rule in dict.fromkeys((e["train_len"], e["rule"]) for e in summary if e["rule"] != "dense"):
        points = []
        for e in (e for e in summary if e["rule"] == rule and e["train_len"] == train_len and e["speed"]):
            at = e["lengths"].get(train_len)
            s = e["speed"]
            x = s.get("forward_speedup") or (s.get(f"count_{speed_T}") or s.get(str(f"count_{speed_T}")))["speedup"]
            if at and at["change"] is not None:
                points.append((x, at["change"], e["top_k"], "forward_speedup" not in s))
        if not points:
            continue
        points.sort()
        counted = [p[3] for p in points]
        note = (" (counted speed: no kernel yet)" if rule.startswith("block") else " (hollow: counted speed, not timed)"
                if any(counted) else "")
        trained = f", trained at {train_len // 1024}K" if len(train_lens) > 1 else ""
        marker = "o" if train_len == train_lens[0] else "s"
        line, = ax.plot([p[0] for p in points], [p[1] for p in points], "--" if all(counted) else "-",
                        marker=marker, label=rule + trained + (note if counted else ""))
        for x, y, k, was_counted in points:
            if was_counted:  # hollow: the count's speed, not a timed one
                ax.plot([x], [y], marker, mfc="white", mec=line.get_color())
            ax.annotate(str(k), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color=line.get_color())
    ax.axhline(0, color="grey", lw=0.8)
    ax.axhline(1, color="grey", lw=0.8, ls=":")
    ax.axvline(1, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks([0.25, 0.5, 1, 2, 4, 8])
    ax.set_xlabel(f"forward speed-up over cuDNN at T={speed_T} ({device}, benchmark shape)")
    ax.set_ylabel("bits per byte vs dense at the training length (%)")
    ax.set_title("htree: quality against speed (labels: top_k)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def write(path, rows) -> None:
    """Writes `rows` to `path` whole or not at all (a run stopped at its time limit
    leaves the rows of the configurations it finished)."""
    if path:
        partial = pathlib.Path(f"{path}.partial")
        partial.write_text(json.dumps(rows, indent=1, default=float))
        os.replace(partial, path)


def parse_args(argv=None):
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter, description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoints", default="", help="comma-separated directories written by train_tiny_lm --save")
    p.add_argument("--data", default=None, help="the corpus, where it is elsewhere than the checkpoint says")
    p.add_argument("--eval-lens", default="", help="lengths scored (default: the training length and 4x it)")
    p.add_argument("--eval-windows", type=int, default=8, help="held-out windows of each length")
    p.add_argument("--window-seed", type=int, default=0, help="the windows' draw (the same for every checkpoint)")
    p.add_argument("--top-ks", default="64,128,256,512")
    p.add_argument("--rules", default="bound,mean")
    p.add_argument("--block-sources", default="first,previous", help="SPEC 12's sources ('' for none)")
    p.add_argument("--block-top-ks", default="64,128,256,512")
    p.add_argument("--block-rules", default="bound")
    p.add_argument("--compression-rate", type=int, default=DEFAULT_RATE,
                   help="the htree configurations' tree (the library's default; a dense checkpoint's own training "
                        "flag for it is not used)")
    p.add_argument("--backend", default="auto", help="htree backend of the per-query configurations")
    p.add_argument("--speed-T", type=int, default=131072, help="T of the measured speeds")
    p.add_argument("--count-long-T", type=int, default=524288, help="a second T for the counted speed-up")
    p.add_argument("--count-tflops", type=float, default=300.0, help="the count's matrix rate")
    p.add_argument("--count-tbps", type=float, default=3.0, help="the count's gather bandwidth, TB/s")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--quality-only", action="store_true")
    p.add_argument("--speed-only", action="store_true")
    p.add_argument("--merge", default="", help="comma-separated JSON files of earlier runs: table and picture only")
    p.add_argument("--out", default=None)
    p.add_argument("--png", default=None)
    a = p.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]
    words = lambda s: [x for x in s.split(",") if x]
    a.eval_lens, a.top_ks, a.block_top_ks = ints(a.eval_lens), ints(a.top_ks), ints(a.block_top_ks)
    a.rules, a.block_sources, a.block_rules = words(a.rules), words(a.block_sources), words(a.block_rules)
    a.checkpoints, a.merge = words(a.checkpoints), words(a.merge)
    if not a.merge and not a.speed_only and not a.checkpoints:
        p.error("--checkpoints: give the saved models to score (or --speed-only, or --merge)")
    if a.eval_windows < 1:
        p.error("--eval-windows must be >= 1")
    return a


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    configs = configurations(a.top_ks, a.rules, a.block_sources, a.block_top_ks, a.block_rules, a.compression_rate)
    if a.merge:
        rows = merged([r for path in a.merge for r in json.loads(pathlib.Path(path).read_text())], configs, a)
        write(a.out, rows)
    else:
        print(run_header("benchmarks/frontier.py", argv), flush=True)
        rows = []
        if not a.speed_only:
            rows += quality_rows(a, configs)
        if not a.quality_only:
            speed = speed_rows(a, configs)
            rows += speed
        write(a.out, rows)
    summary = summarize(rows)
    print(table(summary, a.speed_T, a.count_long_T), flush=True)
    if a.png:
        device = next((r.get("device", "GPU") for r in rows if r["kind"] == "dense_speed"), "GPU")
        plot(summary, a.png, a.speed_T, device)
    return rows


if __name__ == "__main__":
    main()
