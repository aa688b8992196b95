"""GPU: the shared memory each Pallas-Triton kernel takes, as the compiler reports it.

    XLA_FLAGS=--xla_dump_to=/tmp/smem python benchmarks/probe_shared_memory.py --out smem.json

Compiles (and runs once) the forward+backward and a decode step of each case and reads
every kernel's `shared_memory: N bytes` from XLA's thunk-sequence dump; a compile that
overflows reports `requested N` in its error instead. Writes one JSON row per case
(the case, the status, `{kernel: bytes}`), the data `pallas_kernels/shared_memory.py`
is checked against (`tests/test_shared_memory.py`).
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from htree_jax import BlockSizes, HTreeConfig, decode_step, htree_attention, init_cache, prefill
from pallas_kernels.shared_memory import LIMIT

DUMP = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))
KERNEL = re.compile(r"kCustomKernel \[[^\]]*\] (\S+) grid: .*shared_memory: (\d+) bytes")


def dumped_kernels(seen: set, directory: str | None = None) -> dict:
    """{Pallas kernel name: shared bytes} from thunk sequences dumped (in `directory`,
    default XLA_FLAGS' `--xla_dump_to`) since `seen`."""
    out = {}
    directory = directory or (DUMP.group(1) if DUMP else None)
    if not directory:
        return out
    for path in glob.glob(os.path.join(directory, "*thunk_sequence.txt")):
        if path in seen:
            continue
        seen.add(path)
        for name, b in KERNEL.findall(open(path, errors="ignore").read()):
            if "_kernel" in name:
                name = re.sub(r"__\d+$", "", name)
                out[name] = max(out.get(name, 0), int(b))
    return out


def attempt(fn, seen):
    t0 = time.perf_counter()
    try:
        jax.block_until_ready(fn())
        status = "ok"
    except Exception as e:  # noqa: BLE001 - the error is the measurement
        m = re.search(r"requested (\d+)", str(e))
        text = str(e)
        if m:
            i = text.find("requested")
            status = f"requested {m.group(1)} :: " + " ".join(text[max(0, i - 2500): i + 60].split())
        else:
            status = f"error {type(e).__name__}: {text[:300]}"
    return status, dumped_kernels(seen), round(time.perf_counter() - t0, 1)


def grid(only_failing=False, only_open=False):
    """The probe's cases; `only_failing`: those that overflowed at `c9ea24a`, and the
    latent-attention shapes; `only_open`: those that still overflowed at `70d29d0` (the
    float32 backward at K = 192 and 256, latent attention's decode step with the bound)
    and packed latent attention (virtual heads of 16) with each rule."""
    if only_open:
        for sel in ("mean", "bound"):
            yield dict(G=16, K=192, V=192, rope=64, dtype="float32", sel=sel, top_k=8, T=4096)
            yield dict(G=8, K=256, V=256, rope=None, dtype="float32", sel=sel, top_k=8, T=4096)
        for G in (32, 128):
            yield dict(G=G, K=576, V=512, rope=64, dtype="bfloat16", sel="bound", top_k=8, T=4096)
        for sel in ("mean", "bound"):
            yield dict(G=64, K=576, V=512, rope=64, dtype="bfloat16", sel=sel, top_k=8, T=4096, packed=True)
        return
    if only_failing:
        for G, K, V, rope, dtype, sel in [(8, 128, 128, None, "bfloat16", "bound"), (8, 96, 96, 32, "bfloat16", "bound"),
                                          (8, 192, 128, None, "bfloat16", "bound"), (8, 192, 128, None, "float32", "bound"),
                                          (16, 192, 192, 64, "float32", "mean"), (8, 256, 256, None, "float32", "mean")]:
            yield dict(G=G, K=K, V=V, rope=rope, dtype=dtype, sel=sel, top_k=8, T=4096)
        for G in (32, 128):
            for sel in ("mean", "bound"):
                yield dict(G=G, K=576, V=512, rope=64, dtype="bfloat16", sel=sel, top_k=8, T=4096)
        yield dict(G=64, K=576, V=512, rope=64, dtype="float32", sel="bound", top_k=8, T=4096)
        return
    gqa = [(1, 32, 32, None), (4, 64, 64, None), (8, 96, 96, 32), (8, 128, 128, None), (16, 128, 128, None),
           (8, 192, 128, None), (16, 192, 192, 64), (8, 256, 256, None), (2, 256, 64, None)]
    for G, K, V, rope in gqa:
        for dtype in ("bfloat16", "float32"):
            for sel in ("mean", "bound"):
                yield dict(G=G, K=K, V=V, rope=rope, dtype=dtype, sel=sel, top_k=8, T=4096)
    for G in (32, 128):
        for sel in ("mean", "bound"):
            yield dict(G=G, K=576, V=512, rope=64, dtype="bfloat16", sel=sel, top_k=8, T=4096)
    for sel in ("mean", "bound"):  # the benchmark shape's two-layer tree
        yield dict(G=8, K=128, V=128, rope=None, dtype="bfloat16", sel=sel, top_k=64, T=8192)
        yield dict(G=8, K=128, V=128, rope=None, dtype="float16", sel=sel, top_k=512, T=16384)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--failing", action="store_true", help="only the cases that overflowed, forward and backward apart")
    ap.add_argument("--open", action="store_true", help="only the cases still open at 70d29d0, and packed latent")
    ap.add_argument("--case", default=None, help='one case as JSON, e.g. {"G": 8, "K": 256, "V": 256, "rope": null, '
                    '"dtype": "float32", "sel": "mean", "top_k": 8, "T": 4096}')
    ap.add_argument("--try", dest="tries", default=None,
                    help="with --case: a JSON list of BlockSizes overrides, each compiled alone (which kernel overflows)")
    ap.add_argument("--keys-tile", type=int, default=None, help="BlockSizes.top_keys_tile for every case")
    ap.add_argument("--keys-stages", type=int, default=None, help="BlockSizes.top_keys_stages for every case")
    args = ap.parse_args()
    seen = set()
    dumped_kernels(seen)
    rng = np.random.default_rng(0)
    overrides = {k: v for k, v in (("top_keys_tile", args.keys_tile), ("top_keys_stages", args.keys_stages)) if v}
    out = open(args.out, "w") if args.out else None
    cases = grid(args.failing, args.open)
    if args.case:
        tries = json.loads(args.tries) if args.tries else [{}]
        cases = [dict(json.loads(args.case), overrides=t) for t in tries]
    for c in cases:
        config = HTreeConfig(top_k=c["top_k"], selection=c["sel"], rope_dim=c["rope"])
        H_kv = 1 if c["G"] > 16 else 2
        H, T, dtype = c["G"] * H_kv, c["T"], jnp.dtype(c["dtype"])
        q, k, v = (jnp.asarray(rng.standard_normal((1, T, h, d)), dtype)
                   for h, d in ((H, c["K"]), (H_kv, c["K"]), (H_kv, c["V"])))
        bs = BlockSizes.for_dims(c["K"], c["V"])
        if overrides or c.get("overrides"):
            bs = dataclasses.replace(bs, **overrides, **c.get("overrides", {}))
        # Packed: two documents (SPEC 6), each its own tree.
        packed = (dict(segment_ids=jnp.asarray(np.arange(T) >= T // 3, jnp.int32)[None], max_documents=2)
                  if c.get("packed") else {})
        loss = lambda q, k, v: jnp.sum(htree_attention(q, k, v, config, backend="pallas", block_sizes=bs,
                                                       **packed).astype(jnp.float32))
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        row = dict(c, H_kv=H_kv)
        fwd = jax.jit(lambda q, k, v: htree_attention(q, k, v, config, backend="pallas", block_sizes=bs, **packed))
        row["forward"], row["forward_kernels"], row["forward_s"] = attempt(lambda: fwd(q, k, v), seen)
        row["train"], row["train_kernels"], row["train_s"] = attempt(lambda: grads(q, k, v), seen)

        def decode():
            cache = init_cache(1, 1024, H_kv, c["K"], c["V"], config, dtype)
            o, cache = prefill(q[:, :1000], k[:, :1000], v[:, :1000], cache, config, backend="pallas")
            return decode_step(q[:, 1000], k[:, 1000], v[:, 1000], cache, config, backend="pallas")[0]

        if not c.get("packed") and "overrides" not in c:
            row["decode"], row["decode_kernels"], row["decode_s"] = attempt(decode, seen)
        row["over_limit"] = {k: b for part in ("forward", "train", "decode")
                             for k, b in row.get(part + "_kernels", {}).items() if b > LIMIT}
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
