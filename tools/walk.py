"""q's walk through the Pallas passes, counted: how many project functions the data
computed from q passes through, in how many files, and how often the road re-enters a
file it left. A newcomer follows q the same way; the counts say how long that read is.

    python tools/walk.py                 # forward and backward, both rules
    python tools/walk.py --pass backward --rule bound --stops   # and every stop in order
    python tools/walk.py --road          # htree_attention's road to its kernels (`road`)

Method (the journal's, 2026-11-27): the pass on the interpreted kernels under
`jax.disable_jit`, `jax.jvp` in q only (k, v and the rest constants, so only what depends
on q is a forward-mode tracer; staged by `jax.make_jaxpr`, not run), the pass's own body called directly (`htree_forward_pallas`,
`htree_backward_pallas`: a `custom_vjp` cannot be pushed forward), each `pallas_call`
replaced by zeros of its outputs (its kernel not entered), at T=150, r=4, `top_k=4` (3
layers, one query chunk), G=4, K=V=32. A *stop* is a call of a function defined under
`htree_jax/` or `pallas_kernels/` that receives data computed from q; a file is
*entered* each time the road moves into it from another.
"""

from __future__ import annotations

import argparse
import collections
import collections.abc
import contextlib
import dataclasses
import inspect
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from htree_jax import HTreeConfig, htree_attention
from htree_jax.cli import DefaultsHelpFormatter

DESCRIPTION = __doc__.split("\n\n")[0]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT = tuple(os.path.join(ROOT, d) + os.sep for d in ("htree_jax", "pallas_kernels"))
T, H, H_KV, K, V = 150, 8, 2, 32, 32


@dataclasses.dataclass
class Walk:
    stops: list  # [(file relative to the root, function name)], in call order

    @property
    def files(self) -> list:
        return sorted({f for f, _ in self.stops})

    @property
    def entries(self) -> collections.Counter:
        """Per file, how many times the road moved into it (the first stop counts)."""
        count, previous = collections.Counter(), None
        for f, _ in self.stops:
            if f != previous:
                count[f] += 1
            previous = f
        return count

    def summary(self, label: str) -> str:
        entries = self.entries
        most = entries.most_common(1)[0] if entries else ("-", 0)
        return (f"{label}: {len(self.stops)} stops in {len(self.files)} files, {sum(entries.values()) - 1} moves "
                f"between files, most entered: {most[0]} {most[1]} times (re-entered {max(most[1] - 1, 0)})")


def _carries_q(value) -> bool:
    # An iterator argument (a generator, `zip`) is a leaf here, and not a tracer: named
    # so (`is_leaf`), not left for JAX to treat as one, which it deprecates.
    try:
        leaves = jax.tree_util.tree_leaves(value, is_leaf=lambda x: isinstance(x, collections.abc.Iterator))
    except Exception:  # noqa: BLE001 - a value that is no pytree carries nothing of q
        return False
    return any(isinstance(x, jax.interpreters.ad.JVPTracer) for x in leaves)


@contextlib.contextmanager
def _watching(stops: list):
    """Records every project function called with a tracer among its arguments, in the
    first query chunk only (a pass's loop body is a project function named `chunk`; the
    later chunks walk the same road again)."""
    chunks, inside = [0], set()

    def profile(frame, event, arg):
        path = frame.f_code.co_filename
        if not path.startswith(PROJECT) or path == os.path.abspath(__file__):
            return
        code = frame.f_code
        if event == "return":
            inside.discard(id(frame))
            return
        if event != "call":
            return
        if code.co_name == "chunk":
            chunks[0] += 1
            inside.add(id(frame))
        if inside and chunks[0] > 1:
            return
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount
                                 + bool(code.co_flags & 4) + bool(code.co_flags & 8)]
        if any(_carries_q(frame.f_locals.get(n)) for n in names):
            stops.append((os.path.relpath(path, ROOT), code.co_name))

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(None)


def _zeros_pallas_call(kernel, out_shape, *args, **kwargs):
    """`pl.pallas_call` whose call returns zeros of its outputs (the kernel is not entered)."""
    def call(*operands):
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)
    return call


def walk(pass_name: str, rule: str) -> Walk:
    from pallas_kernels.gqa.backward import htree_backward_pallas
    from pallas_kernels.gqa.forward import htree_forward_pallas

    config = HTreeConfig(compression_rate=4, top_k=4, selection=rule, selection_block=1)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in ((1, T, H, K), (1, T, H_KV, K), (1, T, H_KV, V)))
    if pass_name == "forward":
        body = lambda q: htree_forward_pallas(q, k, v, config=config, interpret=True)[0]
    else:
        o, lse = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((1, T, H, V), (1, T, H)))
        body = lambda q: htree_backward_pallas(q, k, v, o, lse, o, config=config, interpret=True)[0]
    stops = []
    real = pl.pallas_call
    pl.pallas_call = _zeros_pallas_call
    try:
        # Staged (`make_jaxpr`), not run: every op of the pass is recorded once, none
        # compiled one by one; `disable_jit` inlines the pass's inner jitted functions, so
        # their bodies are walked with q's tracers too.
        with jax.disable_jit(), _watching(stops):
            jax.make_jaxpr(lambda q: jax.jvp(body, (q,), (jnp.ones_like(q),)))(q)
    finally:
        pl.pallas_call = real
    return Walk(stops)


def _layer(path: str) -> int:
    """0 the core, 1 the kernels, 2 the rest of `htree_jax` (the backends, the API)."""
    return 0 if path.startswith("htree_jax/core") else 1 if path.startswith("pallas_kernels") else 2


def road(config: HTreeConfig, backend: str = "pallas_interpret") -> tuple:
    """The road `htree_attention`'s forward takes to its kernels, as a reader follows it:
    the project functions on the call stack at each `pallas_call` (launches not entered,
    the call staged by `jax.eval_shape` under `disable_jit`), in first-visit order, and
    the *climbs*: between two consecutive launches, the reader goes back up to the
    deepest function both stacks share; a climb is such a return into a higher layer
    (`htree_jax`'s modules above `pallas_kernels`, both above `htree_jax/core`) than
    the last launch's file's, against the way dependencies point. Returns `(stops, climbs, launches)`: `[(file,
    function)]`, the climbs' `[(from file, to file)]`, the launches' count. (Checks and
    route choices are not on a launch's stack: not counted.)"""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in ((1, T, H, K), (1, T, H_KV, K), (1, T, H_KV, V)))
    stacks = []

    def launch(kernel, out_shape, *args, **kwargs):
        frames = [f for f in inspect.stack() if f.filename.startswith(PROJECT)]
        stacks.append([(os.path.relpath(f.filename, ROOT), f.function) for f in reversed(frames)])
        return _zeros_pallas_call(kernel, out_shape, *args, **kwargs)

    real = pl.pallas_call
    pl.pallas_call = launch
    try:
        with jax.disable_jit():
            jax.eval_shape(lambda q: htree_attention(q, k, v, config, backend=backend), q)
    finally:
        pl.pallas_call = real
    stops, climbs = [], []
    for before, after in zip([[]] + stacks, stacks):
        shared = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
        if before and shared and _layer(before[shared - 1][0]) > _layer(before[-1][0]):
            climbs.append((before[-1][0], before[shared - 1][0]))
        stops += [x for x in after if x not in stops]
    return stops, climbs, len(stacks)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--pass", dest="passes", nargs="+", default=["forward", "backward"],
                        choices=["forward", "backward"])
    parser.add_argument("--rule", nargs="+", default=["bound", "mean"], choices=["bound", "mean"])
    parser.add_argument("--stops", action="store_true", help="print every stop, in order")
    parser.add_argument("--road", action="store_true",
                        help="instead: htree_attention's road to its kernels at the default (block selection)")
    args = parser.parse_args(argv)
    if args.road:
        stops, climbs, launches = road(HTreeConfig(compression_rate=4, top_k=4))
        print(f"road: {len(stops)} stops in {len({f for f, _ in stops})} files, {len(climbs)} climbs back up, "
              f"{launches} launches")
        for f, name in stops:
            print(f"  {f}: {name}")
        for a, b in climbs:
            print(f"  climb: {a} -> {b}")
        return 0
    for pass_name in args.passes:
        for rule in args.rule:
            w = walk(pass_name, rule)
            print(w.summary(f"{pass_name} ({rule})"), flush=True)
            if args.stops:
                for f, name in w.stops:
                    print(f"  {f}: {name}")
                print("  entries: " + ", ".join(f"{f} {n}" for f, n in w.entries.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
