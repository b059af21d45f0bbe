"""The one-node SLURM cluster the tests of this folder submit to; they skip, with the
packages to install, where SLURM is absent (KEMPNERFORGE_REQUIRE_SLURM=1 makes that a
failure, as CI sets it)."""

from __future__ import annotations

import os

import pytest

from tests.support.slurm_cluster import SlurmCluster, missing, start_cluster


def pytest_collection_modifyitems(items):
    """The suite runs on several pytest-xdist workers: keep this folder's tests on one, so
    one cluster (its daemons, ports and state directory) serves them all."""
    for item in items:
        if item.path.is_relative_to(os.path.dirname(__file__)):
            item.add_marker(pytest.mark.xdist_group("slurm"))


@pytest.fixture(scope="session")
def slurm(tmp_path_factory) -> SlurmCluster:
    reason = missing()
    if reason is not None:
        if os.environ.get("KEMPNERFORGE_REQUIRE_SLURM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()
