"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import pathlib

import pytest


@pytest.fixture(scope="session")
def builtin_cache(tmp_path_factory) -> pathlib.Path:
    """One KEMPNERFORGE_CACHE for the whole session: the built-in corpus, which every run of
    configs/train/debug.toml without data.path reads, is prepared once, not once per module."""
    return tmp_path_factory.mktemp("builtin-cache")


E2E_TIMEOUT_S = 900
"""Per-test limit for end-to-end tests: a 2-core machine twice as loaded as CI's must still
pass, so it is several times the slowest test's time on an idle machine (about 90 s); a
subprocess a test starts gets a shorter limit of its own, so a hang fails with its output."""


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/e2e/" in str(item.fspath) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S))
