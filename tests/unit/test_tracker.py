"""MetricsTracker: log cadence, interval averages, metrics.jsonl rows, console modes."""

from __future__ import annotations

import io
import json
import logging
import math
import re
import sys
import time

import pytest

from kempnerforge.config.metrics import MetricsConfig
from kempnerforge.core.logging import configure_logging, get_live_line, get_logger
from kempnerforge.core.metrics_file import iter_rows, read_rows
from kempnerforge.metrics.tracker import MEMORY_KEYS, METRICS_FILE, STEP_KEYS, MetricsTracker


class Clock:
    """A perf_counter that only moves when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(time, "perf_counter", fake)
    monkeypatch.setenv("COLUMNS", "200")
    return fake


def make_tracker(tmp_path, interval=10, progress="plain", max_steps=1000, stream=None, **kw):
    cfg = MetricsConfig(log_interval=interval, progress=progress)
    stream = stream if stream is not None else io.StringIO()
    return MetricsTracker(cfg, str(tmp_path), max_steps=max_steps, stream=stream, **kw)


def step(tracker, clock, n, *, dt=1.0, tokens=100, loss=3.0, **kw):
    """Run one timed step of `dt` seconds through the tracker."""
    tracker.start_step()
    clock.now += dt
    args = dict(loss=loss, grad_norm=0.5, lr=1e-3, tokens=tokens, tokens_seen=tokens * n)
    args.update(kw)
    return tracker.end_step(n, **args)


def strict_rows(path) -> list[dict]:
    """Every line of metrics.jsonl parsed as strict JSON (NaN/Infinity rejected)."""
    return read_rows(path, strict=True)


def render(text: str) -> list[str]:
    """What a terminal shows after `text`: honours \\r, \\n and erase-to-end-of-line."""
    lines, col, i = [""], 0, 0
    while i < len(text):
        if text.startswith("\x1b[K", i):
            lines[-1] = lines[-1][:col]
            i += 3
            continue
        char = text[i]
        if char == "\r":
            col = 0
        elif char == "\n":
            lines.append("")
            col = 0
        else:
            line = lines[-1].ljust(col)
            lines[-1] = line[:col] + char + line[col + 1 :]
            col += 1
        i += 1
    return lines[:-1] if lines[-1] == "" else lines


def test_logs_first_step_every_interval_and_last_step(tmp_path, clock):
    with make_tracker(tmp_path, interval=10, max_steps=25) as tracker:
        logged = [n for n in range(1, 26) if step(tracker, clock, n) is not None]
    assert logged == [1, 10, 20, 25]
    assert [row["step"] for row in strict_rows(tmp_path / METRICS_FILE)] == logged


def test_resumed_tracker_logs_the_first_step_it_sees(tmp_path, clock):
    with make_tracker(tmp_path, interval=10, max_steps=1000) as tracker:
        logged = [n for n in range(501, 522) if step(tracker, clock, n) is not None]
    assert logged == [501, 510, 520]


def test_throughput_and_step_time_average_over_the_interval(tmp_path, clock):
    with make_tracker(tmp_path, interval=4) as tracker:
        first = step(tracker, clock, 1, dt=10.0, tokens=50, loss=9.0)
        step(tracker, clock, 2, dt=1.0, tokens=100, loss=3.0)
        step(tracker, clock, 3, dt=2.0, tokens=100, loss=2.0)
        row = step(tracker, clock, 4, dt=3.0, tokens=400, loss=1.0)
    assert first["tokens_per_sec"] == 5.0
    assert row["tokens_per_sec"] == 600 / 6.0
    assert row["step_time_s"] == 2.0
    assert row["loss"] == 1.0  # the current step's loss ...
    assert row["loss_avg"] == 2.0  # ... and the mean over the interval
    assert row["tokens_seen"] == 400 * 4


def test_time_outside_start_and_end_is_not_counted(tmp_path, clock):
    with make_tracker(tmp_path, interval=2) as tracker:
        step(tracker, clock, 1, dt=1.0)
        clock.now += 50.0  # eval or a checkpoint between steps
        row = step(tracker, clock, 2, dt=1.0, tokens=300)
    assert row["step_time_s"] == 1.0
    assert row["tokens_per_sec"] == 300.0


def test_rows_are_json_with_the_documented_keys(tmp_path, clock):
    import torch

    with make_tracker(
        tmp_path,
        interval=1,
        flops_per_token=6e9,
        peak_flops_per_sec=1e15,
        device=torch.device("cpu"),
    ) as t:
        step(t, clock, 1, dt=2.0, tokens=1000, extra={"loss/web": 2.5})
    (row,) = strict_rows(tmp_path / METRICS_FILE)
    cpu_keys = [k for k in STEP_KEYS if not k.startswith("cuda_")]
    assert list(row) == [*cpu_keys, "loss/web"]
    assert row["host_rss_gib"] > 0
    assert row["mfu"] == pytest.approx(500 * 6e9 / 1e15)
    assert row["loss/web"] == 2.5
    assert abs(row["time"] - time.time()) < 60


def test_mfu_and_memory_are_omitted_without_a_peak_or_a_device(tmp_path, clock):
    with make_tracker(tmp_path, interval=1, flops_per_token=6e9) as tracker:
        row = step(tracker, clock, 1)
    assert "mfu" not in row
    assert list(row) == [k for k in STEP_KEYS if k != "mfu" and k not in MEMORY_KEYS]


def test_data_wait_share_is_the_waited_part_of_the_interval(tmp_path, clock):
    with make_tracker(tmp_path, interval=2) as tracker:
        step(tracker, clock, 1, dt=1.0, data_wait_s=0.25)
        row = step(tracker, clock, 2, dt=3.0, data_wait_s=0.75)
        assert row["data_wait_share"] == pytest.approx(0.25)
        row = step(tracker, clock, 3, dt=1.0)
        row = step(tracker, clock, 4, dt=1.0)
    assert row["data_wait_share"] == 0.0  # a new interval starts from zero


def test_peak_memory_is_the_peak_of_the_interval_on_the_cpu(tmp_path, clock):
    import torch

    with make_tracker(tmp_path, interval=1, device=torch.device("cpu")) as tracker:
        big = torch.ones(256 * 2**20 // 4)  # 256 MiB, touched, freed within step 1
        del big
        first = step(tracker, clock, 1)["peak_memory_gib"]
        second = step(tracker, clock, 2)["peak_memory_gib"]
    assert first - second > 0.2  # the second interval's peak no longer counts the tensor
    assert list(strict_rows(tmp_path / METRICS_FILE)[0]).count("peak_memory_gib") == 1


def test_extra_key_clashing_with_a_training_key_raises(tmp_path, clock):
    with make_tracker(tmp_path, interval=1) as tracker, pytest.raises(ValueError, match="loss"):
        step(tracker, clock, 1, extra={"loss": 1.0})


def test_second_tracker_appends_to_the_same_file(tmp_path, clock):
    with make_tracker(tmp_path, interval=1) as tracker:
        step(tracker, clock, 1)
        step(tracker, clock, 2)
    with make_tracker(tmp_path, interval=1) as tracker:
        tracker.log_event(2, "resume", from_step=2)
        step(tracker, clock, 3)
    rows = strict_rows(tmp_path / METRICS_FILE)
    assert [(r["step"], r.get("event")) for r in rows] == [
        (1, None),
        (2, None),
        (2, "resume"),
        (3, None),
    ]


def test_torn_last_row_of_a_killed_run_does_not_corrupt_the_next(tmp_path, clock):
    (tmp_path / METRICS_FILE).write_text('{"step": 1}\n{"step": 2, "lo')
    with make_tracker(tmp_path, interval=1) as tracker:
        step(tracker, clock, 3)
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert lines[1] == '{"step": 2, "lo'
    assert json.loads(lines[2])["step"] == 3
    # Readers skip the torn row; a strict reader names it.
    assert [row["step"] for row in iter_rows(tmp_path / METRICS_FILE)] == [1, 3]
    with pytest.raises(ValueError, match=rf"{METRICS_FILE}, line 2: not a metrics row"):
        read_rows(tmp_path / METRICS_FILE, strict=True)


@pytest.mark.parametrize(
    ("line", "lenient_steps"),
    [('{"step": 1, "loss": NaN}', [0, 1]), ("[1, 2]", [0]), ("", [0])],
)
def test_a_strict_read_refuses_a_line_the_writer_never_writes(tmp_path, line, lenient_steps):
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 0}\n' + line + "\n")
    assert [row["step"] for row in read_rows(path)] == lenient_steps
    with pytest.raises(ValueError, match=re.escape(f"{path}, line 2: not a metrics row")):
        read_rows(path, strict=True)


def test_non_finite_values_are_written_as_null(tmp_path, clock):
    with make_tracker(tmp_path, interval=1) as tracker:
        row = step(tracker, clock, 1, loss=math.nan, grad_norm=math.inf)
        tracker.log_eval(1, {"eval_loss": math.inf, "eval_ppl": math.inf})
    assert math.isnan(row["loss"])  # the returned row keeps the float
    train, evaluation = strict_rows(tmp_path / METRICS_FILE)
    assert train["loss"] is None and train["loss_avg"] is None and train["grad_norm"] is None
    assert evaluation["eval_loss"] is None and evaluation["eval_ppl"] is None


def test_plain_console_prints_one_line_per_log_row(tmp_path, clock):
    out = io.StringIO()
    with make_tracker(tmp_path, interval=30, stream=out) as tracker:
        for n in range(1, 31):
            step(tracker, clock, n, dt=0.4, tokens=2048, loss=3.2101, grad_norm=0.84, lr=3e-4)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[1] == (
        "step 30/1000 | loss 3.2101 | lr 3.00e-04 | gnorm 0.84 | 5,120 tok/s | 0.4 s/step"
        " | eta 6m28s"
    )
    assert "\r" not in out.getvalue()


def test_auto_without_a_terminal_is_plain(tmp_path, clock):
    out = io.StringIO()
    with make_tracker(tmp_path, interval=5, progress="auto", stream=out) as tracker:
        for n in range(1, 11):
            step(tracker, clock, n)
    assert [line.split(" |")[0] for line in out.getvalue().splitlines()] == [
        "step 1/1000",
        "step 5/1000",
        "step 10/1000",
    ]


def test_mfu_appears_on_the_console_line(tmp_path, clock):
    out = io.StringIO()
    with make_tracker(
        tmp_path, interval=1, stream=out, flops_per_token=1e9, peak_flops_per_sec=1e12
    ) as tracker:
        step(tracker, clock, 1, dt=1.0, tokens=412)
    assert "| mfu 41.2% |" in out.getvalue()


@pytest.mark.parametrize("progress", ["bar", "auto"])
def test_bar_keeps_one_live_line_below_the_log_lines(tmp_path, clock, progress):
    out = FakeTTY()
    with make_tracker(tmp_path, interval=5, max_steps=12, progress=progress, stream=out) as t:
        for n in range(1, 8):
            step(t, clock, n, dt=0.5, tokens=1000, loss=2.5)
        mid = render(out.getvalue())
        t.log_event(7, "checkpoint_saved", path="ckpt/step_7")
        for n in range(8, 13):
            step(t, clock, n, dt=0.5, tokens=1000, loss=2.0)
    assert mid[-1] == "7/12 [##############----------]  58% | loss 2.5000 | 2,000 tok/s | eta 2s"
    screen = render(out.getvalue())
    assert [line.split(" |")[0] for line in screen[:-1]] == [
        "step 1/12",
        "step 5/12",
        "event step 7/12",
        "step 10/12",
        "step 12/12",
    ]
    assert screen[2] == "event step 7/12 | checkpoint_saved | path ckpt/step_7"
    full = "#" * 24
    assert screen[-1] == f"12/12 [{full}] 100% | loss 2.0000 | 2,000 tok/s | eta 0s"
    assert out.getvalue().endswith("\n")
    assert get_live_line() is None  # closing unregistered the bar


def test_log_records_print_above_the_bar(tmp_path, clock, monkeypatch):
    out = FakeTTY()
    monkeypatch.setattr(sys, "stderr", out)  # the bar and the logs share one terminal
    root = logging.getLogger("kempnerforge")
    try:
        configure_logging()
        with make_tracker(tmp_path, interval=100, max_steps=10, progress="bar", stream=out) as t:
            step(t, clock, 1)
            step(t, clock, 2)
            get_logger("tests.hook").warning("loss spike")
            step(t, clock, 3)
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        root.setLevel(logging.NOTSET)
        root.propagate = True
    screen = render(out.getvalue())
    assert screen[0].startswith("step 1/10 |")
    assert screen[1] == "WARNING kempnerforge.tests.hook: loss spike"
    assert screen[2].startswith("3/10 [")
    assert len(screen) == 3


def test_off_prints_nothing_but_writes_the_file(tmp_path, clock):
    out = FakeTTY()
    with make_tracker(tmp_path, interval=1, progress="off", stream=out) as tracker:
        step(tracker, clock, 1)
        tracker.log_eval(1, {"eval_loss": 2.0, "eval_ppl": math.exp(2.0)})
        tracker.log_event(1, "checkpoint_saved", path="x")
    assert out.getvalue() == ""
    assert len(strict_rows(tmp_path / METRICS_FILE)) == 3


def test_eval_row_and_console_line(tmp_path, clock):
    out = io.StringIO()
    with make_tracker(tmp_path, stream=out, max_steps=1000) as tracker:
        tracker.log_eval(500, {"eval_loss": 2.91, "eval_ppl": math.exp(2.91)})
    (row,) = strict_rows(tmp_path / METRICS_FILE)
    assert list(row) == ["step", "eval_loss", "eval_ppl", "time"]
    assert row["step"] == 500 and row["eval_ppl"] == pytest.approx(18.357, abs=1e-3)
    assert out.getvalue() == "eval step 500/1000 | eval_loss 2.9100 | eval_ppl 18.3568\n"


def test_event_row_and_console_line(tmp_path, clock):
    out = io.StringIO()
    with make_tracker(tmp_path, stream=out, max_steps=100) as tracker:
        tracker.log_event(42, "nan_skipped", loss=math.nan, consecutive=1)
    (row,) = strict_rows(tmp_path / METRICS_FILE)
    assert row == {"step": 42, "event": "nan_skipped", "loss": None, "consecutive": 1,
                   "time": row["time"]}  # fmt: skip
    assert out.getvalue() == "event step 42/100 | nan_skipped | loss nan | consecutive 1\n"


def test_other_ranks_write_nothing_but_return_rows(tmp_path, clock):
    out = FakeTTY()
    with make_tracker(tmp_path / "run", interval=1, progress="bar", stream=out, rank=1) as t:
        row = step(t, clock, 1)
        t.log_event(1, "resume")
    assert row is not None and row["step"] == 1
    assert out.getvalue() == ""
    assert not (tmp_path / "run").exists()


def test_summary_totals_the_whole_life_of_the_tracker(tmp_path, clock):
    with make_tracker(tmp_path, interval=100) as tracker:
        for n in range(1, 5):
            step(tracker, clock, n, dt=0.5, tokens=250)
        clock.now += 3.0  # outside the timed regions: wall time only
        summary = tracker.summary()
    assert summary["num_steps"] == 4
    assert summary["tokens"] == 1000
    assert summary["tokens_per_sec"] == 500.0
    assert summary["step_time_s"] == 0.5
    assert summary["wall_time_s"] == 5.0


def test_close_is_idempotent_and_later_calls_are_ignored(tmp_path, clock):
    tracker = make_tracker(tmp_path, interval=1)
    step(tracker, clock, 1)
    tracker.close()
    tracker.close()
    step(tracker, clock, 2)
    assert len(strict_rows(tmp_path / METRICS_FILE)) == 1
