"""bench/attention.py and bench/context_parallel.py run every path they document, at tiny
lengths (their figures are read by hand into docs/performance.md, never asserted here)."""

from __future__ import annotations

import json

import pytest

from tests.support.cli import run_python

pytestmark = pytest.mark.slow


def json_rows(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_the_attention_bench_times_each_kernel_of_a_packed_step():
    proc = run_python(
        "bench/attention.py",
        "--seq=512",
        "--doc-len=100",
        "--layers=1",
        "--paths=rules,dense,causal",
        "--steps=1",
        "--warmup=0",
        "--threads=1",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [row for row in json_rows(proc.stdout) if "path" in row]
    assert [row["path"] for row in rows] == ["rules", "dense", "causal"]
    for row in rows:
        assert row["seq"] == 512 and row["tokens_per_sec"] > 0 and row["peak_memory_gib"] >= 0


@pytest.mark.parametrize("attention", ["ulysses", "ring"])
def test_the_context_parallel_bench_runs_each_part_under_each_attention(attention):
    for part in ("attention", "model"):
        proc = run_python(
            "bench/context_parallel.py",
            "--seq=256",
            "--cps=1,2",
            f"--attention={attention}",
            f"--part={part}",
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = json_rows(proc.stdout)
        assert [row["cp"] for row in rows] == [1, 2], proc.stdout
        assert all(row["tokens_per_sec"] > 0 for row in rows)
        if attention == "ring":
            assert rows[1]["ring_passes_per_pass"] > 0
        else:
            assert rows[1]["all_to_alls_per_pass"] > 0
