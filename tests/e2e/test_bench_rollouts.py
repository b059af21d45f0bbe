"""bench/rollouts.py samples every completion to its length and reports the rate (timings
are read by hand, never asserted)."""

from __future__ import annotations

import json

import pytest

from tests.support.cli import run_python

pytestmark = pytest.mark.slow


def test_the_rollout_bench_samples_every_completion():
    shape = ["--prompts=2", "--group=3", "--prompt-len=8", "--max-new-tokens=5", "--rounds=1"]
    proc = run_python("bench/rollouts.py", *shape, "--rows-per-forward=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["rows"] == 6 and report["tokens_per_round"] == 6 * 5
    assert report["tokens_per_s"] > 0 and len(report["seconds"]) == 1
