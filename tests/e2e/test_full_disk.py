"""End to end: a disk that fills during an async-mode run. The run goes on past the saves
it cannot make and stops at the first metrics row it cannot write, with one line and no
traceback, whichever of the two writes fails first.

Two real tmpfs file systems, mounted for the run in a mount namespace: the checkpoint
directory's and the run directory's (metrics.jsonl). The FillDisk hook fills them after
step 1's row, before the first save starts: every later write there that needs a new block
fails with ENOSPC, and metrics.jsonl's last block is padded full, so its very next write
fails. The order of the failures follows from that, not from timing:

- "save fails first": the checkpoint disk also has no inode left, so the save fails at
  once (its step_<N>.tmp cannot be made), with nothing in flight, and the metrics write
  that fails is its checkpoint_failed event;
- "save in flight fails": the save starts, its background write fails, and the run stops
  on its checkpoint event while it is in flight, then finds that it failed too;
- "save in flight commits": the checkpoint disk has room, the save in flight commits
  while the run stops, and its checkpoint_committed event cannot be written.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.faults import FILL_ENV
from tests.support.metrics_rows import read_rows
from tests.support.small_disks import on_small_disks, require_small_disks
from tests.support.tiny import tiny_run

pytestmark = pytest.mark.slow

REPO = Path(__file__).parents[2]
DEBUG = str(REPO / "configs" / "train" / "debug.toml")

ORDERS = {
    "save fails first": "1:CKPT:inodes 1:RUN:pad=run/metrics.jsonl",
    "save in flight fails": "1:CKPT 1:RUN:pad=run/metrics.jsonl",
    "save in flight commits": "1:RUN:pad=run/metrics.jsonl",
}
"""FillDisk's entries for each order: the step after which each disk is filled."""


def _run_on_full_disks(
    tmp_path: Path, token_dirs: tuple[str, str], fill: str
) -> tuple[subprocess.CompletedProcess, Path]:
    ckpt_disk, run_disk, kept = tmp_path / "ckpt-disk", tmp_path / "run-disk", tmp_path / "kept"
    for path in (ckpt_disk, run_disk, kept):
        path.mkdir()
    run_dir, ckpt_dir = run_disk / "run", ckpt_disk / "ckpt"
    train = [
        sys.executable, "-m", "kempnerforge", "train", DEBUG,
        *tiny_run(run_dir, token_dirs, "--model.n_kv_heads=2", "--eval.interval=0"),
        "--train.max_steps=20",  # it stops after step 1, on the first metrics write
        f"--checkpoint.dir={ckpt_dir}",
        "--checkpoint.async_mode=async",
        "--checkpoint.interval=1",
        "--checkpoint.keep_last_n=2",
        "--checkpoint.max_failed_saves=1000",  # it stops on the metrics row, not on these
        "--train.hooks=['tests.support.faults:FillDisk']",
    ]  # fmt: skip
    command = on_small_disks(
        # The checkpoint disk holds a few saves of the tiny model (0.5 MB each).
        {ckpt_disk: "size=8m,nr_inodes=1000", run_disk: "size=1m"},
        train,
        keep={run_dir / "metrics.jsonl": kept / "metrics.jsonl", ckpt_dir / "latest": kept},
    )
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        FILL_ENV: fill.replace("CKPT", str(ckpt_disk)).replace("RUN", str(run_disk)),
    }
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    return done, kept


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_a_full_disk_in_async_mode_stops_with_one_line_whichever_write_fails_first(
    tmp_path, token_dirs, order
):
    require_small_disks()
    done, kept = _run_on_full_disks(tmp_path, token_dirs, ORDERS[order])
    metrics = tmp_path / "run-disk" / "run" / "metrics.jsonl"
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-5000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("kempnerforge:")]
    assert errors == [f"kempnerforge: error: {metrics}: No space left on device"], done.stderr
    rows = read_rows(kept, live=True)  # the failed write left at most a torn row
    assert [r["step"] for r in rows if "loss" in r] == [1]  # the first write after step 1
    # The launch's start event (goodput's account), then the padding the test wrote.
    assert [r.get("event") for r in rows if "loss" not in r] == ["start", "test_padding"]
    background = f"saving checkpoint {tmp_path / 'ckpt-disk' / 'ckpt' / 'step_1'} in the background"
    drained = [line for line in done.stderr.splitlines() if "the checkpoint in flight" in line]
    if order == "save fails first":
        assert background not in done.stderr and not drained, done.stderr
        assert not (kept / "latest").exists()
    elif order == "save in flight fails":
        assert background in done.stderr, done.stderr
        assert len(drained) == 1, done.stderr
        assert (
            "was not saved either" in drained[0]
            and "background write of checkpoint step_1" in drained[0]
        )
        assert not (kept / "latest").exists()
    else:
        assert len(drained) == 1 and "was committed" in drained[0], done.stderr
        assert (kept / "latest").read_text().strip() == "step_1"
