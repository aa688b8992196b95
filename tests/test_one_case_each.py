"""CI's second run (`.ci/run`, the oldest supported JAX) takes each test function's first case
(`--one-case-each`, `tests/conftest.py`): every function is kept, once, in order, but
the long checks that `SECOND_RUN_LEAVES` names (each a test that exists)."""

from __future__ import annotations

import pathlib
import types

from tests.conftest import SECOND_RUN_LEAVES, first_case_of_each, second_run


def test_each_function_keeps_its_first_case_and_only_it():
    ids = ["a.py::f[1]", "a.py::f[2]", "a.py::g", "b.py::f[1]", "a.py::h[x-1]", "a.py::h[x-2]", "b.py::f[3]"]
    kept, dropped = first_case_of_each([types.SimpleNamespace(nodeid=i) for i in ids])
    assert [k.nodeid for k in kept] == ["a.py::f[1]", "a.py::g", "b.py::f[1]", "a.py::h[x-1]"]
    assert [d.nodeid for d in dropped] == ["a.py::f[2]", "a.py::h[x-2]", "b.py::f[3]"]


def test_the_second_run_leaves_out_the_checks_it_names_and_only_them():
    left = "tests/" + SECOND_RUN_LEAVES[0]
    ids = ["tests/test_sharding.py::test_sharded_batch_and_heads_on_simulated_devices[reference]",
           "tests/test_sharding.py::test_sharded_batch_and_heads_on_simulated_devices[pallas_interpret]", left,
           "tests/test_x.py::f[1]"]
    kept, dropped = second_run([types.SimpleNamespace(nodeid=i) for i in ids])
    assert [k.nodeid for k in kept] == [ids[0], ids[3]]
    assert [d.nodeid for d in dropped] == [ids[1], left]


def test_each_check_the_second_run_leaves_is_a_test_of_the_suite():
    """A renamed test would leave the second run's list naming nothing."""
    tests = pathlib.Path(__file__).resolve().parent
    for leave in SECOND_RUN_LEAVES:
        file, name = leave.split("::")
        assert f"def {name.split('[')[0]}(" in (tests / file).read_text(), leave
