"""Per-kernel device time from a `jax.profiler` trace (GPU), no Nsight needed:
`kernel_times(fn, steps)` runs `fn()` `steps` times under the profiler and returns each
kernel's mean time per step (us) from the GPU plane's stream lines.

Used by `bench --shape mla` (the bottom merge kernel's rate) and
`benchmarks/profile.py --pass decode --shape mla`; `print_kernel_times` prints the heaviest."""

from __future__ import annotations

import collections
import glob
import os
import tempfile

import jax
from jax.profiler import ProfileData


def kernel_times(fn, steps: int = 3) -> dict:
    """`{kernel name: (us per step, launches per step)}` of `steps` calls of `fn()`."""
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(steps):
            out = fn()
        jax.block_until_ready(out)
        jax.profiler.stop_trace()
        path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
        planes = ProfileData.from_file(path).planes
    total, launches = collections.defaultdict(float), collections.Counter()
    for plane in planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "stream" not in line.name.lower():
                continue
            for event in line.events:
                total[event.name] += event.duration_ns / 1e3
                launches[event.name] += 1
    return {name: (t / steps, launches[name] / steps) for name, t in total.items()}


def kernel_ms(fn, name_part: str, steps: int = 3) -> float:
    """Device ms per call of `fn()` in the kernels whose names hold `name_part` (no host
    dispatch or other kernels counted); an error where none ran (no GPU trace)."""
    times = kernel_times(fn, steps)
    us = [t for name, (t, _) in times.items() if name_part in name]
    if not us:
        raise RuntimeError(f"no kernel named like {name_part!r} in the trace ({len(times)} kernels): a GPU is needed")
    return sum(us) / 1e3


def print_kernel_times(times: dict, label: str, top: int = 14) -> None:
    print(f"== {label}: {sum(t for t, _ in times.values()):.1f} us of kernels per step, "
          f"{sum(n for _, n in times.values()):.0f} launches per step", flush=True)
    for name, (t, n) in sorted(times.items(), key=lambda x: -x[1][0])[:top]:
        print(f"{t:9.1f} us  x{n:4.1f}  {name[:100]}", flush=True)
