"""Goodput accounting: every second of a run's wall time given to one cause, from rows built
by hand with the seconds each cause must get worked out beside them."""

from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path

import pytest

from kempnerforge.cli import main
from kempnerforge.commands.goodput import add_goodput_arguments, run_goodput
from kempnerforge.config.metrics import MetricsConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.metrics.goodput import (
    CAUSES,
    GoodputAccount,
    account_file,
    account_rows,
    read_account,
    resume_account,
)
from kempnerforge.metrics.tracker import MetricsTracker

# Every number below is a sum of a few binary fractions or small decimals: float addition
# of a handful of them is off by at most a few ulps of the total.
TIGHT = 1e-9


def start(step: int, started: float, at: float) -> dict:
    return {"step": step, "event": "start", "started": started, "time": at}


def train(step: int, at: float, step_time_s: float, wait: float = 0.0) -> dict:
    return {
        "step": step,
        "loss": 1.0,
        "step_time_s": step_time_s,
        "data_wait_share": wait,
        "time": at,
    }


def event(step: int, name: str, at: float, **fields: object) -> dict:
    return {"step": step, "event": name, **fields, "time": at}


def assert_seconds(rows: list[dict], total: float, **expected: float) -> None:
    report = account_rows(rows)
    assert report.total_s == pytest.approx(total, abs=TIGHT)
    for cause in CAUSES:
        assert report.seconds[cause] == pytest.approx(expected.get(cause, 0.0), abs=TIGHT), cause
    assert sum(report.seconds.values()) == pytest.approx(total, abs=TIGHT)
    assert sum(report.shares().values()) == pytest.approx(1.0, abs=TIGHT)


def test_each_cause_of_one_process_is_attributed_exactly():
    rows = [
        start(0, started=100.0, at=102.0),
        train(1, at=110.0, step_time_s=2.0, wait=0.25),  # first step began at 108: start-up 8
        {"step": 1, "eval_loss": 3.0, "eval_time_s": 3.0, "time": 113.0},
        event(1, "checkpoint", at=117.0, path="c/step_1", seconds=4.0),
        train(3, at=125.0, step_time_s=3.0),  # two steps, 6 s; 2 s of loop overhead
    ]
    assert_seconds(
        rows,
        total=25.0,
        productive=1.5 + 6.0,
        data_wait=0.5,
        startup=8.0,
        eval=3.0,
        checkpoint=4.0,
        unattributed=2.0,
    )
    assert account_rows(rows).goodput == pytest.approx(7.5 / 25.0)


def test_a_restart_counts_its_gap_its_start_up_and_the_steps_it_trains_again():
    rows = [
        start(0, started=0.0, at=1.0),
        train(1, at=5.0, step_time_s=1.0),  # start-up 4
        train(2, at=6.0, step_time_s=1.0),
        event(2, "checkpoint", at=6.5, path="c/step_2", seconds=0.5),
        train(4, at=9.0, step_time_s=1.0),  # steps 3 and 4, then the process dies
        start(2, started=20.0, at=21.0),  # 11 s since the last row
        event(2, "resume", at=25.0, path="c/step_2", tokens_seen=0),
        train(3, at=30.0, step_time_s=1.0),  # step 3 again; start-up 30 - 1 - 20 = 9
        train(5, at=32.0, step_time_s=1.0),  # step 4 again, step 5 first
    ]
    assert_seconds(
        rows,
        total=32.0,
        productive=1.0 + 1.0 + 2.0 + 1.0,
        recomputed=1.0 + 1.0,
        startup=4.0 + 9.0,
        checkpoint=0.5,
        restart_gap=11.0,
        unattributed=0.5,  # 9 - 8.5 in the first process
    )
    assert account_rows(rows).num_processes == 2


def test_a_resume_from_a_newer_memory_copy_than_the_start_event_names_trains_from_it():
    """The start event names the persistent checkpoint's step (written before the memory
    tier's newer copy is chosen); the steps up to the resumed one were read back, not
    trained: only those past it that the dead process had trained are recomputed."""
    rows = [
        start(0, started=0.0, at=1.0),
        train(10, at=12.0, step_time_s=1.0),  # start-up 2
        train(12, at=14.0, step_time_s=1.0),  # steps 11-12, then the process dies
        start(0, started=20.0, at=21.0),  # no checkpoint on disk: step 0; gap 6
        event(11, "resume", at=22.0, path="the memory tier's copy of step 11", tokens_seen=0),
        train(13, at=25.0, step_time_s=1.0),  # step 12 again, step 13 first; start-up 3
    ]
    assert_seconds(
        rows,
        total=25.0,
        productive=10.0 + 2.0 + 1.0,
        recomputed=1.0,
        startup=2.0 + 3.0,
        restart_gap=6.0,
    )


def test_a_rollback_counts_the_steps_trained_again():
    rows = [
        start(0, started=0.0, at=0.5),
        train(1, at=2.0, step_time_s=1.0),  # start-up 1
        event(1, "checkpoint", at=2.2, path="c/step_1", seconds=0.2),
        train(2, at=3.2, step_time_s=0.8),
        # Step 3 trains unlogged (interval 2), step 4 goes NaN: roll back to step 1.
        event(4, "nan_skip", at=4.5, reason="loss"),
        event(1, "nan_rollback", at=6.0, from_step=3, path="c/step_1"),
        # The tracker's interval: step 3 (first time) and step 2 again, 1 s each.
        train(2, at=8.0, step_time_s=1.0),
        train(4, at=10.0, step_time_s=0.75),  # step 3 again, step 4 first
    ]
    assert_seconds(
        rows,
        total=10.0,
        productive=1.0 + 0.8 + 1.0 + 0.75,
        recomputed=1.0 + 0.75,
        startup=1.0,
        checkpoint=0.2,
        unattributed=10.0 - 3.55 - 1.75 - 1.0 - 0.2,
    )


def test_a_replica_heal_lasts_from_the_previous_row_to_its_event():
    rows = [
        start(0, started=0.0, at=0.25),
        event(1, "replica_step", at=1.5, group=0),  # each committed step, before its row
        train(1, at=2.0, step_time_s=1.0),  # start-up 1
        event(2, "replica_step", at=2.9, group=0),  # step 2 trains, unlogged (interval 2)
        event(5, "replica_rejoined", at=6.9, group=0),  # the peers were at step 5
        event(6, "replica_step", at=7.5, group=0),
        train(6, at=7.75, step_time_s=0.5),  # the tracker's interval: steps 2 and 6
    ]
    assert_seconds(
        rows,
        total=7.75,
        productive=1.0 + 1.0,
        startup=1.0,
        replica_heal=4.0,
        unattributed=0.75,
    )


def test_a_relaunched_replica_group_joining_its_peers_counts_its_steps_from_theirs():
    rows = [
        start(0, started=0.0, at=0.5),
        event(40, "replica_joined", at=2.0, group=1),  # the peers were at step 40
        event(41, "replica_step", at=3.5, group=1),
        train(41, at=4.0, step_time_s=1.0),  # start-up 4 - 1 - 0 = 3, the join included
    ]
    assert_seconds(rows, total=4.0, productive=1.0, startup=3.0)


def test_a_process_stopped_during_its_build_is_all_start_up():
    rows = [
        start(0, started=0.0, at=0.5),
        train(1, at=2.0, step_time_s=1.0),
        start(1, started=10.0, at=12.0),
        event(1, "shutdown", at=13.0, signal="SIGTERM"),
    ]
    assert_seconds(rows, total=13.0, productive=1.0, startup=1.0 + 3.0, restart_gap=8.0)


def test_a_run_from_another_runs_weights_counts_its_steps_from_0():
    rows = [
        start(30, started=0.0, at=0.5),  # planned from a step-30 checkpoint's weights
        event(0, "load_weights", at=0.75, path="other/step_30"),
        train(1, at=2.0, step_time_s=1.0),
        train(3, at=4.0, step_time_s=1.0),  # steps 2 and 3
    ]
    assert_seconds(rows, total=4.0, productive=3.0, startup=1.0)


def test_a_file_without_start_events_counts_a_resume_as_a_restart():
    rows = [
        train(1, at=2.0, step_time_s=1.0),  # the run began when this step did
        train(2, at=3.0, step_time_s=1.0),
        event(1, "resume", at=10.0, path="c/step_1"),  # start-up unknown: in the gap
        train(2, at=11.0, step_time_s=1.0),
    ]
    assert_seconds(rows, total=10.0, productive=2.0, recomputed=1.0, restart_gap=7.0)


def write(path: Path, rows: list[dict], tail: str = "") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return path / "metrics.jsonl"


def test_a_torn_last_line_is_skipped(tmp_path):
    rows = [start(0, 0.0, 0.5), train(1, 2.0, 1.0), train(2, 3.0, 1.0)]
    torn = write(tmp_path / "torn", rows, tail='{"step": 3, "loss": 1.0, "step_ti')
    assert account_file(torn) == account_rows(rows)
    unended = write(tmp_path / "unended", rows)
    unended.write_text(unended.read_text().rstrip("\n"))  # a last row without its newline
    assert account_file(unended) == account_rows(rows)


class CountedRow(dict):
    """A row that counts how many rows are alive at once."""

    alive = 0
    most_alive = 0

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        CountedRow.alive += 1
        CountedRow.most_alive = max(CountedRow.most_alive, CountedRow.alive)

    def __del__(self) -> None:
        CountedRow.alive -= 1


def test_a_million_rows_are_accounted_in_one_pass_holding_no_row():
    num_rows = 1_000_000
    made = 0

    def rows():
        nonlocal made
        yield CountedRow(start(0, started=0.0, at=0.0))
        for step in range(1, num_rows):
            made += 1
            yield CountedRow(train(step, at=float(step), step_time_s=0.5))

    report = account_rows(rows())
    assert made == num_rows - 1 and report.num_rows == num_rows
    assert report.seconds["productive"] == 0.5 * (num_rows - 1)  # exact: halves of integers
    assert report.seconds["startup"] == 0.5
    # The account keeps numbers, never rows: at most the row being read and the one the
    # generator is building are alive at once, however long the file.
    assert CountedRow.most_alive <= 2 and CountedRow.alive == 0


def test_the_tracker_writes_the_running_goodput_and_continues_it_after_a_restart(
    tmp_path, monkeypatch
):
    clocks = {"perf": 0.0, "wall": 1000.0}
    monkeypatch.setattr(time, "perf_counter", lambda: clocks["perf"])
    monkeypatch.setattr(time, "time", lambda: clocks["wall"])

    def tick(seconds: float) -> None:
        clocks["perf"] += seconds
        clocks["wall"] += seconds

    def launch() -> MetricsTracker:
        cfg = MetricsConfig(log_interval=1, progress="off")
        return MetricsTracker(cfg, str(tmp_path), max_steps=10, stream=io.StringIO())

    def step(tracker: MetricsTracker, n: int) -> dict:
        tracker.start_step()
        tick(1.0)
        row = tracker.end_step(n, loss=1.0, grad_norm=1.0, lr=1e-3, tokens=1, tokens_seen=n)
        assert row is not None
        return row

    started = clocks["wall"]
    with launch() as tracker:
        tick(3.0)
        tracker.log_event(0, "start", started=started)
        assert step(tracker, 1)["goodput"] == 1.0 / 4.0
        assert step(tracker, 2)["goodput"] == 2.0 / 5.0
    tick(5.0)
    with launch() as tracker:  # a new process: the account is read back from the file
        tracker.log_event(2, "start", started=clocks["wall"])
        tick(1.0)
        assert step(tracker, 3)["goodput"] == 3.0 / 12.0
    assert account_file(tmp_path / "metrics.jsonl").seconds["restart_gap"] == 5.0


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_goodput_arguments(parser)
    return parser.parse_args(argv)


def test_the_command_prints_the_table_or_json_and_a_bad_directory_exits_2(tmp_path, capsys):
    rows = [start(0, 0.0, 0.5), train(1, 2.0, 1.0), train(2, 4.0, 2.0)]
    write(tmp_path / "run", rows)
    assert main(["goodput", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert all(cause in out for cause in CAUSES)
    assert "goodput: 75.00%" in out  # 3 of 4 s
    assert main(["goodput", str(tmp_path / "run"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["goodput"] == 0.75 and data["total_s"] == 4.0
    assert data["causes"]["startup"] == {"seconds": 1.0, "share": 0.25}

    assert main(["goodput", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "nowhere") in err and "Traceback" not in err
    with pytest.raises(ConfigError):
        run_goodput(parse(str(tmp_path / "run")), ["--train.seed=1"])


def test_an_account_fed_row_by_row_equals_the_report_of_the_file(tmp_path):
    rows = [start(0, 0.0, 0.5), train(1, 2.0, 1.0, 0.5), event(1, "checkpoint", 2.5, seconds=0.5)]
    account = GoodputAccount()
    for row in rows:
        account.add(row)
    assert account.report() == account_file(write(tmp_path, rows))


def test_a_new_launch_restores_the_account_from_the_files_end(tmp_path):
    rows = [start(0, 0.0, 0.5)] + [train(s, 1.0 + s, 1.0) for s in range(1, 2001)]
    path = write(tmp_path, rows)
    assert resume_account(path).report() == account_file(path)  # no state yet: read whole
    state = account_rows(rows)  # the state the checkpoint row carries, as the tracker writes it
    account = GoodputAccount()
    for row in rows:
        account.add(row)
    saved = event(2000, "checkpoint", 2001.5, seconds=0.25)
    account.add(saved)
    saved["goodput_state"] = account.state_dict()
    after = [train(2001, 2003.0, 1.0), train(2002, 2004.0, 1.0)]
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in [saved, *after])
    assert resume_account(path).report() == account_file(path)
    assert resume_account(path).report().seconds["productive"] == 2002.0
    assert state.seconds["productive"] == 2000.0
    # The rows before the state are never read: changing them changes nothing.
    text = path.read_text().replace('"step_time_s": 1.0', '"step_time_s": 9.0', 1500)
    path.write_text(text)
    assert resume_account(path).report().seconds["productive"] == 2002.0
    assert account_file(path).seconds["productive"] > 2002.0


def test_a_device_standing_in_for_the_metrics_file_is_not_read(tmp_path):
    """A metrics.jsonl linked to /dev/full (the full-disk tests) or /dev/zero has no end:
    the account starts empty instead of reading forever."""
    for device in ("/dev/full", "/dev/zero"):
        path = tmp_path / f"metrics-{device.rsplit('/', 1)[-1]}.jsonl"
        path.symlink_to(device)
        assert resume_account(path).report().total_s == 0
        assert read_account(path).report().total_s == 0
