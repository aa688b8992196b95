"""Every ```python block of README.md runs as written, each in a fresh interpreter (as a
new user pastes it into a script), and prints the line that shows what it computed."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[tuple[str, str]]:
    """`(heading, code)` of each ```python block, the heading the `## ` section it is in
    (numbered when a section has several)."""
    blocks, heading, seen = [], "(top)", {}
    for match in re.finditer(r"^## ([^\n]*)$|^```python\n(.*?)^```", README.read_text(), re.M | re.S):
        if match.group(1) is not None:
            heading = match.group(1).strip()
            continue
        seen[heading] = seen.get(heading, 0) + 1
        blocks.append((f"{heading} #{seen[heading]}", match.group(2)))
    return blocks


BLOCKS = python_blocks()
# What each block prints (what it computed), as its comments say.
PRINTS = {
    "Use #1": "o (1, 2048, 8, 64) selected [(1, 2048, 2, 32)]",
    "Packed documents #1": "packed o (2, 1024, 4, 64) finite: True",
    "Many devices #1": "on a mesh of {'data': 2, 'model': 4}",
    "Flax #1": "y (2, 1024, 512)",
    "Incremental decoding #1": "prefill (1, 40, 4, 16) step (1, 4, 16) rows at [1, 0, 41]",
    "Incremental decoding #2": "largest difference from the full sequence:",
}


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
    if name == "Incremental decoding #2":  # decoding a small model equals its full sequence to rounding
        assert float(run.stdout.split(":")[-1]) < 1e-4, run.stdout
