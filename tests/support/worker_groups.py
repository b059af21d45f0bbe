"""A pytest plugin: tests that share one instance of a fixture wider than a test (class,
module or package scope) run on one pytest-xdist worker.

Such a fixture is built once per worker that runs a test using it, so a module whose tests
are dealt out one by one to two workers pays its minute-long fixture (a training run the
tests then read) twice. Under `--dist loadgroup` every test is dealt on its own except
those of one group, which go to one worker together; this plugin puts the tests that share
an instance in one group, and keeps the explicit `xdist_group` marks (the SLURM tests' one
cluster), merged with any instance one of their tests shares. The instances of a
parametrized module fixture are separate groups, so its parameters still spread.

pytest-xdist 3.8 names a test's group by appending `@group` to its node id on the worker
(`Item._nodeid`); pytest 9.2 keeps the id elsewhere (`Item._id`), which loses that suffix
and with it every group, explicit ones too, without a word. So the hook below sets the
suffix itself, after every other collection hook, on the attribute this pytest reads.
"""

from __future__ import annotations

from collections.abc import Generator

import pytest

SHARED_SCOPES = ("class", "module", "package")
"""Fixture scopes whose instances outlive one test (session fixtures are built once per
worker whatever the grouping, so they are left out)."""

_BASE_NODEID = pytest.StashKey[str]()


def shared_instances(item: pytest.Item) -> list[str]:
    """Names of the wider-than-a-test fixture instances `item` uses: the node that owns
    the instance, the fixture, and for a parametrized fixture its parameter's index."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:  # not a test function (a doctest, say): it requests no fixtures
        return []
    callspec = getattr(item, "callspec", None)
    names = []
    for name, fixturedefs in info.name2fixturedefs.items():
        for fixturedef in fixturedefs:
            if fixturedef.scope not in SHARED_SCOPES:
                continue
            owner = _owner(item, fixturedef.scope, fixturedef.baseid)
            index = None
            if callspec is not None and fixturedef.params is not None:
                index = callspec.indices.get(name)
            names.append(f"{owner}::{name}" + ("" if index is None else f"#{index}"))
    return names


def _owner(item: pytest.Item, scope: str, baseid: str) -> str:
    """The node id of what one instance of a fixture of `scope` belongs to."""
    if scope == "package":
        return baseid or "."  # the directory of the conftest that defines it
    if scope == "class" and (cls := item.getparent(pytest.Class)) is not None:
        return cls.nodeid
    module = item.getparent(pytest.Module)
    return module.nodeid if module is not None else item.nodeid


def explicit_groups(item: pytest.Item) -> list[str]:
    """The groups `xdist_group` marks name, as pytest-xdist reads them."""
    return [
        str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
        for mark in item.iter_markers("xdist_group")
    ]


def assign_groups(items: list[pytest.Item]) -> dict[int, str]:
    """index in `items` -> group, for the tests that must share a worker.

    Tests are joined when they share an instance or an explicit group, transitively. A
    group with explicit names keeps them (joined by "_", as pytest-xdist joins a test's
    several groups); one without is named by its first instance. Group names hold no "@"
    nor "]": pytest-xdist finds the group after the last "@" that follows every "]"."""
    parent: dict[str, str] = {}

    def root(key: str) -> str:
        while parent[key] != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    keys_of: dict[int, list[str]] = {}
    for index, item in enumerate(items):
        keys = [f"@{name}" for name in explicit_groups(item)] + shared_instances(item)
        if not keys:
            continue
        keys_of[index] = keys
        for key in keys:
            parent.setdefault(key, key)
            parent[root(key)] = root(keys[0])

    members: dict[str, set[str]] = {}
    for key in parent:
        members.setdefault(root(key), set()).add(key)
    names = {}
    for top, keys in members.items():
        explicit = sorted(key[1:] for key in keys if key.startswith("@"))
        name = "_".join(explicit) if explicit else min(keys)
        names[top] = name.replace("@", "_").replace("]", "_")
    return {index: names[root(keys[0])] for index, keys in keys_of.items()}


def _set_nodeid(item: pytest.Item, nodeid: str) -> None:
    if hasattr(item, "_id"):  # pytest >= 9.2: a structured id behind Item.nodeid
        item._id = type(item._id).parse(nodeid)  # type: ignore[attr-defined]
    else:
        item._nodeid = nodeid  # type: ignore[attr-defined]


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> Generator[None, None, None]:
    for item in items:
        item.stash[_BASE_NODEID] = item.nodeid
    # Every other collection hook first: the conftests' explicit marks, pytest-xdist's own
    # suffix (replaced below, where it took).
    yield
    if not getattr(config.option, "loadgroup", False):  # set on loadgroup's workers only
        return
    for index, group in assign_groups(items).items():
        item = items[index]
        _set_nodeid(item, f"{item.stash[_BASE_NODEID]}@{group}")
        assert item.nodeid.endswith(f"@{group}"), (item.nodeid, group)
