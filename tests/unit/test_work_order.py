"""tests/support/work_order.py: the in-process tests spread among the others."""

from __future__ import annotations

from types import SimpleNamespace

from tests.support.work_order import spread


def _items(*nodeids: str) -> list:
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_in_process_tests_are_spread_evenly_each_kind_in_its_order():
    heavy = [f"tests/e2e/test_{i}.py::t" for i in range(3)]
    light = [f"tests/unit/test_{i}.py::t" for i in range(6)]
    order = [item.nodeid for item in spread(_items(*heavy, *light))]
    assert order == [
        heavy[0], light[0], light[1], heavy[1], light[2], light[3], heavy[2], light[4], light[5]
    ]  # fmt: skip


def test_fewer_in_process_tests_than_others_and_one_kind_alone():
    heavy = [f"tests/distributed/test_{i}.py::t" for i in range(4)]
    light = ["tests/scale/test_a.py::t", "tests/layouts/test_b.py::t"]
    order = [item.nodeid for item in spread(_items(*light, *heavy))]
    assert order == [heavy[0], heavy[1], light[0], heavy[2], heavy[3], light[1]]
    alone = _items(*light)
    assert spread(alone) == alone
