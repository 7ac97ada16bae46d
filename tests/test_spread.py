"""The `spread` mark (tests/conftest.py): each case of a spread test runs on exactly one
backend in the default suite, and all of them on every backend with `-m ""`. The
`torch_path` and `sweep` marks: on torch only, by default."""

import collections

import pytest

from tests.conftest import SPREAD_BACKENDS, SPREAD_DEAL, slow_off_torch_items, spread_here


class _Item:
    def __init__(self, nodeid, marks=("spread",)):
        self.nodeid = nodeid
        self._marks = set(marks)

    def get_closest_marker(self, name):
        return object() if name in self._marks else None


def _items():
    items = [_Item(f"tests/test_a.py::test_many[{i}]") for i in range(7)]
    items += [_Item(f"tests/test_b.py::test_one_{i}") for i in range(30)]
    items += [_Item("tests/test_a.py::test_many_slow[0]", ("spread", "slow")),
              _Item("tests/test_a.py::test_plain[0]", ())]
    return items


def test_each_spread_case_runs_on_exactly_one_backend():
    items = _items()
    runs = collections.Counter()
    for backend in SPREAD_BACKENDS:
        runs.update(spread_here(items, backend))
    spread = {item.nodeid for item in items if item.get_closest_marker("spread")
              and not item.get_closest_marker("slow")}
    assert set(runs) == spread and set(runs.values()) == {1}


def test_cases_of_a_function_are_dealt_in_turn_and_single_tests_spread_out():
    items = _items()
    per_backend = {b: spread_here(items, b) for b in SPREAD_BACKENDS}
    # Seven cases: one round of the deal, each backend as often as it stands in it.
    many = {b: sum("test_many[" in n for n in here) for b, here in per_backend.items()}
    assert many == {b: SPREAD_DEAL.count(b) for b in SPREAD_BACKENDS}
    assert set(SPREAD_DEAL) == set(SPREAD_BACKENDS)
    # Thirty one-case functions: the checksum puts some on every backend.
    ones = {b: sum("test_one_" in n for n in here) for b, here in per_backend.items()}
    assert sum(ones.values()) == 30 and min(ones.values()) >= 2, ones


@pytest.mark.parametrize("backend", SPREAD_BACKENDS)
def test_slow_and_unmarked_cases_are_not_dealt(backend):
    here = spread_here(_items(), backend)
    assert not {"tests/test_a.py::test_many_slow[0]", "tests/test_a.py::test_plain[0]"} & here


@pytest.mark.parametrize("backend", SPREAD_BACKENDS)
def test_torch_path_and_sweep_tests_run_by_default_on_torch_only(backend):
    items = [_Item("tests/test_c.py::test_step[0]", ("torch_path",)),
             _Item("tests/test_c.py::test_step[1]", ("torch_path", "other")),
             _Item("tests/test_c.py::test_sweep", ("sweep",)),
             _Item("tests/test_c.py::test_not_taken", ())]
    slow = {item.nodeid for item in slow_off_torch_items(items, backend)}
    expected = set() if backend == "torch" else {"tests/test_c.py::test_step[0]",
                                                 "tests/test_c.py::test_step[1]",
                                                 "tests/test_c.py::test_sweep"}
    assert slow == expected
