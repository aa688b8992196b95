"""The documents a user reads hold to their rules: the README is a front door (at most 250
lines, its first code block by line 60), RESULTS holds current figures (at most 400
lines), every relative link in the README and `docs/` reaches a file (and a heading,
where it names one), and every file path and project module the code's docstrings and
comments cite exists."""

from __future__ import annotations

import dataclasses
import importlib
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "RESULTS.md",
             ROOT / "benchmarks" / "journal" / "README.md"]
CODE_FOLDERS = ("htree_jax", "pallas_kernels", "reference_numpy", "benchmarks", "tools", "examples", "tests")


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, len(lines)
    first_block = next(i for i, line in enumerate(lines, 1) if line.startswith("```"))
    assert first_block <= 60, first_block


def test_results_holds_current_figures_only():
    assert len((ROOT / "benchmarks" / "RESULTS.md").read_text().splitlines()) <= 400


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def headings(path: pathlib.Path) -> set[str]:
    return {anchor(m.group(1)) for m in re.finditer(r"^#+ (.*)$", path.read_text(), re.M)}


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_its_file_and_heading(path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # an absolute URL
        file, _, fragment = target.partition("#")
        where = (path.parent / file).resolve() if file else path
        assert where.exists(), f"{path.relative_to(ROOT)} links to {target}: no such file"
        if fragment:
            assert fragment in headings(where), f"{path.relative_to(ROOT)} links to {target}: no such heading"


# A path cited in code: folders and a file name with a known ending; a file name alone in
# backquotes; a dotted name of one of our modules in backquotes.
PATH = re.compile(r"(?<![\w./-])((?:\.\./)*[\w-]+(?:/[\w.-]+)*/[\w-]+\.(?:py|md|json|ipynb|png|log|txt))\b")
FILE_NAME = re.compile(r"`([\w.]+\.py)`")
MODULE = re.compile(r"`((?:htree_jax|pallas_kernels|reference_numpy)(?:\.\w+)+)")
LIBRARY_AND_TOOLS = ("htree_jax", "pallas_kernels", "reference_numpy", "benchmarks", "tools", "examples")
FILE_NAMES = {p.name for p in ROOT.rglob("*.py")}


def cited_path_exists(path: str, source: pathlib.Path) -> bool:
    """Whether a cited path names a file inside the repository from its root, from the
    citing file's folder, or from a package folder (`pallas_kernels/`, `htree_jax/`: a
    family's `gqa/merge.py`)."""
    for base in (ROOT, source.parent, ROOT / "pallas_kernels", ROOT / "htree_jax"):
        where = (base / path).resolve()
        if where.exists() and where.is_relative_to(ROOT):
            return True
    return False


def cited_module_exists(dotted: str) -> bool:
    """Whether a dotted name is one of our modules, or a name reached from one
    (`htree_jax.memory_plan`, `pallas_kernels.shared.common.zeros_after`)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:n]))
        except ImportError:
            continue
        for name in parts[n:]:
            if not hasattr(value, name):
                return False
            value = getattr(value, name)
        return True
    return False


@pytest.mark.parametrize("folder", CODE_FOLDERS)
def test_every_path_and_module_the_code_cites_exists(folder):
    missing = []
    for source in sorted((ROOT / folder).rglob("*.py")):
        text = source.read_text()
        cited = []
        if folder in LIBRARY_AND_TOOLS:  # the tests cite made-up paths of their own
            cited += [p for p in PATH.findall(text) if not cited_path_exists(p, source)]
            cited += [name for name in FILE_NAME.findall(text) if name not in FILE_NAMES]
        cited += [dotted for dotted in MODULE.findall(text) if not cited_module_exists(dotted)]
        missing += [f"{source.relative_to(ROOT)}: {c}" for c in cited]
    assert not missing, "\n".join(missing)


def test_the_journal_index_lists_every_entry():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import journal_index
    finally:
        sys.path.remove(str(ROOT / "tools"))
    assert (ROOT / "benchmarks" / "journal" / "README.md").read_text() == journal_index.index_text(), \
        "run python tools/journal_index.py"


def test_the_support_matrix_is_the_routes_own(monkeypatch):
    """`docs/backends.md`'s support matrix is what `htree_jax.routes.support_matrix`
    writes from the routes' `Support` declarations; a limit changed in the code (here a
    block kernel's head dim) changes the table, and the document then differs."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import support_matrix as tool
    finally:
        sys.path.remove(str(ROOT / "tools"))
    from htree_jax import routes

    doc = (ROOT / "docs" / "backends.md").read_text()
    assert tool.documented(doc) == routes.support_matrix(), "run python tools/support_matrix.py --write"
    columns = [name for name, route in routes.ROUTES.items() if route.support is not None]
    assert set(routes.ROUTES) - set(columns) == {"reference_packed"} and f"`{columns[-1]}`" in doc
    changed = {**routes.ROUTES, "block_pallas_triton": dataclasses.replace(
        routes.ROUTES["block_pallas_triton"], support=dataclasses.replace(routes.BLOCK, head_dims="K, V <= 512"))}
    assert tool.documented(doc) != routes.support_matrix(changed)
    assert tool.documented(tool.written(doc, "| x |")) == "| x |"
