"""Times what a new user runs first: the demo, every ```python block of README.md and the
notebook, each in a fresh process (imports and compilation included), as they would.

    python tools/time_readme.py [--skip-demo] [--skip-notebook]

Run it from the repository root with the package installed (`pip install -e .`). Prints
one markdown table of wall seconds; exits non-zero if a step fails.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def readme_blocks(text: str) -> list[tuple[str, str]]:
    """`[(heading, code)]` of every ```python block, under the `##` heading it follows."""
    blocks, heading, code = [], "", None
    for line in text.splitlines():
        if code is None and line.startswith("## "):
            heading = line
        elif code is None and line.strip() == "```python":
            code = []
        elif code is not None and line.strip() == "```":
            blocks.append((heading, "\n".join(code)))
            code = None
        elif code is not None:
            code.append(line)
    return blocks


def timed(argv: list[str], env: dict, cwd: pathlib.Path) -> tuple[float, int, str]:
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    return time.perf_counter() - start, done.returncode, (done.stdout + done.stderr)[-400:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--skip-demo", action="store_true", help="leave out `python -m htree_jax demo`")
    p.add_argument("--skip-notebook", action="store_true", help="leave out notebooks/explore_htree.ipynb")
    args = p.parse_args(argv)
    steps = [] if args.skip_demo else [("python -m htree_jax demo", [sys.executable, "-m", "htree_jax", "demo"], {},
                                        ROOT)]
    for i, (heading, code) in enumerate(readme_blocks((ROOT / "README.md").read_text()), 1):
        steps.append((f"README block {i} ({heading[3:]})", [sys.executable, "-c", code], {}, ROOT))
    if not args.skip_notebook:
        out = tempfile.mkdtemp()
        # From notebooks/, where Jupyter runs it (its last cell reads ../benchmarks/).
        steps.append(("notebooks/explore_htree.ipynb (defaults)",
                      [sys.executable, str(ROOT / "tools" / "run_notebook_cells.py"), "--notebook",
                       "explore_htree.ipynb", "--out", out], {}, ROOT / "notebooks"))
    import jax  # the header only

    print(f"# {platform.python_version()}, jax {jax.__version__}, {os.cpu_count()} CPUs, "
          f"{jax.default_backend()}, {time.strftime('%Y-%m-%d')}")
    print("| step | wall s | ok |\n|---|---|---|", flush=True)
    failed = 0
    for name, cmd, extra, cwd in steps:
        seconds, rc, tail = timed(cmd, {**os.environ, **extra}, cwd)
        print(f"| {name} | {seconds:.1f} | {'ok' if rc == 0 else 'FAIL'} |", flush=True)
        if rc:
            failed += 1
            print(tail, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
