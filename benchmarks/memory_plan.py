"""What XLA plans to keep in device memory for htree's forward and forward+backward (GPU).

    python benchmarks/memory_plan.py --T 1048576 --top-k 64
    python benchmarks/memory_plan.py --shape mla --T 32768,131072,262144 --passes forward,fwd+bwd

Compiles (does not run) `htree_attention(..., backend="pallas")` and its vjp with a
bfloat16 cotangent (`htree_jax.memory_plan`), and prints for each length and pass
XLA's planned peak beside the bytes of the inputs and the output (the cotangent and the
gradients too for fwd+bwd), then for the last compile the largest values in the
temporary allocation (from the buffer assignment XLA dumps), so the peak can be counted.
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", default="1048576", help="sequence lengths, comma-separated")
    p.add_argument("--top-k", type=int, default=64, help="HTreeConfig.top_k")
    p.add_argument("--shape", choices=["gqa", "mla"], default="gqa", help="the benchmark shape or the latent one")
    p.add_argument("--values", choices=["own", "keys"], default="own", help="with --shape mla: v given or read from k")
    p.add_argument("--passes", default="fwd+bwd", help="forward, fwd+bwd, or both comma-separated")
    p.add_argument("--backend", default="pallas", help="pallas (GPU), or pallas_interpret for a CPU smoke test")
    p.add_argument("--largest", type=int, default=25, help="values of the last compile's buffer assignment to list")
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
        config = HTreeConfig(top_k=args.top_k, rope_dim=MLA["rope_dim"])
    else:
        b, h, h_kv, k_dim, v_dim = B, H, H_KV, K, V
        config = HTreeConfig(top_k=args.top_k)
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
    files = [f for f in glob.glob(f"{dump}/*buffer-assignment.txt") if "jit__lambda" in f or "jit_" in f]
    text = max(files, key=os.path.getmtime) if files and args.largest else ""
    if text:
        values = re.findall(r"value: <\d+ ([^ >]+)[^>]*> \(size=(\d+),offset=(\d+)\): (\S+)", open(text).read())
        seen = {}
        for name, size, offset, shape in values:
            seen.setdefault((int(offset), int(size)), []).append(f"{name} {shape}")
        print(f"largest of {len(values)} values in the last buffer assignment ({os.path.basename(text)}):")
        for (offset, size), names in sorted(seen.items(), key=lambda kv: -kv[0][1])[: args.largest]:
            print(f"  {gib(size):7.2f} GiB at {offset / 2**30:7.2f}: {'; '.join(names[:3])}"
                  f"{' ...' if len(names) > 3 else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
