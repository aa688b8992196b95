"""Where the block backward's time goes (GPU probe, not a test): `block_backward_pallas`
at the benchmark shape as built, then with its float32 atomics lowered with relaxed
memory semantics instead of Pallas-Triton's acquire-release, then with plain stores in
their place (the same dots and bytes written, no read-modify-write: what a reduction of
no cost would leave; racy, timed only), then with no atomics at all (the adds dropped,
and with them the two dots only they read, `ds^T q` and `p^T do`: the gathers, three
dots and dq alone). The gradients of the last two are wrong and only timed.

    python tools/probe_block_atomics.py [--T 131072] [--top-k 512]

Both variants patch Pallas-Triton's lowering inside this process only; the library
never does.
"""
from __future__ import annotations

import argparse
import contextlib
import sys

import jax
from jax._src.pallas.triton import lowering as triton_lowering

from htree_jax import HTreeConfig
from htree_jax.backends import blocks_of
from htree_jax.bench import INPUTS, median_ms, run_header
from htree_jax.cli import DefaultsHelpFormatter
from pallas_kernels.block import backward as block_backward
from pallas_kernels.block.forward import block_forward_pallas
from pallas_kernels.shared.configs import BlockConfig


@contextlib.contextmanager
def relaxed_atomics():
    """Pallas-Triton's atomics lowered with `MemSemantic.RELAXED`."""
    original = triton_lowering._atomic_rmw
    relaxed = triton_lowering.tt_dialect.MemSemantic.RELAXED

    def patched(op, ptr, val, mask=None, semantic=None, sync_scope=None, **kw):
        kwargs = dict(mask=mask, semantic=relaxed, **kw)
        if sync_scope is not None:
            kwargs["sync_scope"] = sync_scope
        return original(op, ptr, val, **kwargs)

    triton_lowering._atomic_rmw = patched
    try:
        yield
    finally:
        triton_lowering._atomic_rmw = original


@contextlib.contextmanager
def plain_stores():
    """The backward's dk, dv adds as plain scatter stores (timing only)."""
    original = block_backward.plgpu.atomic_add

    def store(ref, idx, val, **kw):
        ref[idx] = val

    block_backward.plgpu.atomic_add = store
    try:
        yield
    finally:
        block_backward.plgpu.atomic_add = original


@contextlib.contextmanager
def no_atomics():
    """The backward's dk, dv adds dropped (timing only)."""
    original = block_backward.plgpu.atomic_add
    plgpu_module = block_backward.plgpu
    plgpu_module.atomic_add = lambda *a, **k: None
    try:
        yield
    finally:
        plgpu_module.atomic_add = original


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter, description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=131072)
    ap.add_argument("--top-k", type=int, default=512)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu":
        sys.exit("probe_block_atomics: needs a CUDA GPU")
    print(run_header("tools/probe_block_atomics.py", argv), flush=True)
    q, k, v = INPUTS["random"](args.T)
    config = HTreeConfig(top_k=args.top_k, selection_block=16)
    blocks = jax.jit(lambda q, k, v: blocks_of(q, k, v, config))(q, k, v)
    o, lse = block_forward_pallas(q, k, v, blocks, config=config)
    for name, context in (("as built", contextlib.nullcontext), ("relaxed atomics", relaxed_atomics),
                          ("plain stores", plain_stores), ("no atomics", no_atomics)):
        jax.clear_caches()  # the patches act when the kernel is traced and lowered
        with context():
            grads = jax.jit(lambda q, k, v, o, lse, s: block_backward.block_backward_pallas(
                q, k, v, o, lse, o, s, config=config, block=BlockConfig(backward_tile=32, backward_num_warps=8)))
            print(f"{name:16s} {median_ms(grads, (q, k, v, o, lse, blocks), args.iters):9.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
