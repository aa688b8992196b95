"""Every launch of a whole backward call, named and timed (GPU; issue 103's account): the
default's backward alone (`jax.vjp`'s function of `htree_attention`, its residuals made by
a forward outside the timed call), under a profiler trace, each launch attributed to the
code that made it, summed against the call's measured wall time.

    python -m benchmarks.profile --pass account [--shapes 32/4,32/8] [--sizes 131072,524288]
        [--inputs random] [--iters 5] [--steps 3] [--json out.json]

For each shape (`H/H_kv`, K=V=128, bf16, B=1) and size: the call's median wall ms
(`median_ms`), then the launches of `--steps` traced calls: each kernel's us a call and
launches a call, grouped by where it comes from (a Pallas kernel by its name; an XLA
kernel by the library function whose source line the compiled HLO gives it, e.g.
`pallas_kernels/block/backward.py:block_backward_pallas`, or where the HLO keeps no source
lines by its op path, e.g. `transpose(jvp(jit(attend)))/while/body/dynamic_slice`); then the device's busy time,
its span from the first launch to the last (busy + idle gaps between launches) and the
host's share (wall - span). The account closes when busy + gaps is within 5% of the
wall time (`closes` in the JSON); a call whose time is in launches and gaps shows it
there, not in a kernel.
"""

from __future__ import annotations

import argparse
import ast
import collections
import functools
import json
import pathlib
import sys

import jax

from htree_jax import HTreeConfig, htree_attention
from htree_jax.bench import INPUTS, head_shapes, int_list, median_ms, run_header
from htree_jax.cli import DefaultsHelpFormatter
from htree_jax.kernel_trace import busy_span, hlo_sources, kernel_events, kernel_times

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLOSES = 0.05  # the account closes when busy + gaps is within this fraction of the wall time


@functools.lru_cache(maxsize=None)
def functions_of(path: str) -> list[tuple[int, int, str]]:
    """`[(first line, last line, qualified name)]` of every function in the file `path`."""
    try:
        tree = ast.parse(pathlib.Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return []
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    found.append((child.lineno, child.end_lineno, name))
                visit(child, name + ".")
            else:
                visit(child, prefix)
    visit(tree, "")
    return found


def where(source: str) -> str:
    """`"file:line"` (HLO metadata) -> `"<path in this repository>:<innermost function>"` for this
    repository's files; `"jax (file)"` for JAX's own; `""` where there is no source."""
    file, _, line = source.rpartition(":")
    if not file or not line.isdigit():
        return ""
    path = pathlib.Path(file)
    try:
        relative = path.resolve().relative_to(ROOT)
    except ValueError:
        return f"jax ({path.name})" if "jax" in file else path.name
    inside = [(hi - lo, name) for lo, hi, name in functions_of(str(path.resolve())) if lo <= int(line) <= hi]
    return f"{relative}:{min(inside)[1]}" if inside else f"{relative}:{line}"


def op_path(op_name: str, depth: int = 4) -> str:
    """An HLO `op_name` without its outermost `jit(...)` and digits, its last `depth`
    scopes: `"transpose(jvp(jit(attend)))/while/body/dynamic_slice"`; within one of the
    library's named scopes (`jax.named_scope("htree_walk")`, ...), that scope and the
    operation: `"htree_sums: add"`."""
    parts = [p for p in op_name.split("/") if p][1:] or [op_name]
    ours = [i for i, p in enumerate(parts) if p.startswith("htree_")]  # the library's named scopes
    if ours:
        return f"{parts[ours[-1]]}: {parts[-1]}".translate(str.maketrans("", "", "0123456789"))
    return "/".join(parts[-depth:]).translate(str.maketrans("", "", "0123456789"))


def attribute(times: dict, sources: dict) -> dict:
    """`{origin: [us a call, launches a call, {kernel: us}]}` of `kernel_times`' `times`:
    an XLA kernel (a name the HLO has) by the code its metadata names (the source line's
    function where the HLO keeps source lines, else its op path), anything else (a Pallas
    or library kernel) by its own name."""
    groups = collections.defaultdict(lambda: [0.0, 0.0, {}])
    for name, (us, n) in times.items():
        shape, op, source = sources.get(name, ("", "", ""))
        origin = (f"XLA {where(source) or op_path(op) or 'no source'}" if name in sources
                  else f"kernel {name}")
        group = groups[origin]
        group[0] += us
        group[1] += n
        group[2][name] = us
    return dict(groups)


def account(fn, args, iters: int, steps: int) -> dict:
    """The wall time of `fn(*args)` (jitted), its launches attributed, busy, span."""
    wall = median_ms(fn, args, iters)
    events = kernel_events(lambda: fn(*args), steps)
    times = kernel_times(None, steps, events=events)
    busy, span = busy_span(events, steps)
    groups = attribute(times, hlo_sources(fn.lower(*args).compile().as_text()))
    launches = sum(n for _, n in times.values())
    return dict(wall_ms=wall, busy_ms=busy / 1e3, span_ms=span / 1e3, launches=launches,
                kernels_ms=sum(t for t, _ in times.values()) / 1e3,
                closes=bool(events) and abs(span / 1e3 - wall) <= CLOSES * wall,
                groups={k: dict(ms=v[0] / 1e3, launches=v[1], kernels={n: t / 1e3 for n, t in v[2].items()})
                        for k, v in sorted(groups.items(), key=lambda kv: -kv[1][0])})


def backward_call(config: HTreeConfig, q, k, v, backend: str):
    """`(jitted fn, args)`: the backward alone of `htree_attention(q, k, v, config)`, its
    residuals from a forward run here (outside the timed call); a bfloat16 cotangent."""
    forward = lambda q, k, v: htree_attention(q, k, v, config, backend=backend)
    o, vjp = jax.vjp(forward, q, k, v)
    do = jax.random.normal(jax.random.key(7), o.shape, o.dtype)
    return jax.jit(lambda vjp, do: vjp(do)), (vjp, do)


def print_account(label: str, row: dict, top: int = 30) -> None:
    print(f"== {label}: wall {row['wall_ms']:.1f} ms; device busy {row['busy_ms']:.1f}, span {row['span_ms']:.1f} "
          f"(gaps {row['span_ms'] - row['busy_ms']:.1f}), host {row['wall_ms'] - row['span_ms']:.1f}; "
          f"{row['launches']:.0f} launches; account {'closes' if row['closes'] else 'does NOT close'} "
          f"(span within {CLOSES:.0%} of wall)", flush=True)
    for origin, group in list(row["groups"].items())[:top]:
        names = sorted(group["kernels"].items(), key=lambda x: -x[1])
        detail = ", ".join(f"{n[:48]} {t:.2f}" for n, t in names[:3]) + (" ..." if len(names) > 3 else "")
        print(f"{group['ms']:9.2f} ms  x{group['launches']:5.1f}  {origin[:90]}  [{detail}]", flush=True)
    rest = list(row["groups"].values())[top:]
    if rest:
        print(f"{sum(g['ms'] for g in rest):9.2f} ms  x{sum(g['launches'] for g in rest):5.1f}  "
              f"({len(rest)} more origins)", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter, description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="32/4,32/8", help="H/H_kv pairs")
    p.add_argument("--sizes", default="131072,524288", help="sequence lengths T")
    p.add_argument("--inputs", default="random", choices=sorted(INPUTS))
    p.add_argument("--iters", type=int, default=5, help="median_ms samples")
    p.add_argument("--steps", type=int, default=3, help="traced calls")
    p.add_argument("--backend", default="auto")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    shapes = head_shapes(args.shapes)
    print(run_header("benchmarks/profile.py --pass account", argv), flush=True)
    rows = []
    for H, H_kv in shapes:
        for T in int_list(args.sizes):
            q, k, v = INPUTS[args.inputs](T, heads=(H, H_kv))
            fn, call = backward_call(HTreeConfig(), q, k, v, args.backend)
            row = dict(H=H, H_kv=H_kv, T=T, inputs=args.inputs, device=jax.devices()[0].device_kind,
                       jax=jax.__version__, **account(fn, call, args.iters, args.steps))
            print_account(f"backward H={H} H_kv={H_kv} T={T} {args.inputs}", row)
            rows.append(row)
            del q, k, v, fn, call
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
