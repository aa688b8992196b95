"""The support matrix of `docs/backends.md` (what each route takes: platforms, dtypes, head
dims, groups, trees, packed rows, shards, the backward's determinism), written from the
routes' own declarations (`htree_jax.routes.Support`, built from the constants their
checks read) between the document's two markers. `tests/test_docs.py` fails where the
document and the routes differ.

    python tools/support_matrix.py            # print the table
    python tools/support_matrix.py --write    # write it into docs/backends.md
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from htree_jax.cli import DefaultsHelpFormatter
from htree_jax.routes import support_matrix

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "backends.md"
BEGIN = ("<!-- the support matrix: tools/support_matrix.py writes it from htree_jax.routes' Support "
         "declarations (change those, then run it) -->")
END = "<!-- end of the support matrix -->"


def documented(text: str) -> str:
    """The table between the markers of `text` (a ValueError where they are missing)."""
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"{DOC.name} must hold the support matrix's two markers once each")
    return text.split(BEGIN)[1].split(END)[0].strip("\n")


def written(text: str, table: str) -> str:
    """`text` with `table` between its markers."""
    documented(text)
    head, rest = text.split(BEGIN)
    return f"{head}{BEGIN}\n{table}\n{END}{rest.split(END)[1]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter, description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"write the table into {DOC.relative_to(DOC.parents[1])}")
    args = ap.parse_args(argv)
    table = support_matrix()
    if args.write:
        DOC.write_text(written(DOC.read_text(), table))
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
