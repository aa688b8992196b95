"""Per-kernel device time from a `jax.profiler` trace (GPU), no Nsight needed:
`kernel_times(fn, steps)` runs `fn()` `steps` times under the profiler and returns each
kernel's mean time per step (us) from the GPU plane's stream lines; `kernel_events` gives
the launches themselves (name, start, duration), `busy_span` the device's busy time and
span per step, `hlo_sources` the source of each XLA kernel from the compiled HLO.

Used by `bench --shape mla` (the bottom merge kernel's rate), `benchmarks/profile.py
--pass decode --shape mla` and `--pass account`; `print_kernel_times` prints the heaviest."""

from __future__ import annotations

import collections
import glob
import os
import re
import tempfile

import jax
from jax.profiler import ProfileData


def kernel_events(fn, steps: int = 3) -> list[tuple[str, float, float]]:
    """`[(kernel name, start ns, duration ns)]` of every launch on the GPU's streams during
    `steps` calls of `fn()` (each call waited on before the next: the steps do not
    overlap), in start order. Empty where no GPU ran (a CPU trace has no GPU plane)."""
    events = []
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for _ in range(steps):
            jax.block_until_ready(fn())
        jax.profiler.stop_trace()
        path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
        planes = ProfileData.from_file(path).planes
    for plane in planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "stream" not in line.name.lower():
                continue
            events += [(event.name, event.start_ns, event.duration_ns) for event in line.events]
    return sorted(events, key=lambda e: e[1])


def kernel_times(fn, steps: int = 3, events=None) -> dict:
    """`{kernel name: (us per step, launches per step)}` of `steps` calls of `fn()` (or of
    `kernel_events`' `events` of that many steps, where given)."""
    total, launches = collections.defaultdict(float), collections.Counter()
    for name, _, duration in kernel_events(fn, steps) if events is None else events:
        total[name] += duration / 1e3
        launches[name] += 1
    return {name: (t / steps, launches[name] / steps) for name, t in total.items()}


def busy_span(events, steps: int, gap_ns: float = 1e6) -> tuple[float, float]:
    """`(busy us, span us)` per step of `kernel_events`' `events`: the union of the
    launches' intervals (streams may overlap), and the time from a step's first launch's
    start to its last's end, the steps told apart by the host's wait between them (a pause
    of over `gap_ns` with nothing running; the mean over the steps found)."""
    busy, spans, first, end = 0.0, [], None, None
    for _, start, duration in events:
        if end is not None and start - end > gap_ns:
            spans.append(end - first)
            first = None
        if first is None:
            first, end = start, start
        busy += max(0.0, start + duration - max(start, end))
        end = max(end, start + duration)
    if first is not None:
        spans.append(end - first)
    return busy / steps / 1e3, sum(spans) / max(len(spans), 1) / 1e3


def hlo_sources(compiled_text: str) -> dict:
    """`{kernel name as the trace writes it: (shape, op_name, source "file:line")}` of every
    instruction of an executable's HLO text that carries metadata (the trace writes HLO's
    `fusion.1` as `fusion_1`: both spellings are keys)."""
    sources = {}
    for line in compiled_text.splitlines():
        head = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*)", line)
        if not head or "metadata=" not in line:
            continue
        op = re.search(r'op_name="([^"]*)"', line)
        file = re.search(r'source_file="([^"]*)"', line)
        where = re.search(r"source_line=(\d+)", line)
        shape = re.split(r" [\w\-]+\(", head.group(2), maxsplit=1)[0]
        entry = (shape, op.group(1) if op else "", f"{file.group(1)}:{where.group(1)}" if file and where else "")
        for name in {head.group(1), head.group(1).replace(".", "_")}:
            sources.setdefault(name, entry)
    return sources


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
