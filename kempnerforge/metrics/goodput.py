"""Goodput accounting: every second of a run's wall time, from its metrics.jsonl rows, given
to exactly one cause (productive steps, recomputed steps, data waits, start-ups, ...).

One pass over the rows in file order, O(1) memory: the account keeps a running total per
cause and a few numbers about the process being read, never the rows. The same account,
fed row by row, gives the tracker the running `goodput` of each training row. No torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kempnerforge.core.metrics_file import iter_rows

CAUSES = {
    "productive": "steps trained for the first time (less their data waits)",
    "recomputed": "steps trained again after a restart or a rollback (less their data waits)",
    "data_wait": "steps waiting for batches (data_wait_share x step time)",
    "startup": "process start to its first step (build, checkpoint load, resume)",
    "checkpoint": "the step loop blocked on checkpoint saves and memory-tier copies",
    "eval": "in-loop evaluation",
    "replica_heal": "a replica group taking its peers' live state",
    "restart_gap": "one process's last row to the next process's start (requeue, restart)",
    "unattributed": "the rest: loop overhead, skipped NaN steps, rollback reloads",
}
"""Every cause, in the order tables list them, with what it counts."""

START_EVENT = "start"
"""The event row `kempnerforge train` writes once per process, as soon as its metrics file
is open; its ``started`` field is the wall time the command started."""

STATE_KEY = "goodput_state"
"""The key under which the tracker writes the account's state into its start and checkpoint
event rows, so that the next launch restores it from the file's end (resume_account)
instead of reading the whole file again."""

TAIL_LIMIT_BYTES = 16 << 20
"""How far from the end resume_account looks for a state before streaming the whole file."""

RESTART_EVENTS = ("resume", "nan_rollback")
"""Events after which the run continues from the event's step: rows logged earlier for a
later step belong to the part of the run that was redone (the plots drop them), and steps
past it trained again are recomputed."""


@dataclass
class GoodputReport:
    """Where a run's wall time went."""

    seconds: dict[str, float]
    """Cause (every key of CAUSES) -> seconds; they sum to ``total_s``."""
    total_s: float
    """Wall seconds from the run's first start to its last row."""
    num_processes: int
    """Processes (launches) seen: start events, or resumes of a file without them."""
    num_rows: int
    """Rows read."""

    @property
    def goodput(self) -> float | None:
        """Productive seconds over wall seconds; None before any wall time passed."""
        return self.seconds["productive"] / self.total_s if self.total_s > 0 else None

    def shares(self) -> dict[str, float]:
        """Cause -> its share of the wall time (all 0 for an empty run)."""
        total = self.total_s
        return {k: (v / total if total > 0 else 0.0) for k, v in self.seconds.items()}

    def as_dict(self) -> dict[str, Any]:
        return {
            "total_s": self.total_s,
            "goodput": self.goodput,
            "num_processes": self.num_processes,
            "num_rows": self.num_rows,
            "causes": {
                k: {"seconds": self.seconds[k], "share": share}
                for k, share in self.shares().items()
            },
        }


@dataclass
class GoodputAccount:
    """The running account of one run: feed it rows in file order with ``add``.

    A process begins at a ``start`` event (its ``started`` time is the process start); in a
    file written before those existed, a ``resume`` after trained steps begins one whose
    start is unknown, so its start-up joins the restart gap. Within a process a training
    row covers the steps since the previous one (the tracker's log interval): their timed
    seconds are ``step_time_s`` times their count, split into data waits and productive or
    recomputed steps by whether each step number is past the highest trained before. Eval
    rows carry ``eval_time_s``, checkpoint events ``seconds`` (the loop's blocked time); a
    replica heal lasts from the previous row to its ``replica_rejoined`` event. What no row
    accounts for is unattributed.
    """

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    first_start: float | None = None
    last_time: float | None = None
    frontier: int = 0
    """The highest step number trained so far."""
    num_processes: int = 0
    num_rows: int = 0
    # The process being read.
    _start: float | None = None
    _trained: bool = False
    _row_step: int = 0
    """The step the previous training row ended at (or the process started from)."""
    _pending_first: int = 0
    _pending_again: int = 0
    """Steps since the previous training row, first-time and again, not yet in a row."""

    def add(self, row: dict[str, Any]) -> None:
        """Account one row (rows without a numeric ``time`` and ``step`` are counted only)."""
        self.num_rows += 1
        time_, step = _number(row.get("time")), row.get("step")
        if time_ is None or not isinstance(step, int):
            return
        event = row.get("event")
        step_time_s = _number(row.get("step_time_s")) if event is None else None
        if event == START_EVENT:
            started = _number(row.get("started"))
            self._begin_process(time_ if started is None else started, step)
        elif event == "resume" and self._trained:
            # A file written before start events: the process start is unknown, so the
            # whole stretch since the previous process's last row is the restart gap.
            if self.last_time is not None:
                self.seconds["restart_gap"] += max(0.0, time_ - self.last_time)
            self._begin_process(None, step)
        elif self.num_processes == 0:
            # Rows before any start event: the run began with the first one (its step).
            self._begin_process(time_ - (step_time_s or 0.0), 0)
            self._start = None  # its start-up is unknown
        previous = self.last_time if self.last_time is not None else time_
        self.last_time = max(previous, time_)
        if event is not None:
            self._add_event(row, str(event), step, time_ - previous)
        elif step_time_s is not None:
            self._add_steps(row, step, time_, step_time_s)
        else:
            self.seconds["eval"] += _number(row.get("eval_time_s")) or 0.0

    def _begin_process(self, started: float | None, step: int) -> None:
        if started is not None:
            if self.first_start is None:
                self.first_start = started
            elif self.last_time is not None:
                self.seconds["restart_gap"] += max(0.0, started - self.last_time)
            self.last_time = started if self.last_time is None else max(self.last_time, started)
        self.num_processes += 1
        self._start, self._trained = started, False
        self._row_step, self._pending_first, self._pending_again = step, 0, 0

    def _add_event(self, row: dict[str, Any], event: str, step: int, since_s: float) -> None:
        if event in ("checkpoint", "memory_copy"):  # a save, or the memory tier's copy
            self.seconds["checkpoint"] += _number(row.get("seconds")) or 0.0
        elif event == "replica_step":
            self._take_steps(step)  # committed: trained, in the next row's interval
        elif event in ("replica_joined", "replica_rejoined"):
            # The group jumps to its peers' step: the steps between were not trained here.
            # Joining at start-up is start-up; a running group's heal is its own cause.
            if event == "replica_rejoined":
                self.seconds["replica_heal"] += max(0.0, since_s)
            self._row_step = max(self._row_step, step)
        elif event == "load_weights":
            self._row_step = step  # a new run from another's weights starts at step 0
        elif event == "resume":
            # The process trains from the resumed step, which may be newer than its start
            # event's (that is written before the memory tier's newer copy is chosen): the
            # steps between were read back, not trained.
            self._row_step = step
        elif event in RESTART_EVENTS:
            # The steps trained since the previous row, up to the one rolled back from,
            # are in the next row's interval too.
            reached = row.get("from_step", step)
            if isinstance(reached, int):
                self._take_steps(reached)
            self._row_step = step

    def _add_steps(self, row: dict[str, Any], step: int, time_: float, step_time_s: float) -> None:
        self._take_steps(step)
        first, again = self._pending_first, self._pending_again
        self._pending_first = self._pending_again = 0
        count = max(first + again, 1)
        step_s = step_time_s * count
        wait_s = step_s * (_number(row.get("data_wait_share")) or 0.0)
        trained_s = step_s - wait_s
        self.seconds["data_wait"] += wait_s
        self.seconds["productive"] += trained_s * first / count if first + again else trained_s
        self.seconds["recomputed"] += trained_s * again / count
        if not self._trained:
            self._trained = True
            if self._start is not None:  # process start to the first step's start
                self.seconds["startup"] += max(0.0, time_ - step_s - self._start)

    def _take_steps(self, reached: int) -> None:
        """Count the steps after the previous row's up to ``reached`` as first-time or again."""
        if reached <= self._row_step:
            return
        first = max(0, reached - max(self._row_step, self.frontier))
        self._pending_first += first
        self._pending_again += reached - self._row_step - first
        self.frontier = max(self.frontier, reached)
        self._row_step = reached

    def state_dict(self) -> dict[str, Any]:
        """The account's state as JSON-safe values (see from_state)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> GoodputAccount:
        """The account state_dict described; TypeError or ValueError if it is not one."""
        account = cls(**state)
        if set(account.seconds) != set(CAUSES):
            raise ValueError(f"{STATE_KEY} names causes {sorted(account.seconds)}")
        return account

    def goodput(self) -> float | None:
        """Productive seconds so far over wall seconds since the run's first start."""
        if self.first_start is None or self.last_time is None:
            return None
        wall = self.last_time - self.first_start
        return self.seconds["productive"] / wall if wall > 0 else None

    def report(self) -> GoodputReport:
        """The account so far; the unattributed seconds close the sum to the wall time."""
        seconds = dict(self.seconds)
        total = 0.0
        if self.first_start is not None and self.last_time is not None:
            total = self.last_time - self.first_start
        if self._start is not None and not self._trained and self.last_time is not None:
            # A process that never reached a step (stopped during its build): all start-up.
            seconds["startup"] += max(0.0, self.last_time - self._start)
        seconds["unattributed"] = total - sum(v for k, v in seconds.items() if k != "unattributed")
        return GoodputReport(seconds, total, self.num_processes, self.num_rows)


def account_rows(rows: Iterable[dict[str, Any]]) -> GoodputReport:
    """The goodput report of metrics rows in file order (any iterable; read once)."""
    account = GoodputAccount()
    for row in rows:
        account.add(row)
    return account.report()


def read_account(path: str | os.PathLike[str]) -> GoodputAccount:
    """The account of the metrics.jsonl at ``path`` (empty when there is none), streamed: a
    torn last line (a live or killed run) is skipped."""
    account = GoodputAccount()
    if os.path.isfile(path):  # not a device or pipe standing in for the file: no end to read
        for row in iter_rows(path):
            account.add(row)
    return account


def resume_account(path: str | os.PathLike[str]) -> GoodputAccount:
    """The account of the metrics.jsonl at ``path``, for a launch that continues it: the
    newest state a start or checkpoint event carries (STATE_KEY) and the rows after it,
    read from the file's end, so a restart costs the rows since the last save, not the
    run's; equal to read_account's. The whole file is streamed instead when no state lies
    within TAIL_LIMIT_BYTES of its end (a file written before states were)."""
    if not os.path.isfile(path):  # absent, or a device standing in for it (/dev/full)
        return GoodputAccount()
    size, span = os.path.getsize(path), 256 << 10
    while True:
        begin = max(0, size - span)
        with open(path, "rb") as f:
            f.seek(begin)
            data = f.read(size - begin)  # the rows there now, not what a live run appends
        # The first line of a cut read may be a row's end only.
        account = _restored_from(data, cut=begin > 0) if STATE_KEY.encode() in data else None
        if account is not None:
            return account
        if begin == 0 or span >= TAIL_LIMIT_BYTES:
            return read_account(path)
        span *= 2


def _restored_from(data: bytes, *, cut: bool) -> GoodputAccount | None:
    """The account of the newest state in ``data`` (rows of metrics.jsonl), with the rows
    after it added; None when no line holds one."""
    lines = data.split(b"\n")[1 if cut else 0 :]
    for i in range(len(lines) - 1, -1, -1):
        account = _restored(lines[i]) if STATE_KEY.encode() in lines[i] else None
        if account is not None:
            for line in lines[i + 1 :]:
                row = _decoded(line)
                if row is not None:
                    account.add(row)
            return account
    return None


def _decoded(line: bytes) -> dict[str, Any] | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None  # a torn row, as iter_rows skips it
    return row if isinstance(row, dict) else None


def _restored(line: bytes) -> GoodputAccount | None:
    row = _decoded(line)
    state = row.get(STATE_KEY) if row is not None else None
    if not isinstance(state, dict):
        return None
    try:
        return GoodputAccount.from_state(state)
    except (TypeError, ValueError):
        return None


def account_file(path: str | os.PathLike[str]) -> GoodputReport:
    """The goodput report of the metrics.jsonl at ``path`` (see read_account)."""
    return read_account(path).report()


def _number(value: object) -> float | None:
    """``value`` as a float when it is a finite number (not a bool, not null), else None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None
