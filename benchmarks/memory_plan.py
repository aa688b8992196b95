"""What XLA plans to keep in device memory for htree's forward and forward+backward (GPU).

    python benchmarks/memory_plan.py --T 1048576 --top-k 64
    python benchmarks/memory_plan.py --shape mla --T 32768,131072,262144 --passes forward,fwd+bwd

Compiles (does not run) `htree_attention(..., backend="pallas")` and its vjp with a
bfloat16 cotangent (`htree_jax.memory_plan`), and prints for each length and pass
XLA's planned peak beside the bytes of the inputs and the output (the cotangent and the
gradients too for fwd+bwd), then for the last compile the values live at its peak
(XLA's heap simulation, from its `live-range` dump) with their shapes and the JAX
operations they come from, and XLA's breakdown of that peak by call stack.
`--devices n`: T sharded over n devices (context parallelism), the plan one device's.
`--shape mla`: the latent-attention shape (`htree_jax.bench.MLA`), values their own
(`--values own`) or the keys' latent features (`keys`).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tempfile


def hlo_values(hlo_text: str) -> dict:
    """`{instruction name: (shape, op_name)}` of an optimized HLO module's text."""
    out = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+|\([^=]*?\)) [^\n]*?(?:op_name=\"([^\"]*)\")?[^\n]*$",
                         hlo_text, re.M):
        out.setdefault(m.group(1), (m.group(2)[:60], m.group(3) or ""))
    return out


def print_peak(live_range_file: str, largest: int) -> None:
    """The values live at the peak of XLA's heap simulation (its `live-range` dump), the
    largest first, each with its shape and the JAX operation it comes from."""
    text = open(live_range_file).read()
    peak = re.search(r"Live ranges at \d+ \(peak\):\n((?:    \S+: \d+ bytes.*\n)+)", text)
    if not peak:
        print(f"no peak in {os.path.basename(live_range_file)}")
        return
    hlo_file = live_range_file.replace("-live-range.txt", ".txt")
    values = hlo_values(open(hlo_file).read()) if os.path.exists(hlo_file) else {}
    rows = re.findall(r"    (\S+?)(\{[\d,]*\})?: (\d+) bytes", peak.group(1))
    total = sum(int(size) for *_, size in rows)
    print(f"values live at the peak ({len(rows)}, {total / 2**30:.2f} GiB; {os.path.basename(live_range_file)}):")
    for name, index, size in sorted(rows, key=lambda row: -int(row[2]))[:largest]:
        shape, op = values.get(name, ("?", ""))
        print(f"  {int(size) / 2**30:7.3f} GiB  {name}{index}  {shape}  {op[-110:]}")
    # XLA's breakdown of the peak by the JAX call stack that made each value: the
    # entries of at least 1% of it.
    breakdown = text[text.find("Stack trace breakdown for peak"):].splitlines()
    for line in breakdown[:1] + [x for x in breakdown[1:] if (m := re.search(r"\((\d+\.\d)%", x))
                                 and float(m.group(1)) >= 1.0]:
        print("  " + line.strip()[:240])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--T", default="1048576", help="sequence lengths, comma-separated")
    p.add_argument("--top-k", type=int, default=64, help="HTreeConfig.top_k")
    p.add_argument("--shape", choices=["gqa", "mla"], default="gqa", help="the benchmark shape or the latent one")
    p.add_argument("--values", choices=["own", "keys"], default="own", help="with --shape mla: v given or read from k")
    p.add_argument("--passes", default="fwd+bwd", help="forward, fwd+bwd, or both comma-separated")
    p.add_argument("--backend", default="pallas", help="pallas (GPU), or pallas_interpret for a CPU smoke test")
    p.add_argument("--largest", type=int, default=25, help="values live at the last compile's peak to list")
    p.add_argument("--devices", type=int, default=1, help="T sharded over this many devices (context parallelism): "
                   "the plan is one device's")
    args = p.parse_args(argv)
    dump = tempfile.mkdtemp()
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_pass_re=^$"
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from htree_jax import HTreeConfig, memory_plan
    from htree_jax.bench import B, H, H_KV, K, MLA, V

    if args.shape == "mla":
        b, h, h_kv, k_dim, v_dim = MLA["B"], MLA["H"], MLA["H_kv"], MLA["K"], MLA["V"]
        config = HTreeConfig(top_k=args.top_k, rope_dim=MLA["rope_dim"], selection_block=1)
    else:
        b, h, h_kv, k_dim, v_dim = B, H, H_KV, K, V
        config = HTreeConfig(top_k=args.top_k, selection_block=1)
    from_keys = args.shape == "mla" and args.values == "keys"
    gib = lambda x: x / 2**30
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}: {args.shape} B={b} H={h} H_kv={h_kv} K={k_dim} "
          f"V={v_dim} bf16, top_k={args.top_k}, values {'read from the keys' if from_keys else 'their own'}")
    print("| T | pass | planned peak GiB | arguments | outputs | temporaries | inputs+output GiB | "
          "peak / (inputs+output) |")
    print("|---|---|---|---|---|---|---|---|")
    along_t = None
    if args.devices > 1:
        mesh = jax.make_mesh((args.devices,), ("seq",), axis_types=(AxisType.Auto,),
                             devices=jax.devices()[:args.devices])
        along_t = NamedSharding(mesh, P(None, "seq", None, None))
    for T in [int(x) for x in args.T.split(",")]:
        q, k = (jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=along_t)
                for s in [(b, T, h, k_dim), (b, T, h_kv, k_dim)])
        v = None if from_keys else jax.ShapeDtypeStruct((b, T, h_kv, v_dim), jnp.bfloat16, sharding=along_t)
        # (one device's share of them with --devices)
        data = 2 * (q.size + k.size + (0 if v is None else v.size) + b * T * h * v_dim) // args.devices
        for name in args.passes.split(","):
            gradients = name == "fwd+bwd"
            plan = memory_plan(q, k, v, config, gradients=gradients, backend=args.backend,
                               value_dim=v_dim if from_keys else None)
            # fwd+bwd: the cotangent in, the gradients of q, k (and v) out as well.
            total = data + (data if gradients else 0)
            print(f"| {T} | {name} | {gib(plan.peak):.2f} | {gib(plan.arguments):.2f} | {gib(plan.outputs):.2f} | "
                  f"{gib(plan.temporaries):.2f} | {gib(total):.2f} | {plan.peak / total:.3f} |", flush=True)
    files = [f for f in glob.glob(f"{dump}/*after_optimizations-live-range.txt") if "jit__lambda" in f or "jit_" in f]
    if files and args.largest:
        print_peak(max(files, key=os.path.getmtime), args.largest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
