"""bench/prepare_data.py runs and prints its figures (no timing is asserted here)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

BENCH = pathlib.Path(__file__).parents[2] / "bench" / "prepare_data.py"


def test_the_prepare_data_bench_prints_one_line_per_setting():
    args = ["--mb=0.2", "--repeats=1", "--vocab=400", "--worker-counts", "2"]
    proc = subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    assert [row["workers"] for row in rows] == ["1", "1, TOKENIZERS_PARALLELISM=false", "2"]
    assert len({row["tokens"] for row in rows}) == 1  # the same corpus for every setting
    for row in rows:
        assert row["tokens"] > 0 and row["tokens_per_sec"] > 0 and row["tokens_per_cpu_sec"] > 0
