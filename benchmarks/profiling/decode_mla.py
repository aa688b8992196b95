"""The MLA decode step (H=128 over one kv head, K=576 with rope_dim=64, V=512, bf16,
T=131072, top_k=64) under `DecodeBlockSizes` variants: per-step ms as `bench_decode.py`
times it, then each kernel's device time (`kernel_trace`), and for the first variant
the sources of the largest XLA fusions.

    python -m benchmarks.profile --pass decode --shape mla --batch 64 --variants "" "wide_target_programs=512" "span=32"
                                                           [--values-from-keys]

A variant is `DecodeBlockSizes` keyword arguments (`""`: the defaults)."""

from __future__ import annotations

import argparse
import re

import jax

from benchmarks.bench_decode import DTYPE, MLA_DIMS, filled_cache, per_step_ms, start_lengths
from htree_jax import DecodeBlockSizes, HTreeConfig, decode_step
from htree_jax.cli import DefaultsHelpFormatter
from htree_jax.kernel_trace import kernel_times, print_kernel_times


def fusion_sources(compiled_text: str, times: dict, top: int = 4) -> None:
    """The shapes and source ops of the `top` slowest XLA fusions."""
    fusions = sorted(((t, name) for name, (t, _) in times.items() if "fusion" in name), reverse=True)[:top]
    for t, name in fusions:
        hlo = re.sub(r"_(\d+)$", r".\1", name)  # the trace writes HLO's `fusion.1` as `fusion_1`
        for line in compiled_text.splitlines():
            if re.match(rf"\s*(ROOT )?%({re.escape(name)}|{re.escape(hlo)}) = ", line):
                shape = line.split("=", 1)[1].split("fusion(")[0].strip()
                op = re.search(r'op_name="([^"]*)"', line)
                print(f"  {name} ({t:.1f} us): {shape[:100]} {op.group(1)[-120:] if op else ''}", flush=True)
                break


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--variants", nargs="*", default=[""])
    p.add_argument("--values-from-keys", action="store_true",
                   help="a cache of keys only (`init_cache(..., values_from_keys=True)`), v_t=None")
    args = p.parse_args(argv)
    d, ctx = MLA_DIMS, args.context
    config = HTreeConfig(top_k=64, rope_dim=64)
    variants = [eval(f"dict({v})") for v in args.variants]  # noqa: S307 - a command-line tuning knob
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}: MLA decode, B={args.batch}, T={ctx}"
          f"{', keys only' if args.values_from_keys else ''}", flush=True)
    cache = filled_cache(args.batch, ctx, config, start_lengths(args.batch, ctx, 20, 3 + 2 * len(variants), False),
                         d["H_kv"], d["K"], d["V"], args.values_from_keys)
    q_t = jax.random.normal(jax.random.key(2), (args.batch, d["H"], d["K"]), DTYPE)
    k_t = jax.random.normal(jax.random.key(3), (args.batch, d["H_kv"], d["K"]), DTYPE)
    v_t = None if args.values_from_keys else jax.random.normal(jax.random.key(4), (args.batch, d["H_kv"], d["V"]), DTYPE)
    for i, kwargs in enumerate(variants):
        block_sizes = DecodeBlockSizes(**kwargs)
        fn = jax.jit(lambda c, bs=block_sizes: decode_step(q_t, k_t, v_t, c, config, backend="pallas", block_sizes=bs),
                     donate_argnums=0)
        try:
            ms, cache = per_step_ms(lambda j, c: fn(c)[1], cache, 20, 3)
        except Exception as e:  # noqa: BLE001 - e.g. a variant that overflows shared memory: reported, next
            print(f"### {kwargs}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        print(f"### {kwargs}: {ms * 1e3:.1f} us per step", flush=True)
        box = [cache]

        def step():
            o, box[0] = fn(box[0])
            return o
        times = kernel_times(step, 3)
        cache = box[0]
        print_kernel_times(times, str(kwargs))
        if i == 0:
            fusion_sources(fn.lower(cache).compile().as_text(), times)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
