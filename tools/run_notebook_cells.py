"""Runs the code cells of a notebook in this process, without Jupyter (the GPU machine
has no nbclient/ipykernel): each figure is saved as a PNG under `--out` instead of shown.
From any directory: the cells run in the notebook's own directory, as Jupyter runs them
(`--notebook` and `--out` are taken relative to where it was called).

    HTREE_NB_SIZES=1024,4096,16384,65536 python tools/run_notebook_cells.py --out /tmp/nb
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib

from htree_jax.cli import DefaultsHelpFormatter

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter, description=__doc__.split("\n\n")[0])
    p.add_argument("--notebook", default=str(ROOT / "notebooks" / "explore_htree.ipynb"), help="the notebook to run")
    p.add_argument("--out", default=".", help="where the figures are saved")
    args = p.parse_args(argv)
    try:
        import matplotlib
    except ImportError:  # the notebook's extra, not the package's
        raise SystemExit("run_notebook_cells.py: the notebook draws with matplotlib, which is not installed: "
                         "pip install -e '.[notebook]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = pathlib.Path(args.out).resolve()
    notebook = pathlib.Path(args.notebook).resolve()
    out.mkdir(parents=True, exist_ok=True)
    count = [0]

    def show(*_, **__):
        for num in plt.get_fignums():
            count[0] += 1
            plt.figure(num).savefig(out / f"figure_{count[0]}.png", dpi=90)
        plt.close("all")

    plt.show = show
    cells = json.loads(notebook.read_text())["cells"]
    scope: dict = {"__name__": "__notebook__"}
    with contextlib.chdir(notebook.parent):
        for i, cell in enumerate(cells):
            if cell["cell_type"] == "code":
                print(f"--- cell {i}", flush=True)
                exec(compile("".join(cell["source"]), f"<cell {i}>", "exec"), scope)
    print(f"figures saved: {count[0]} in {os.fspath(out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
