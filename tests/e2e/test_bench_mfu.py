"""bench/mfu.py still runs on the package's build path and prints one JSON line (its
numbers are measured by hand, see docs/performance.md; no timing is asserted here)."""

from __future__ import annotations

import json

import pytest

from tests.support.cli import REPO, run_python

pytestmark = pytest.mark.slow


def test_mfu_bench_prints_one_json_line_of_results(builtin_cache):
    proc = run_python(
        str(REPO / "bench" / "mfu.py"),
        "--preset=debug",
        "--seq-len=32",
        "--batch-size=2",
        "--steps=2",
        "--warmup=1",
        "--ac=full",
        "--fused-optimizer",
        "--model.n_layers=2",  # any --section.field=value overrides the preset
        env_extra={"KEMPNERFORGE_CACHE": str(builtin_cache)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["world_size"] == 1 and result["steps"] == 2 and result["seq_len"] == 32
    assert result["ac"] == "full" and result["optimizer"] == "adamw/fused"
    assert result["tokens_per_sec"] > 0 and result["peak_memory_gib"] > 0
    assert result["global_batch_size"] == 2 and result["params"] < 3_542_784
    if result["device"] == "cpu":
        assert result["mfu"] is None and result["precision"] == "fp32"
