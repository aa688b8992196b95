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
attention (K=576, V=512 read from the keys, G=128), a 48-head group in float16, block
selection (SPEC 12: bf16 `"first"` at `top_k=512`, a 3-layer float32 `"previous"` tree),
and decode steps (GQA bf16 and latent; block selection's one-launch step inside a block).

Each kernel has two digests: its text (equal: the same jaxpr, equation for equation) and
its dataflow (`dataflow_digest`: every value named by what computes it from what, so two
kernels that order the same independent equations differently have the same one; writes
to refs and the reads between them keep their order). `--compare` says which kernels
differ in text only (the same arithmetic, reordered) and which in dataflow.
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
from pallas_kernels.decode.kept import kept_step_pallas

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
    kept_step: bool = False  # block selection: also the one-launch decode step inside a block


CASES = [
    Case("gqa bound top_k=64", 4096, 16, 2, 128, 128, "bfloat16", HTreeConfig(top_k=64, selection_block=1)),
    Case("gqa bound top_k=512", 16384, 16, 2, 128, 128, "bfloat16", HTreeConfig(top_k=512, selection_block=1)),
    Case("gqa mean top_k=64", 4096, 16, 2, 128, 128, "bfloat16", HTreeConfig(top_k=64, selection="mean", selection_block=1)),
    Case("gqa mean top_k=512", 16384, 16, 2, 128, 128, "bfloat16", HTreeConfig(top_k=512, selection="mean", selection_block=1)),
    Case("3-layer f32 r=4", 150, 8, 2, 32, 32, "float32", HTreeConfig(compression_rate=4, top_k=4, selection_block=1)),
    Case("latent K=576 V=512 G=128", 2048, 128, 1, 576, 512, "bfloat16", HTreeConfig(top_k=64, rope_dim=64),
         latent=True),
    Case("48-head group f16", 2048, 48, 1, 64, 64, "float16", HTreeConfig(top_k=32, selection_block=1)),
    Case("block first top_k=512", 16384, 16, 2, 128, 128, "bfloat16",
         HTreeConfig(top_k=512, selection_block=16), kept_step=True),
    Case("block previous 3-layer f32 r=4", 150, 8, 2, 32, 32, "float32",
         HTreeConfig(compression_rate=4, top_k=4, selection_block=4, block_source="previous"), kept_step=True),
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


def _canonical(value, visit) -> str:
    """A param's text with sub-jaxprs replaced by their dataflow digests."""
    if hasattr(value, "jaxpr") and hasattr(value, "consts") and hasattr(value.jaxpr, "eqns"):  # a ClosedJaxpr
        return visit(value.jaxpr)
    if hasattr(value, "eqns") and hasattr(value, "invars"):
        return visit(value)
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_canonical(x, visit) for x in value) + ")"
    return _SOURCE.sub("", str(value))


def dataflow_digest(jaxpr) -> str:
    """A digest of what `jaxpr` computes, blind to the order of independent equations:
    each value is named by a hash of its primitive, params and inputs' names; an
    equation with effects also names the last write before it, and a write becomes the
    last one, so writes keep their order and each read sees the writes before it."""
    def h(*parts) -> str:
        return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:24]

    def visit(jx) -> str:
        names = {}
        for i, v in enumerate(getattr(jx, "constvars", ())):
            names[v] = h("const", str(i), str(v.aval))
        for i, v in enumerate(jx.invars):
            names[v] = h("in", str(i), str(v.aval))
        last_write = h("start")
        for eqn in jx.eqns:
            ins = [h("literal", str(x), str(x.aval)) if type(x).__name__ == "Literal" else names[x] for x in eqn.invars]
            params = ";".join(f"{k}={_canonical(v, visit)}" for k, v in sorted(eqn.params.items()))
            effects = getattr(eqn, "effects", ())
            key = [eqn.primitive.name, params, *ins] + ([last_write] if effects else [])
            name = h(*key)
            if any(type(e).__name__ != "ReadEffect" for e in effects):
                last_write = name
            for j, v in enumerate(eqn.outvars):
                names[v] = h(name, str(j))
        outs = [h("literal", str(v), str(v.aval)) if type(v).__name__ == "Literal" else names[v] for v in jx.outvars]
        return h("out", *outs, last_write)

    return visit(jaxpr)


def pallas_call_dataflow(jaxpr) -> list[str]:
    """The dataflow digest of every `pallas_call` under `jaxpr`, in the order `pallas_calls` finds them."""
    found = []

    def visit(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "pallas_call":
                rest = ";".join(f"{k}={_SOURCE.sub('', str(v))}" for k, v in sorted(eqn.params.items())
                                if k != "jaxpr")
                found.append(hashlib.sha256((dataflow_digest(eqn.params["jaxpr"]) + rest).encode())
                             .hexdigest()[:16])
                continue
            for sub in jaxprs_in_params(eqn.params):
                visit(sub)

    visit(jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr)
    return found


def case_jaxprs(case: Case) -> dict[str, list[str]]:
    """`{pass: [pallas_call, ...]}` of one case: the forward, its gradient, a decode step."""
    return {name: calls for name, (calls, _) in case_traces(case).items()}


def case_traces(case: Case) -> dict:
    """`{pass: ([pallas_call text, ...], [dataflow digest, ...])}` of one case."""
    dtype = jnp.dtype(case.dtype)
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
    q, k = spec(1, case.T, case.H, case.K), spec(1, case.T, case.H_kv, case.K)
    v = None if case.latent else spec(1, case.T, case.H_kv, case.V)
    value_dim = case.V if case.latent else None
    both = lambda jx: (pallas_calls(jx), pallas_call_dataflow(jx))
    forward = lambda q, k, v: attend(q, k, v, case.config, "pallas", value_dim=value_dim)[0]
    out = {"forward": both(jax.make_jaxpr(forward)(q, k, v))}
    if case.gradient:
        loss = lambda q, k, v: jnp.sum(forward(q, k, v).astype(jnp.float32))
        argnums = (0, 1) if case.latent else (0, 1, 2)
        out["gradient"] = both(jax.make_jaxpr(jax.grad(loss, argnums=argnums))(q, k, v))
    if case in DECODE_CASES:
        B = 8
        cache = jax.eval_shape(lambda: init_cache(B, case.T, case.H_kv, case.K, case.V, case.config, dtype,
                                                  values_from_keys=case.latent))
        step = lambda q, cache: attend_cache(q, cache.tree, jnp.full((B, 1), case.T - 1, jnp.int32), case.config,
                                             "pallas")[0]
        out["decode"] = both(jax.make_jaxpr(step)(spec(B, 1, case.H, case.K), cache))
    if case.kept_step:
        B = 8
        cache = jax.eval_shape(lambda: init_cache(B, case.T, case.H_kv, case.K, case.V, case.config, dtype,
                                                  num_heads=case.H))
        step = lambda q, cache: kept_step_pallas(q, cache.keys, cache.values, jnp.full((B,), case.T - 2, jnp.int32),
                                                 tuple(cache.selections), case.config)
        out["kept step"] = both(jax.make_jaxpr(step)(spec(B, case.H, case.K), cache))
    return out


def digest(texts) -> str:
    return hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]


def all_digests() -> dict:
    """`{case: {pass: {"calls": n, "digest": d, "kernels": [d, ...], "dataflow": [d, ...]}}}`."""
    result = {}
    for case in CASES:
        result[case.name] = {name: {"calls": len(calls), "digest": digest(calls), "kernels": [digest([c]) for c in calls],
                                    "dataflow": flows}
                             for name, (calls, flows) in case_traces(case).items()}
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
                flows = list(zip(a.get("dataflow", []), b.get("dataflow", [])))
                reordered = [i for i in changed if i < len(flows) and flows[i][0] == flows[i][1]]
                line = f"{case} {name}: {a['calls']} -> {b['calls']} calls, differing at {changed}"
                if reordered:
                    line += f" (the same dataflow, equations reordered, at {reordered})"
                lines.append(line)
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
