"""What XLA plans to keep in device memory for one htree forward+backward (GPU).

    python benchmarks/memory_plan.py --T 1048576 --top-k 64

Compiles (does not run) the vjp of `htree_attention(..., backend="pallas")` with a
bfloat16 cotangent argument, as `bench_backward.py --cotangent bf16` times it, and
prints XLA's planned argument / output / temporary bytes and the largest values in the
temporary allocation (from the buffer assignment XLA dumps), so the peak can be counted.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tempfile


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--T", type=int, default=1048576)
    p.add_argument("--top-k", type=int, default=64)
    p.add_argument("--largest", type=int, default=25)
    args = p.parse_args(argv)
    dump = tempfile.mkdtemp()
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_pass_re=^$"
    import jax
    import jax.numpy as jnp

    from htree_jax import HTreeConfig, htree_attention
    from htree_jax.bench import B, H, H_KV, K, V

    config = HTreeConfig(top_k=args.top_k)
    forward = lambda q, k, v: htree_attention(q, k, v, config, backend="pallas")
    step = jax.jit(lambda q, k, v, do: jax.vjp(forward, q, k, v)[1](do))
    shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in
              [(B, args.T, H, K), (B, args.T, H_KV, K), (B, args.T, H_KV, V), (B, args.T, H, V)]]
    m = step.lower(*shapes).compile().memory_analysis()
    gib = lambda x: x / 2**30
    print(f"# {jax.devices()[0].device_kind}: T={args.T} top_k={args.top_k} B={B} H={H} H_kv={H_KV} K=V={K} bf16, "
          f"vjp with a bf16 cotangent")
    print(f"planned: arguments {gib(m.argument_size_in_bytes):.2f} GiB, outputs {gib(m.output_size_in_bytes):.2f}, "
          f"temporaries {gib(m.temp_size_in_bytes):.2f}, aliased {gib(m.alias_size_in_bytes):.2f}")
    files = [f for f in glob.glob(f"{dump}/*buffer-assignment.txt") if "jit__lambda" in f or "jit_" in f]
    text = max(files, key=os.path.getsize) if files else ""
    if text:
        values = re.findall(r"value: <\d+ ([^ >]+)[^>]*> \(size=(\d+),offset=(\d+)\): (\S+)", open(text).read())
        seen = {}
        for name, size, offset, shape in values:
            seen.setdefault((int(offset), int(size)), []).append(f"{name} {shape}")
        print(f"largest of {len(values)} values in the buffer assignment ({os.path.basename(text)}):")
        for (offset, size), names in sorted(seen.items(), key=lambda kv: -kv[0][1])[: args.largest]:
            print(f"  {gib(size):7.2f} GiB at {offset / 2**30:7.2f}: {'; '.join(names[:3])}"
                  f"{' ...' if len(names) > 3 else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
