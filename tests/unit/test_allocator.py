"""The allocator plan: which library is preloaded or how glibc is tuned, and the errors."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import pytest

from kempnerforge.config.train import TrainConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.launch.allocator import (
    ALLOCATOR_ENV,
    PRELOADED_ENV,
    AllocatorPlan,
    describe_allocator,
    find_library,
    is_glibc,
    needs_restart,
    plan_allocator,
)


def real_shared_library() -> str:
    """A preloadable library every glibc system has (glibc's malloc debugging shim)."""
    found = sorted(
        glob.glob("/usr/lib/*/libc_malloc_debug.so.0") + glob.glob("/lib*/libc_malloc_debug.so.0")
    )
    assert found, "glibc's libc_malloc_debug.so.0 not found"
    return found[0]


@pytest.fixture(autouse=True)
def no_env_override(monkeypatch):
    monkeypatch.delenv(ALLOCATOR_ENV, raising=False)
    monkeypatch.delenv(PRELOADED_ENV, raising=False)


def test_auto_takes_tcmalloc_where_it_is_installed(tmp_path):
    library = tmp_path / "libtcmalloc_minimal.so.4"
    shutil.copy(real_shared_library(), library)
    plan = plan_allocator("auto", dirs=[str(tmp_path / "empty"), str(tmp_path)])
    assert plan == AllocatorPlan("tcmalloc", str(library), plan.reason)
    assert find_library("jemalloc", [str(tmp_path)]) is None


def test_auto_without_tcmalloc_tunes_glibc_and_says_how_to_install_it(tmp_path):
    plan = plan_allocator("auto", dirs=[str(tmp_path)])
    assert plan.library is None
    assert plan.name == ("glibc" if is_glibc() else "system")
    assert "tcmalloc not installed" in plan.reason or not is_glibc()
    assert "libtcmalloc-minimal4" in describe_allocator(plan) or not is_glibc()


def test_a_named_allocator_that_is_missing_is_a_config_error_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.allocator.*jemalloc.*not found.*libjemalloc2"):
        plan_allocator("jemalloc", dirs=[str(tmp_path)])
    with pytest.raises(ConfigError, match=r"train\.allocator.*no such file"):
        plan_allocator(str(tmp_path / "libnothing.so"))


def test_the_environment_variable_wins_and_is_named_in_its_errors(monkeypatch, tmp_path):
    monkeypatch.setenv(ALLOCATOR_ENV, "system")
    assert plan_allocator("auto", dirs=[str(tmp_path)]).name == "system"
    monkeypatch.setenv(ALLOCATOR_ENV, "tcmalloc2")
    with pytest.raises(ConfigError, match=ALLOCATOR_ENV):
        plan_allocator("auto")
    library = real_shared_library()
    monkeypatch.setenv(ALLOCATOR_ENV, library)
    plan = plan_allocator("system")
    assert (plan.name, plan.library) == ("library", library)
    assert ALLOCATOR_ENV in plan.reason


def test_the_config_field_takes_names_and_paths_only():
    TrainConfig(allocator="/opt/lib/libtcmalloc.so")
    TrainConfig(allocator="glibc")
    with pytest.raises(ConfigError, match="train.allocator"):
        TrainConfig(allocator="tcmalloc_minimal")


def test_a_restart_happens_once(monkeypatch):
    plan = AllocatorPlan("library", real_shared_library())
    assert needs_restart(plan)  # not mapped into this test process
    monkeypatch.setenv(PRELOADED_ENV, plan.library or "")
    assert not needs_restart(plan)  # the restarted process does not restart again
    assert not needs_restart(AllocatorPlan("glibc"))


def test_glibc_accepts_the_tuning():
    if not is_glibc():
        pytest.skip("glibc only")
    code = "from kempnerforge.launch.allocator import tune_glibc; assert tune_glibc()"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ})
