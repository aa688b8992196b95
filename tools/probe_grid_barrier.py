"""Probe (issue 52, GPU): the cost of a grid-wide barrier inside one Pallas-Triton kernel,
the floor of a decode walk in one persistent launch (a selecting layer needs three:
scores -> packed keys -> top-K -> merge; journal 2026-11-27 (7)).

    python tools/probe_grid_barrier.py

Each barrier is one int32 counter: every program adds 1 (`plgpu.atomic_add`, acq_rel at
GPU scope) and spins until it reads the grid's size. Every program must be resident at
once (grids up to two per multiprocessor here), else it would never return. The figure
per barrier is (1024 barriers - 256) / 768, host-timed medians of 30 calls (the call's
round trip, 80-120 us and noisy, cancels).
"""

import functools
import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def kernel(cnt_in, x_ref, cnt_ref, o_ref, *, nbar, nprog):
    """`nbar` grid barriers on `cnt_ref [nbar]` (zeros in), then each program's row + nbar."""
    acc = x_ref[...]

    def one(b, acc):
        plgpu.atomic_add(cnt_ref, b, 1)
        lax.while_loop(lambda v: v < nprog, lambda v: plgpu.atomic_add(cnt_ref, b, 0), jnp.int32(0))
        return acc + 1.0

    o_ref[...] = lax.fori_loop(0, nbar, one, acc)


def run(nprog: int, nbar: int) -> float:
    """Median us of a call with `nbar` barriers over `nprog` programs (checked: every
    counter reached `nprog`, every row `nbar`)."""
    cnt = jnp.zeros((max(nbar, 1),), jnp.int32)
    x = jnp.zeros((nprog, 128), jnp.float32)
    f = jax.jit(lambda cnt, x: pl.pallas_call(
        functools.partial(kernel, nbar=nbar, nprog=nprog), grid=(nprog,),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec((None, 128), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec((None, 128), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct(cnt.shape, jnp.int32), jax.ShapeDtypeStruct(x.shape, jnp.float32)],
        input_output_aliases={0: 0}, compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1))(cnt, x))
    c, o = jax.block_until_ready(f(jnp.zeros_like(cnt), x))
    assert int(c[0]) == (nprog if nbar else 0) and float(o[0, 0]) == nbar, (c[:4], o[0, 0])
    times = []
    for _ in range(30):
        z = jnp.zeros_like(cnt)
        jax.block_until_ready(z)
        t0 = time.perf_counter()
        jax.block_until_ready(f(z, x))
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main() -> int:
    print(jax.devices()[0].device_kind, flush=True)
    for nprog in (8, 66, 132, 264):
        base, t256, t1024 = (run(nprog, nbar) for nbar in (0, 256, 1024))
        print(f"programs {nprog}: no barrier {base:.1f} us (call round trip); 256: {t256:.1f} us, 1024: "
              f"{t1024:.1f} us; per barrier {(t1024 - t256) / 768:.2f} us", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
