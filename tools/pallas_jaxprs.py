"""Every `pallas_call` of the Pallas passes, as jaxprs, at the shapes the kernel moves are
compared on: a digest per kernel and one for all, so that a change that should not touch
a kernel (a file moved, a plan computed elsewhere) is shown not to, on the CPU.

    python tools/pallas_jaxprs.py --out before.json      # on one tree
    python tools/pallas_jaxprs.py --compare before.json  # on the other: equal or the differences

Traced with `jax.make_jaxpr` (nothing is lowered, so no GPU is needed) through
`htree_jax.backends.attend` on `"pallas"` (the forward, and its gradient in q, k, v) and
`attend_cache` (a decode step of 8 rows). A `pallas_call` is printed with its kernel's
jaxpr, grid, block specs and compiler parameters; its source location (file and line),
the only part a move changes by itself, is cut before the digest. Cases: GQA G=8 K=V=128
bf16 with each rule at `top_k` 64 and 512, a 3-layer float32 tree at r=4, latent
attention (K=576, V=512 read from the keys, G=128), a 48-head group in float16, and
decode steps (GQA bf16 and latent).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import re
import sys

import jax
import jax.numpy as jnp

from htree_jax import HTreeConfig, init_cache
from htree_jax.backends import attend, attend_cache
from htree_jax.cli import DefaultsHelpFormatter

try:
    from jax.extend.core import jaxprs_in_params
except ImportError:  # jax < 0.11
    from jax.core import jaxprs_in_params

DESCRIPTION = __doc__.split("\n\n")[0]

# A pallas_call's source location: "name at /path/file.py:123" (name_and_src_info), and
# any other "file.py:line" a jaxpr prints.
_SOURCE = re.compile(r" at [^\s,)]+\.py:\d+|[^\s,()]+\.py:\d+(:\d+)?")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    T: int
    H: int
    H_kv: int
    K: int
    V: int
    dtype: str
    config: HTreeConfig
    latent: bool = False
    gradient: bool = True


CASES = [
    Case("gqa bound top_k=64", 4096, 16, 2, 128, 128, "bfloat16", HTreeConfig(top_k=64)),
    Case("gqa bound top_k=512", 16384, 16, 2, 128, 128, "bfloat16", HTreeConfig(top_k=512)),
    Case("gqa mean top_k=64", 4096, 16, 2, 128, 128, "bfloat16", HTreeConfig(top_k=64, selection="mean")),
    Case("gqa mean top_k=512", 16384, 16, 2, 128, 128, "bfloat16", HTreeConfig(top_k=512, selection="mean")),
    Case("3-layer f32 r=4", 150, 8, 2, 32, 32, "float32", HTreeConfig(compression_rate=4, top_k=4)),
    Case("latent K=576 V=512 G=128", 2048, 128, 1, 576, 512, "bfloat16", HTreeConfig(top_k=64, rope_dim=64),
         latent=True),
    Case("48-head group f16", 2048, 48, 1, 64, 64, "float16", HTreeConfig(top_k=32)),
]
DECODE_CASES = [c for c in CASES if c.name in ("gqa bound top_k=64", "3-layer f32 r=4", "latent K=576 V=512 G=128")]


def pallas_calls(jaxpr) -> list[str]:
    """Every `pallas_call` equation under `jaxpr` (sub-jaxprs included), printed, its source
    locations cut."""
    found = []

    def visit(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "pallas_call":
                found.append(_SOURCE.sub("", str(eqn)))
                continue
            for sub in jaxprs_in_params(eqn.params):
                visit(sub)

    visit(jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr)
    return found


def case_jaxprs(case: Case) -> dict[str, list[str]]:
    """`{pass: [pallas_call, ...]}` of one case: the forward, its gradient, a decode step."""
    dtype = jnp.dtype(case.dtype)
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
    q, k = spec(1, case.T, case.H, case.K), spec(1, case.T, case.H_kv, case.K)
    v = None if case.latent else spec(1, case.T, case.H_kv, case.V)
    value_dim = case.V if case.latent else None
    forward = lambda q, k, v: attend(q, k, v, case.config, "pallas", value_dim=value_dim)[0]
    out = {"forward": pallas_calls(jax.make_jaxpr(forward)(q, k, v))}
    if case.gradient:
        loss = lambda q, k, v: jnp.sum(forward(q, k, v).astype(jnp.float32))
        argnums = (0, 1) if case.latent else (0, 1, 2)
        out["gradient"] = pallas_calls(jax.make_jaxpr(jax.grad(loss, argnums=argnums))(q, k, v))
    if case in DECODE_CASES:
        B = 8
        cache = jax.eval_shape(lambda: init_cache(B, case.T, case.H_kv, case.K, case.V, case.config, dtype,
                                                  values_from_keys=case.latent))
        step = lambda q, cache: attend_cache(q, cache.keys, cache.values, cache.radii,
                                             jnp.full((B, 1), case.T - 1, jnp.int32), case.config, "pallas",
                                             value_dim=cache.value_dim)[0]
        out["decode"] = pallas_calls(jax.make_jaxpr(step)(spec(B, 1, case.H, case.K), cache))
    return out


def digest(texts) -> str:
    return hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]


def all_digests() -> dict:
    """`{case: {pass: {"calls": n, "digest": d, "kernels": [d, ...]}}}`."""
    result = {}
    for case in CASES:
        result[case.name] = {name: {"calls": len(calls), "digest": digest(calls), "kernels": [digest([c]) for c in calls]}
                             for name, calls in case_jaxprs(case).items()}
        print(f"{case.name}: " + ", ".join(f"{p} {d['calls']} calls {d['digest']}" for p, d in result[case.name].items()),
              flush=True)
    return result


def compare(before: dict, after: dict) -> list[str]:
    """The differences, a line each (none: every pallas_call equal)."""
    lines = []
    for case in sorted(set(before) | set(after)):
        for name in sorted(set(before.get(case, {})) | set(after.get(case, {}))):
            a, b = before.get(case, {}).get(name), after.get(case, {}).get(name)
            if a is None or b is None:
                lines.append(f"{case} {name}: only in {'after' if a is None else 'before'}")
            elif a["digest"] != b["digest"]:
                changed = [i for i, (x, y) in enumerate(zip(a["kernels"], b["kernels"])) if x != y]
                lines.append(f"{case} {name}: {a['calls']} -> {b['calls']} calls, differing at {changed}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--out", help="write the digests here (JSON)")
    parser.add_argument("--compare", help="digests of another tree (JSON) to compare with")
    args = parser.parse_args(argv)
    digests = all_digests()
    total = sum(d["calls"] for case in digests.values() for d in case.values())
    print(f"{total} pallas_calls, digest {digest([json.dumps(digests, sort_keys=True)])}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(digests, f, indent=1, sort_keys=True)
    if args.compare:
        with open(args.compare) as f:
            lines = compare(json.load(f), digests)
        print("\n".join(lines) if lines else f"every pallas_call equal to {args.compare}'s", flush=True)
        return 1 if lines else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
