"""Runs the code cells of a notebook in this process, without Jupyter (the GPU machine
has no nbclient/ipykernel): each figure is saved as a PNG under `--out` instead of shown.

    HTREE_NB_SIZES=1024,4096,16384,65536 python benchmarks/run_notebook_cells.py --out /tmp/nb
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--notebook", default="notebooks/explore_htree.ipynb")
    p.add_argument("--out", default=".")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    count = [0]

    def show(*_, **__):
        for num in plt.get_fignums():
            count[0] += 1
            plt.figure(num).savefig(out / f"figure_{count[0]}.png", dpi=90)
        plt.close("all")

    plt.show = show
    cells = json.loads(pathlib.Path(args.notebook).read_text())["cells"]
    scope: dict = {"__name__": "__notebook__"}
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "code":
            print(f"--- cell {i}", flush=True)
            exec(compile("".join(cell["source"]), f"<cell {i}>", "exec"), scope)
    print(f"figures saved: {count[0]} in {os.fspath(out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
