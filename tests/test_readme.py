"""Every ```python block of README.md, and the blocks of `docs/` named in `PRINTS`, runs
as written, each in a fresh interpreter (as a new user pastes it into a script), and
prints the line that shows what it computed. (The other blocks of `docs/` are fragments:
a call shown with the arrays it would take.)"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def python_blocks(path: pathlib.Path = README) -> list[tuple[str, str]]:
    """`(heading, code)` of each ```python block of `path`, the heading the `## ` section
    it is in (numbered when a section has several)."""
    blocks, heading, seen = [], "(top)", {}
    for match in re.finditer(r"^## ([^\n]*)$|^```python\n(.*?)^```", path.read_text(), re.M | re.S):
        if match.group(1) is not None:
            heading = match.group(1).strip()
            continue
        seen[heading] = seen.get(heading, 0) + 1
        blocks.append((f"{heading} #{seen[heading]}", match.group(2)))
    return blocks


# What each block prints (what it computed), as its comments say: README's by section,
# those of `docs/` as "file: section".
PRINTS = {
    "Install and a first call #1": "o (1, 2048, 8, 64) selected [(1, 2048, 2, 32)]",
    "Flax #1": "y (2, 1024, 512)",
    "Decoding #1": "prefill (1, 40, 4, 16) step (1, 4, 16) rows at [1, 0, 41]",
    "docs/packing.md: The layout and its two static sizes #1": "packed o (2, 1024, 4, 64) finite: True",
    "docs/sharding.md: Batch and heads #1": "on a mesh of {'data': 2, 'model': 4}",
    "docs/decoding.md: In a model #1": "largest difference from the full sequence:",
}
BLOCKS = python_blocks() + [(f"{name}: {heading}", code) for name in sorted({k.split(": ")[0] for k in PRINTS
                                                                             if ": " in k})
                            for heading, code in python_blocks(ROOT / name) if f"{name}: {heading}" in PRINTS]


def test_the_readme_has_its_blocks():
    names = [name for name, _ in BLOCKS]
    for section in PRINTS:
        assert section in names, names


@pytest.mark.parametrize("name,code", BLOCKS, ids=[name for name, _ in BLOCKS])
def test_readme_block_runs_as_written(name, code, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # From another directory: the block finds htree_jax as an installed package, not by
    # being next to it.
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, f"README block {name} failed:\n{run.stderr[-4000:]}"
    printed = [line for line in run.stdout.splitlines() if line.strip()]
    assert printed, f"README block {name} printed nothing"
    if name in PRINTS:
        assert PRINTS[name] in run.stdout, run.stdout
    if name == "docs/decoding.md: In a model #1":  # decoding a small model equals its full sequence to rounding
        assert float(run.stdout.split(":")[-1]) < 1e-4, run.stdout
