"""The [profiling] schedule on real runs: which steps are traced, per rank, across a resume."""

from __future__ import annotations

import json
import os
import re

import pytest

from kempnerforge.config.profiling import ProfilingConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.metrics.profiling import build_profiler
from kempnerforge.training.loop import run_training_loop
from kempnerforge.training.resume_plan import resume_session
from tests.support.resume import make_session

SCHEDULE = [
    "--profiling.enable=true",
    "--profiling.start_step=2",
    "--profiling.wait=1",
    "--profiling.warmup=1",
    "--profiling.active=2",
    "--profiling.repeat=2",
    "--train.max_steps=12",
]
"""Cycles of 4 steps from step 2: steps 2-5 (wait 2, warmup 3, record 4-5), then 6-9."""


def traced_steps(trace_dir: str) -> list[list[int]]:
    """The optimizer steps each trace file recorded, files in time order."""
    files = sorted(
        (f for f in os.listdir(trace_dir) if f.endswith(".pt.trace.json")),
        key=lambda f: os.path.getmtime(os.path.join(trace_dir, f)),
    )
    result = []
    for name in files:
        assert name.startswith("rank0"), name
        with open(os.path.join(trace_dir, name)) as f:
            events = json.load(f)["traceEvents"]
        # The loop calls profiler.step() after each optimizer step, so ProfilerStep#n
        # is optimizer step n + 1 of a run started at step 0.
        numbers = {
            int(m.group(1)) + 1
            for e in events
            if (m := re.fullmatch(r"ProfilerStep#(\d+)", str(e.get("name", ""))))
        }
        result.append(sorted(numbers))
    return result


@pytest.mark.slow
def test_the_schedule_traces_its_active_steps(tiny_overrides):
    session = make_session([*tiny_overrides, *SCHEDULE])
    with session.tracker:
        run_training_loop(session)
    trace_dir = os.path.join(session.config.run_dir, "profiler")
    assert traced_steps(trace_dir) == [[4, 5], [8, 9]]


@pytest.mark.slow
def test_a_resumed_run_keeps_the_schedule_of_absolute_steps(tiny_overrides):
    overrides = [*tiny_overrides, *SCHEDULE, "--checkpoint.interval=7"]
    first = make_session([*overrides, "--train.max_steps=7"])
    with first.tracker:
        run_training_loop(first)
    trace_dir = os.path.join(first.config.run_dir, "profiler")
    before = sorted(os.listdir(trace_dir))
    assert traced_steps(trace_dir)[0] == [4, 5]
    # Stopped at 7, inside the second cycle (6-9): the resumed run joins no cycle begun
    # before it, and the schedule has no third one.
    second = make_session(overrides)
    step, tokens = resume_session(second)
    assert step == 7
    assert second.profiler is None
    with second.tracker:
        run_training_loop(second, step=step, tokens_seen=tokens)
    assert sorted(os.listdir(trace_dir)) == before


def test_profiling_fields_are_checked():
    with pytest.raises(ConfigError, match=r"profiling\.active = 0"):
        ProfilingConfig(active=0)
    with pytest.raises(ConfigError, match=r"profiling\.wait = -1"):
        ProfilingConfig(wait=-1)


@pytest.mark.parametrize(
    ("first_step", "repeat", "runs"),
    [(0, 2, True), (5, 2, True), (9, 2, False), (9, 0, True), (13, 3, False)],
)
def test_a_resume_past_the_last_cycle_builds_no_profiler(tmp_path, first_step, repeat, runs):
    cfg = ProfilingConfig(enable=True, start_step=2, wait=1, warmup=1, active=2, repeat=repeat)
    profiler = build_profiler(cfg, str(tmp_path), first_step=first_step)
    assert (profiler is not None) == runs
