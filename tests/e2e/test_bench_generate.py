"""bench/generate.py runs and checks that both decoders agree (timings are read by hand,
never asserted)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).parents[2]


def test_the_generation_bench_times_both_decoders():
    proc = subprocess.run(
        [
            sys.executable,
            "bench/generate.py",
            "--dim=64",
            "--layers=2",
            "--new-tokens=16",
            "--rounds=1",
            "--prompt-tokens=8",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith(("cache", "no"))]
    assert [row[0] for row in rows] == ["cache", "no"]
