"""A save that fails for real on one rank of two: every rank agrees, nothing is committed,
training goes on, and too many failures in a row stop the run."""

from __future__ import annotations

import os

import pytest
from torch.multiprocessing import ProcessRaisedException

from tests.support.dist import run_distributed
from tests.support.faults import FSIZE_FROM_ENV, FSIZE_RANK_ENV, FSIZE_UNTIL_ENV
from tests.support.metrics_rows import events
from tests.support.tiny import tiny_run
from tests.support.train_run import train_on_ranks

pytestmark = pytest.mark.distributed

HOOK = "--train.hooks=['tests.support.faults:FileSizeLimit']"


def _run(tmp_path, token_dirs, monkeypatch, *extra: str) -> list[dict]:
    # Rank 1's writes are limited after steps 2 and 4, and free again after step 6.
    monkeypatch.setenv(FSIZE_RANK_ENV, "1")
    monkeypatch.setenv(FSIZE_FROM_ENV, "2,4")
    monkeypatch.setenv(FSIZE_UNTIL_ENV, "6")
    overrides = tiny_run(
        tmp_path / "run",
        token_dirs,
        "--train.max_steps=8",
        "--checkpoint.interval=2",
        HOOK,
        *extra,
    )
    return run_distributed(train_on_ranks, 2, overrides, {})


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_save_that_fails_on_one_rank_is_reported_and_training_goes_on(
    tmp_path, token_dirs, monkeypatch, mode
):
    ranks = _run(tmp_path, token_dirs, monkeypatch, f"--checkpoint.async_mode={mode}")
    assert [r["step"] for r in ranks] == [8, 8]
    run = tmp_path / "run"
    failed = events(run, "checkpoint_failed")
    assert [e["step"] for e in failed] == [2, 4]
    assert [e["in_a_row"] for e in failed] == [1, 2]
    for event in failed:
        assert event["path"] == str(run / "checkpoints" / f"step_{event['step']}")
        # Every rank reports the failure as rank 1, whose own write saw the EFBIG.
        assert event["reason"].startswith("rank 1: "), event["reason"]
        assert "[Errno 27] File too large" in event["reason"], event["reason"]
        assert "bytes_free" not in event  # not a full disk
    # A background save's "checkpoint" event marks its start; its commit has an event too.
    committed = events(run, "checkpoint_committed" if mode == "async" else "checkpoint")
    assert [e["step"] for e in committed] == [6, 8]
    # Nothing of the failed saves is left, and latest moved only with the good ones.
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step_6", "step_8"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_8"


def test_max_failed_saves_in_a_row_stop_the_run_naming_the_field(tmp_path, token_dirs, monkeypatch):
    with pytest.raises(ProcessRaisedException) as error:
        _run(tmp_path, token_dirs, monkeypatch, "--checkpoint.max_failed_saves=2")
    text = str(error.value)
    assert (
        "2 checkpoint saves in a row failed (checkpoint.max_failed_saves = 2), the last: " in text
    )
    assert "writing checkpoint step_4 into" in text
    assert [e["step"] for e in events(tmp_path / "run", "checkpoint_failed")] == [2, 4]
    assert not (tmp_path / "run" / "checkpoints" / "latest").exists()
