"""A pytest plugin: under pytest-xdist, the tests that run in the test process itself are
spread evenly among the tests that start processes of their own.

In collection order the in-process tests (tests/unit, tests/scale, tests/layouts: most of
the suite's tests, a few minutes of it) come last, so a run ended with both workers on
them; many of them wait rather than compute (a store's deadlines, a file system's syncs, a
compiler's worker starting), and the cores stood idle for the run's last minute or two.
Spread out, each such test runs while the other worker's processes keep the cores busy.
pytest-xdist deals the groups of tests that share a fixture first (the larger first) and
then the other tests in this order; a plain run (no workers) keeps the collection order.
"""

from __future__ import annotations

import pytest

IN_PROCESS = ("tests/unit/", "tests/scale/", "tests/layouts/")
"""Where the tests that start no process of their own live (most of them)."""


def spread(items: list[pytest.Item]) -> list[pytest.Item]:
    """``items`` with the in-process tests spread evenly among the others, each kind in
    its own order."""
    inside = [item for item in items if item.nodeid.startswith(IN_PROCESS)]
    others = [item for item in items if not item.nodeid.startswith(IN_PROCESS)]
    if not inside or not others:
        return items
    order: list[pytest.Item] = []
    taken = 0
    for count, item in enumerate(others, start=1):
        order.append(item)
        share = count * len(inside) // len(others)  # in-process tests due by now
        order.extend(inside[taken:share])
        taken = max(taken, share)
    return order + inside[taken:]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: its collection is dealt out
        items[:] = spread(items)
