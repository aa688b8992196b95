"""Writes the journal's index, `benchmarks/journal/README.md`: a line for every entry (a
`## ` heading) of each month's file, linked to it. `tests/test_docs.py` checks that the
index is the one this writes.

    python tools/journal_index.py
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

from htree_jax.cli import DefaultsHelpFormatter

JOURNAL = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "journal"
PREAMBLE = """# The journal: index

The dated record of how each figure in `benchmarks/RESULTS.md` came about: what was tried,
kept or not, with the device, date, software and command of each figure, newest last in
each month's file. RESULTS cites it as "journal, <date> (<n>)"; what a RESULTS row said
before it was measured again is here too. One line an entry:
"""


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def index_text(journal: pathlib.Path = JOURNAL) -> str:
    lines = [PREAMBLE]
    for month in sorted(journal.glob("20*.md")):
        lines += [f"## {month.stem}", ""]
        lines += [f"- [{h}]({month.name}#{anchor(h)})" for h in re.findall(r"^## (.*)$", month.read_text(), re.M)]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter, description=__doc__.split("\n\n")[0]).parse_args(argv)
    (JOURNAL / "README.md").write_text(index_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
