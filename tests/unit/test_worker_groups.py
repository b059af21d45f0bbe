"""tests/support/worker_groups.py under real pytest-xdist: a small suite run on two workers
builds each class, module and package fixture instance once, keeps an explicit group (one
a conftest adds, as tests/slurm/ does) on one worker, and leaves tests that share nothing
ungrouped, dealt out one by one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("xdist")

ROOT = Path(__file__).resolve().parents[2]

BUILD = """
import os

def built(name):
    with open(os.environ["BUILT_LOG"], "a") as f:
        f.write(f"{name} {os.environ['PYTEST_XDIST_WORKER']}\\n")
"""

FILES = {
    "conftest.py": 'pytest_plugins = ["tests.support.worker_groups"]\n',
    "build.py": BUILD,
    "test_module_fixture.py": """
        import pytest
        from build import built

        @pytest.fixture(scope="module")
        def trained():
            built("trained")

        @pytest.mark.parametrize("i", range(6))
        def test_reads(trained, i):
            pass

        def test_needs_nothing():
            pass
        """,
    "test_layouts.py": """
        import pytest
        from build import built

        @pytest.fixture(scope="module", params=["fsdp", "tp"])
        def layout(request):
            built(f"layout-{request.param}")

        @pytest.mark.parametrize("i", range(3))
        def test_layout(layout, i):
            pass
        """,
    "test_class_fixture.py": """
        import pytest
        from build import built

        class TestShared:
            @pytest.fixture(scope="class")
            def model(self):
                built("model")

            @pytest.mark.parametrize("i", range(4))
            def test_model(self, model, i):
                pass
        """,
    "test_plain.py": """
        import pytest

        @pytest.mark.parametrize("i", range(6))
        def test_plain(i):
            pass
        """,
    "pkg/__init__.py": "",
    "pkg/conftest.py": """
        import pytest
        from build import built

        @pytest.fixture(scope="package")
        def server():
            built("server")
        """,
    "pkg/test_a.py": """
        import pytest

        @pytest.mark.parametrize("i", range(3))
        def test_a(server, i):
            pass
        """,
    "pkg/test_b.py": """
        import pytest

        @pytest.mark.parametrize("i", range(3))
        def test_b(server, i):
            pass
        """,
    "cluster/conftest.py": """
        import os
        import pytest

        def pytest_collection_modifyitems(items):
            for item in items:
                if item.path.is_relative_to(os.path.dirname(__file__)):
                    item.add_marker(pytest.mark.xdist_group("cluster"))
        """,
    "cluster/test_jobs.py": """
        import pytest
        from build import built

        @pytest.fixture(scope="module")
        def job():
            built("job")

        @pytest.mark.parametrize("i", range(3))
        def test_job(job, i):
            pass

        @pytest.mark.parametrize("i", range(3))
        def test_submit(i):
            pass
        """,
}


def test_shared_fixtures_are_built_once_and_the_rest_spread(tmp_path):
    for name, text in FILES.items():
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(textwrap.dedent(text))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    log = tmp_path / "built.log"
    env = {
        **os.environ,
        "BUILT_LOG": str(log),
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)]),
        # Only xdist: the other installed plugins (hypothesis, anyio...) cost start-up time
        # in each of the three processes and take no part.
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "xdist.plugin", "-p", "no:cacheprovider"]
        + ["-n", "2", "--dist", "loadgroup", "-v"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr

    built = Counter(line.split()[0] for line in log.read_text().splitlines())
    want = ["trained", "layout-fsdp", "layout-tp", "model", "server", "job"]
    assert built == Counter(want), built

    # "[gw0] [ 10%] PASSED test_x.py::test[0]@group": which worker ran each test, in
    # which group (none: dealt out on its own).
    ran = re.findall(r"\[(gw\d)\] \[ *\d+%\] PASSED (\S+?)(?:@(\S+))?\s*$", result.stdout, re.M)
    assert len(ran) == 35, result.stdout
    groups: dict[str, set[str]] = {}
    for worker, nodeid, group in ran:
        module = nodeid.split("::")[0]
        groups.setdefault(group or f"none: {module}", set()).add(worker)
        if module == "test_plain.py" or "needs_nothing" in nodeid:
            assert not group, f"{nodeid} shares nothing, yet is grouped as {group}"
        if module.startswith("cluster/"):
            assert group == "cluster", nodeid
    # Each group ran on one worker; the module fixture's two params are two groups.
    for group, workers in groups.items():
        if not group.startswith("none"):
            assert len(workers) == 1, (group, workers)
    layouts = {g for g in groups if g.startswith("test_layouts.py")}
    assert len(layouts) == 2, groups
