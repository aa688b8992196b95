"""CI's second run (`.ci/run`, the newest JAX) takes each test function's first case
(`--one-case-each`, `tests/conftest.py`): every function is kept, once, in order."""

from __future__ import annotations

import types

from tests.conftest import first_case_of_each


def test_each_function_keeps_its_first_case_and_only_it():
    ids = ["a.py::f[1]", "a.py::f[2]", "a.py::g", "b.py::f[1]", "a.py::h[x-1]", "a.py::h[x-2]", "b.py::f[3]"]
    kept, dropped = first_case_of_each([types.SimpleNamespace(nodeid=i) for i in ids])
    assert [k.nodeid for k in kept] == ["a.py::f[1]", "a.py::g", "b.py::f[1]", "a.py::h[x-1]"]
    assert [d.nodeid for d in dropped] == ["a.py::f[2]", "a.py::h[x-2]", "b.py::f[3]"]
