"""bench/moe.py runs its layer comparison (timings are read by hand, never asserted)."""

from __future__ import annotations

import pytest

from tests.support.cli import run_python

pytestmark = pytest.mark.slow


def test_the_moe_layer_bench_times_every_expert_compute():
    proc = run_python("bench/moe.py", "--no-training", "--layer-repeats=1", "--seq-len=32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith(("even", "sk"))]
    assert [row[0] for row in rows] == ["even", "skewed"]
    for row in rows:
        assert len(row) == 5 and all(float(cell) > 0 for cell in row[1:])
    # The skewed router really is skewed, so the padded matmul's waste shows.
    assert float(rows[1][1]) > float(rows[0][1])
