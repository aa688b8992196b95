"""Block-size sweep of the Pallas forward on the GPU (one T, one config, one input kind).

    python benchmarks/sweep_forward.py --T 524288 --top-k 64 --selection bound \\
        --inputs correlated --variants "num_warps=4;tile=128;min_query_rows=16,num_warps=4"

Times the default `BlockSizes` and each variant (`;`-separated, each a `,`-separated
list of `field=int` of `BlockSizes`) end to end, in one process, dense cuDNN in the same
run; `--kernels` adds each kernel's device time inside the default call.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax

from htree_jax import HTreeConfig
from htree_jax.backends import kernel_route
from htree_jax.bench import INPUTS, dense_fn, median_ms
from htree_jax.cli import DefaultsHelpFormatter
from htree_jax.kernel_trace import kernel_times, print_kernel_times
from pallas_kernels.shared.configs import KernelConfigs


def parse_variants(spec: str) -> list[dict]:
    """`"top.rows=64,layer.span=32;chunk_budget_bytes=3"` -> `[{"top.rows": 64, ...}, ...]`,
    every name `family.field` of `pallas_kernels.shared.configs.KernelConfigs` (or one of its own
    fields)."""
    fields = {f"{family.name}.{f.name}" for family in dataclasses.fields(KernelConfigs)
              if dataclasses.is_dataclass(family.default) for f in dataclasses.fields(family.default)}
    fields |= {f.name for f in dataclasses.fields(KernelConfigs) if not dataclasses.is_dataclass(f.default)}
    out = []
    for item in [x for x in spec.split(";") if x.strip()]:
        change = {}
        for pair in item.split(","):
            name, value = (s.strip() for s in pair.split("="))
            if name not in fields:
                raise SystemExit(f"--variants: {name!r} is not a KernelConfigs field ({', '.join(sorted(fields))})")
            change[name] = int(value)
        out.append(change)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter, description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, default=131072, help="sequence length")
    p.add_argument("--top-k", type=int, default=64, help="HTreeConfig.top_k")
    p.add_argument("--selection", default="bound", help="HTreeConfig.selection (mean or bound)")
    p.add_argument("--inputs", default="correlated", choices=sorted(INPUTS), help="input kind (htree_jax.bench)")
    p.add_argument("--variants", default="", help="KernelConfigs changes: 'family.field=int,...;...'")
    p.add_argument("--iters", type=int, default=3, help="timed calls per setting after one warm-up (median)")
    p.add_argument("--kernels", action="store_true", help="each kernel's device time inside each call")
    args = p.parse_args(argv)
    config = HTreeConfig(top_k=args.top_k, selection=args.selection, selection_block=1)
    x = INPUTS[args.inputs](args.T)
    dense = median_ms(dense_fn(config), x, args.iters)
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}: T={args.T} top_k={args.top_k} "
          f"selection={args.selection} {args.inputs} layers={config.layer_sizes(args.T)} "
          f"dense cuDNN {dense:.2f} ms", flush=True)
    print("| block sizes | htree ms | dense/htree |\n|---|---|---|", flush=True)
    for change in [{}] + parse_variants(args.variants):
        bs = KernelConfigs.resolve(None, x[0].shape[-1], x[2].shape[-1]).with_changes(change)
        forward = kernel_route(*x, config, bs).forward
        f = jax.jit(lambda q, k, v, bs=bs, forward=forward: forward(q, k, v, config=config, block_sizes=bs)[0])
        label = ", ".join(f"{k}={v}" for k, v in change.items()) or "default"
        try:
            ms = median_ms(f, x, args.iters)
            print(f"| {label} | {ms:.1f} | {dense / ms:.4f} |", flush=True)
        except Exception as e:  # noqa: BLE001 - a setting that does not compile is a row too
            print(f"| {label} | {type(e).__name__}: {str(e)[:120]} | |", flush=True)
        if args.kernels:
            print_kernel_times(kernel_times(lambda: f(*x), 2), f"{label}: the call's kernels", top=8)


if __name__ == "__main__":
    main()
