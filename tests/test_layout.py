"""The layout holds (docs/CONTRIBUTING.md, "Layout"): dependencies point one way, core <- implementations
(the reference, `pallas_kernels`) <- backends <- public API; the kernels load neither
Flax nor the API; no function-local import of a project module; no private name imported
from another module (benchmarks, examples and tests included)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROJECT = ("htree_jax", "pallas_kernels", "reference_numpy")
LIBRARY = ("htree_jax", "pallas_kernels")


def python_files(*folders):
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path):
    """`(node, imported module, names)` of every import in the file, at any depth."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield node, a.name, []


def layer(module: str) -> int:
    """0 core, 1 implementations, 2 backends, 3 public API."""
    if module.startswith("htree_jax.core"):
        return 0
    if module.startswith("pallas_kernels") or module in ("htree_jax.reference",):
        return 1
    if module in ("htree_jax.backends", "htree_jax.routes"):
        return 2
    return 3


def test_the_kernels_load_no_flax_and_no_api():
    code = ("import sys, pallas_kernels.gqa.forward, pallas_kernels.gqa.backward, pallas_kernels.decode.walk, "
            "pallas_kernels.wide.forward, pallas_kernels.wide.backward; "
            "assert 'flax' not in sys.modules, 'flax'; "
            "bad = [m for m in sys.modules if m.startswith('htree_jax') and not m.startswith('htree_jax.core') "
            "and m != 'htree_jax']; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_submodules_are_reachable_after_import_htree_jax():
    """`htree_jax.linen.HTreeAttention` as the README writes it, after `import htree_jax` alone."""
    code = ("import htree_jax; assert htree_jax.linen.HTreeAttention.__name__ == 'HTreeAttention'; "
            "assert htree_jax.BlockSizes(save_selections=False).save_selections is False")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.parametrize("path", python_files(*LIBRARY), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path):
    """A module imports from its own layer or below; the oracle only the demo (which
    reports the agreement with it), as the tests do."""
    me = module_name(path)
    for node, target, _ in imports(path):
        if target.split(".")[0] not in PROJECT or me == "htree_jax":
            continue  # `htree_jax/__init__` loads the public names lazily, from every layer
        if target.startswith("reference_numpy"):
            assert me == "htree_jax.demo", f"{me} imports the oracle"
            continue
        assert layer(target) <= layer(me), f"{me} (layer {layer(me)}) imports {target} (layer {layer(target)})"
        if layer(me) == 1:  # the two implementations stand on the core alone, apart
            own = "pallas_kernels" if me.startswith("pallas_kernels") else me
            assert target.startswith(("htree_jax.core", own)), f"{me} imports {target}"


def test_the_oracle_imports_nothing_of_ours():
    for path in python_files("reference_numpy"):
        for _, target, _ in imports(path):
            assert target.split(".")[0] not in ("htree_jax", "pallas_kernels"), (path, target)


@pytest.mark.parametrize("path", python_files(*LIBRARY), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_function_local_import_of_a_project_module(path):
    tree = ast.parse(path.read_text(), str(path))
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                for name in names:
                    assert (name or "").split(".")[0] not in PROJECT, \
                        f"{path.name}:{node.lineno}: {func.name} imports {name} inside a function"


@pytest.mark.parametrize("folder", ["htree_jax", "pallas_kernels", "benchmarks", "examples", "tests"])
def test_no_private_name_imported_from_another_module(folder):
    for path in python_files(folder):
        for node, target, names in imports(path):
            if target.split(".")[0] not in PROJECT:
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            assert not private, f"{path.relative_to(ROOT)}:{node.lineno} imports {private} from {target}"


# Inside `pallas_kernels` (docs/CONTRIBUTING.md, "Layout"): one folder per kernel family, each with its
# forward, backward (where it has one) and config side by side, and one shared folder.
# A family imports the shared folder and `htree_jax.core` only, never another family;
# the shared folder imports no family. The choice of family is `htree_jax.backends`'s.
FAMILIES = ("gqa", "wide", "decode", "block")
SHARED = "shared"


def kernel_folder(module: str) -> str:
    """`pallas_kernels.<folder>.<module>` -> folder (`""` for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else ""


def test_every_kernel_module_is_in_a_family_or_the_shared_folder():
    for path in python_files("pallas_kernels"):
        me = module_name(path)
        assert me == "pallas_kernels" or kernel_folder(me) in FAMILIES + (SHARED,) or me in {
            f"pallas_kernels.{f}" for f in FAMILIES + (SHARED,)}, f"{me}: not in a family folder nor in shared/"


@pytest.mark.parametrize("path", python_files("pallas_kernels"), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_family_imports_no_other_family(path):
    """A family's modules import their own family, the shared folder and the core; the
    shared folder imports no family; the package's own `__init__` imports nothing."""
    me = module_name(path)
    mine = kernel_folder(me) or (me.split(".")[1] if me.count(".") == 1 else "")
    for node, target, names in imports(path):
        if not target.startswith("pallas_kernels"):
            continue
        targets = [f"{target}.{n}" for n in names] if target.count(".") < 2 else [target]
        for full in targets:
            folder = kernel_folder(full) or full.split(".")[1]
            if mine == SHARED:
                assert folder == SHARED, f"{me} (shared) imports the family module {full}"
            else:
                assert folder in (mine, SHARED), f"{me} ({mine or 'package'}) imports {full} of another family"


def test_the_backends_choose_the_family():
    """No family's entry function hands a call to another family: the route table
    (`htree_jax.routes`, full sequences) and `htree_jax.backends` (which chooses, and
    walks decode caches) import each family's entry."""
    targets = {target for name in ("routes.py", "backends.py") for _, target, _ in imports(ROOT / "htree_jax" / name)}
    for family in FAMILIES:
        assert any(t.startswith(f"pallas_kernels.{family}.") for t in targets), family


def test_the_cache_stands_below_the_decode_api():
    """`htree_jax.cache` (the cache type and its updates) imports neither the decode API
    nor a backend; `htree_jax.decode` takes the cache from it."""
    cache_imports = {target for _, target, _ in imports(ROOT / "htree_jax" / "cache.py")}
    assert not cache_imports & {"htree_jax.decode", "htree_jax.backends", "htree_jax.sharding"}, cache_imports
    assert "htree_jax.cache" in {target for _, target, _ in imports(ROOT / "htree_jax" / "decode.py")}


def test_q_walks_a_short_road_through_the_passes():
    """`tools/walk.py` (issue 72's bars): q's road through the GQA forward is at most 40
    stops, through the backward at most 45, with either rule, and no file on either road
    is re-entered more than 3 times (entered at most 4)."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import walk
    finally:
        sys.path.remove(str(ROOT / "tools"))
    for rule in ("bound", "mean"):
        forward, backward = walk.walk("forward", rule), walk.walk("backward", rule)
        assert 20 <= len(forward.stops) <= 40, forward.summary("forward")
        assert 20 <= len(backward.stops) <= 45, backward.summary("backward")
        assert backward.stops[0] == ("pallas_kernels/gqa/backward.py", "htree_backward_pallas")
        for road in (forward, backward):
            assert max(road.entries.values()) <= 4, road.entries


def test_htree_attentions_road_to_its_kernels_does_not_grow():
    """`tools/walk.py --road`: the default call's road from `htree_attention` to its
    kernels makes at most 16 stops with at most 2 climbs back up (issue 102; 2026-12-08:
    16 stops in 13 files, 9 of them the ranking pass, which merges nothing; one climb,
    from the ranking pass to the block route)."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import walk
    finally:
        sys.path.remove(str(ROOT / "tools"))
    stops, climbs, _ = walk.road(walk.HTreeConfig(compression_rate=4, top_k=4))
    assert stops[0] == ("htree_jax/attention.py", "htree_attention") and len(stops) <= 16, stops
    assert not any(f == "pallas_kernels/gqa/merge.py" for f, _ in stops), stops  # the ranking pass merges nothing
    assert len(climbs) <= 2, climbs


def test_pallas_jaxprs_finds_every_kernel_of_the_passes():
    """`tools/pallas_jaxprs.py` finds the pallas_calls of the forward, its gradient and a
    decode step, and tells equal digests from different ones."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import pallas_jaxprs
    finally:
        sys.path.remove(str(ROOT / "tools"))
    case = next(c for c in pallas_jaxprs.CASES if c.name == "3-layer f32 r=4")
    calls = pallas_jaxprs.case_jaxprs(case)
    assert set(calls) == {"forward", "gradient", "decode"}
    assert all(len(c) >= 4 and all(t.startswith("pallas_call[") or "pallas_call" in t for t in c)
               for c in calls.values())
    assert pallas_jaxprs.compare({"c": {"forward": {"calls": 1, "digest": "a", "kernels": ["a"]}}},
                                 {"c": {"forward": {"calls": 1, "digest": "b", "kernels": ["b"]}}}) == [
        "c forward: 1 -> 1 calls, differing at [0]"]


# Helpers a kernel body calls (their arguments are the kernel's refs and traced values):
# kernel code, as the `*_kernel` functions themselves are.
KERNEL_HELPERS = {"score_span", "score_tile", "_tile_scores", "cache_span_scores", "unmerged_at_minus_inf"}
MOST_LONG_SIGNATURES = 12  # issue 102's bar (52 when it was filed)


def long_signatures(min_params: int = 10):
    """`[(path:line, qualified name, parameters)]` of the library's functions outside
    kernel bodies taking `min_params` or more parameters (`self` not counted)."""
    found = []

    def visit(node, stack, path):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = child.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                kernel = any(s.endswith("_kernel") for s in stack + [child.name]) or child.name in KERNEL_HELPERS
                if len(names) >= min_params and not kernel:
                    found.append((f"{path.relative_to(ROOT)}:{child.lineno}", ".".join(stack + [child.name]),
                                  len(names)))
                visit(child, stack + [child.name], path)
            else:
                visit(child, stack + ([child.name] if isinstance(child, ast.ClassDef) else []), path)

    for path in python_files(*LIBRARY):
        visit(ast.parse(path.read_text(), str(path)), [], path)
    return found


def test_few_functions_take_ten_or_more_parameters():
    """A launch takes its arrays and one small settings object, not a row of positional
    flags: at most `MOST_LONG_SIGNATURES` functions of ten or more parameters (the public
    API's among them: `htree_attention`, the modules, Flax's `attention_fn` protocol)."""
    found = long_signatures()
    assert len(found) <= MOST_LONG_SIGNATURES, "\n".join(f"{w} {n} ({p})" for w, n, p in found)
