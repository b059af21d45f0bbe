"""bench/init_memory.py builds a sharded model on two ranks and reports each rank's memory
(the figures are read by hand, see docs/performance.md; none is asserted here)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).parents[2]


def test_the_init_memory_bench_reports_every_rank():
    proc = subprocess.run(
        [sys.executable, "bench/init_memory.py", "--model.vocab_size=4096", "--model.dim=256"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    header, *rows = proc.stdout.splitlines()
    assert header.split()[:2] == ["rank", "peak"]
    assert [row.split()[0] for row in rows] == ["0", "1"]
    for row in rows:
        # Half of each parameter per rank; the largest whole one is the 4096 x 256 head.
        peak, shards, largest = (int(cell) for cell in row.split()[1:])
        assert peak > 0 and shards > 0 and largest == 4
