"""bench/generate.py runs and checks that both decoders agree (timings are read by hand,
never asserted)."""

from __future__ import annotations

import pytest

from tests.support.cli import run_python

pytestmark = pytest.mark.slow


def test_the_generation_bench_times_both_decoders():
    sizes = ["--dim=64", "--layers=2", "--new-tokens=16", "--rounds=1", "--prompt-tokens=8"]
    proc = run_python("bench/generate.py", *sizes)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith(("cache", "no"))]
    assert [row[0] for row in rows] == ["cache", "no"]
