"""MetricsTracker: step timing, the metrics.jsonl rows and the console display of one run."""

from __future__ import annotations

import collections
import json
import math
import numbers
import os
import shutil
import sys
import threading
import time
from typing import IO, Any

from kempnerforge.config.metrics import MetricsConfig
from kempnerforge.metrics.logging import get_live_line, set_live_line
from kempnerforge.metrics.mfu import mfu

METRICS_FILE = "metrics.jsonl"
"""File name of the metrics log inside the run directory."""

STEP_KEYS = ("step", "loss", "loss_avg", "grad_norm", "lr", "tokens_seen")
STEP_KEYS += ("tokens_per_sec", "step_time_s", "mfu", "time")
"""Keys of a training row, in order; 'mfu' only when a peak is known. Extra keys follow."""

_RECENT_STEPS = 20  # steps averaged for the ETA and the bar's tok/s
_BAR_REDRAW_S = 0.1  # the bar redraws at most this often (log lines always redraw it)
_BAR_WIDTH = 24
_CLEAR_TO_EOL = "\x1b[K"


class MetricsTracker:
    """Times optimizer steps and reports them to metrics.jsonl and the console.

    Every `end_step` is cheap (a clock read and a few additions, all on host floats); a
    file write and a console line happen only on log steps: the first step this tracker
    sees, every `cfg.log_interval` steps, and `max_steps`. A logged row carries the
    current step's `loss` and `grad_norm`, and, over the steps since the previous row,
    `loss_avg` (their mean loss), `tokens_per_sec` (their tokens / their timed seconds) and
    `step_time_s` (their mean timed seconds), so throughput is not a one-step figure.

    metrics.jsonl is opened in append mode, so a resumed run continues the same file;
    after a resume event, a row supersedes earlier rows of the same step. Each row is one
    JSON object on its own line, flushed when written, so a killed run keeps every row.
    JSON has no NaN or infinity: non-finite floats are written as null.

    Only rank 0 writes the file and the console; on other ranks the methods still run and
    `end_step` returns the same rows, so callers need no rank checks.

    Args:
        cfg: the [metrics] section (log cadence and progress display).
        run_dir: directory of metrics.jsonl; created if missing.
        max_steps: the run's last step, for the ETA and the last row.
        rank: global rank; only 0 writes.
        flops_per_token: model FLOPs per trained token (forward and backward).
        peak_flops_per_sec: peak FLOP/s of the devices whose tokens are counted (the
            per-device peak times the world size when `tokens` is a global count). MFU is
            reported only when both this and `flops_per_token` are given.
        stream: console stream, sys.stdout by default.
    """

    def __init__(
        self,
        cfg: MetricsConfig,
        run_dir: str,
        *,
        max_steps: int,
        rank: int = 0,
        flops_per_token: float | None = None,
        peak_flops_per_sec: float | None = None,
        stream: IO[str] | None = None,
    ) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self.cfg = cfg
        self.max_steps = max_steps
        self.rank = rank
        self.path = os.path.join(run_dir, METRICS_FILE)
        self._flops_per_token = flops_per_token
        self._peak = peak_flops_per_sec
        self._file = _open_append(self.path) if rank == 0 else None
        stream = stream if stream is not None else sys.stdout
        mode = _resolve_progress(cfg.progress, stream) if rank == 0 else "off"
        self._console = _Console(stream, bar=mode == "bar") if mode != "off" else None

        now = time.perf_counter()
        self._created = now
        self._step_start: float | None = None
        self._last_end = now
        self._seen_step = False
        self._last_step = 0
        self._last_loss = math.nan
        # Since the previous logged row.
        self._unlogged: tuple | None = None  # the last step's values while not yet in a row
        self._interval_steps = 0
        self._interval_tokens = 0
        self._interval_time = 0.0
        self._interval_loss = 0.0
        # Whole lifetime of this tracker.
        self._num_steps = 0
        self._total_tokens = 0
        self._total_time = 0.0
        self._recent: collections.deque[tuple[float, int]] = collections.deque(maxlen=_RECENT_STEPS)

    def start_step(self) -> None:
        """Mark the start of a step's timed region.

        Without it, a step is timed from the previous `end_step` (or from construction).
        """
        self._step_start = time.perf_counter()

    def end_step(
        self,
        step: int,
        *,
        loss: float,
        grad_norm: float,
        lr: float,
        tokens: int,
        tokens_seen: int,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        """Record one finished optimizer step; on log steps, write and return its row.

        Args:
            step: the step just finished (1-based, as the loop counts).
            tokens: tokens trained on in this step.
            tokens_seen: tokens trained on so far in the run, this step included.
            extra: more keys for the row (Python numbers or strings), e.g. per-dataset
                losses; a key that clashes with a training key raises ValueError.

        Returns:
            The row on log steps, else None.
        """
        now = time.perf_counter()
        start = self._step_start if self._step_start is not None else self._last_end
        step_time = now - start
        self._step_start = None
        self._last_end = now
        self._num_steps += 1
        self._total_tokens += tokens
        self._total_time += step_time
        self._interval_steps += 1
        self._interval_tokens += tokens
        self._interval_time += step_time
        self._interval_loss += loss
        self._recent.append((step_time, tokens))
        self._last_step = step
        self._last_loss = loss

        first = not self._seen_step
        self._seen_step = True
        self._unlogged = (step, loss, grad_norm, lr, tokens_seen, extra)
        if not (first or step % self.cfg.log_interval == 0 or step == self.max_steps):
            if self._console is not None and self._console.bar_due(now):
                self._console.draw_bar(self._bar_text())
            return None

        return self._log_interval_row(step, loss, grad_norm, lr, tokens_seen, extra)

    def flush(self) -> dict[str, Any] | None:
        """Write the row of a part-finished interval now (a run stopping off the cadence).

        Without it the steps since the last row would appear in no row's averages; the loop
        calls this when it stops early. Returns the row, or None when nothing is pending.
        """
        if self._unlogged is None or self._interval_steps == 0:
            return None
        return self._log_interval_row(*self._unlogged)

    def _log_interval_row(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        lr: float,
        tokens_seen: int,
        extra: dict[str, Any] | None,
    ) -> dict[str, Any]:
        row = self._step_row(step, loss, grad_norm, lr, tokens_seen, extra)
        self._unlogged = None
        self._interval_steps = self._interval_tokens = 0
        self._interval_time = self._interval_loss = 0.0
        self._write(row)
        if self._console is not None:
            self._console.line(self._step_line(row), self._bar_text())
        return row

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Write an evaluation row {"step", **metrics, "time"} and a console line.

        The caller names the keys ("eval_loss", "eval_ppl", ...) and computes them.
        """
        row = _merge({"step": step}, metrics)
        row = _merge(row, {"time": time.time()})
        self._write(row)
        if self._console is not None:
            fields = " | ".join(f"{k} {_fmt(v)}" for k, v in metrics.items())
            self._console.line(f"eval step {step}/{self.max_steps} | {fields}", self._bar_text())

    def log_event(self, step: int, event: str, **fields: Any) -> None:
        """Write an event row {"step", "event", **fields, "time"} and a console line.

        For what happens once rather than every step: a skipped NaN step, a resume, a
        checkpoint saved.
        """
        row = _merge({"step": step, "event": event}, fields)
        row = _merge(row, {"time": time.time()})
        self._write(row)
        if self._console is not None:
            text = " | ".join([f"event step {step}/{self.max_steps}", event])
            text += "".join(f" | {k} {_fmt(v)}" for k, v in fields.items())
            self._console.line(text, self._bar_text())

    def summary(self) -> dict[str, Any]:
        """Totals over this tracker's life: steps, tokens, mean tokens/s and wall time.

        `tokens_per_sec` is all tokens over all timed step seconds; `wall_time_s` also
        counts what ran outside the timed regions (eval, checkpoints).
        """
        return {
            "num_steps": self._num_steps,
            "tokens": self._total_tokens,
            "tokens_per_sec": _ratio(self._total_tokens, self._total_time),
            "step_time_s": _ratio(self._total_time, self._num_steps),
            "wall_time_s": time.perf_counter() - self._created,
        }

    def close(self) -> None:
        """Flush and close metrics.jsonl and end the bar's line; safe to call twice."""
        if self._console is not None:
            if self._seen_step:
                self._console.draw_bar(self._bar_text())
            self._console.close()
            self._console = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsTracker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _step_row(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        lr: float,
        tokens_seen: int,
        extra: dict[str, Any] | None,
    ) -> dict[str, Any]:
        tokens_per_sec = _ratio(self._interval_tokens, self._interval_time)
        row: dict[str, Any] = {
            "step": step,
            "loss": loss,
            "loss_avg": self._interval_loss / self._interval_steps,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_seen": tokens_seen,
            "tokens_per_sec": tokens_per_sec,
            "step_time_s": self._interval_time / self._interval_steps,
        }
        if self._flops_per_token is not None and self._peak is not None:
            row["mfu"] = (
                None
                if tokens_per_sec is None
                else mfu(tokens_per_sec, self._flops_per_token, self._peak)
            )
        row["time"] = time.time()
        return _merge(row, extra) if extra else row

    def _write(self, row: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(_jsonable(row), allow_nan=False) + "\n")
        self._file.flush()

    def _recent_rates(self) -> tuple[float | None, float | None]:
        """(tokens/s, seconds/step) over the recent steps, for the ETA and the bar."""
        seconds = sum(t for t, _ in self._recent)
        tokens = sum(n for _, n in self._recent)
        return _ratio(tokens, seconds), _ratio(seconds, len(self._recent))

    def _eta(self) -> str:
        _, step_time = self._recent_rates()
        if step_time is None:
            return "?"
        return _duration(step_time * max(self.max_steps - self._last_step, 0))

    def _step_line(self, row: dict[str, Any]) -> str:
        parts = [
            f"step {row['step']}/{self.max_steps}",
            f"loss {_fmt(row['loss'], '.4f')}",
            f"lr {_fmt(row['lr'], '.2e')}",
            f"gnorm {_fmt(row['grad_norm'], '.2f')}",
            f"{_fmt(row['tokens_per_sec'], ',.0f')} tok/s",
            f"{_fmt(row['step_time_s'], '.3g')} s/step",
        ]
        if row.get("mfu") is not None:
            parts.append(f"mfu {row['mfu']:.1%}")
        parts.append(f"eta {self._eta()}")
        return " | ".join(parts)

    def _bar_text(self) -> str:
        if not self._seen_step:
            return ""
        done = min(max(self._last_step / self.max_steps, 0.0), 1.0)
        filled = round(done * _BAR_WIDTH)
        bar = "#" * filled + "-" * (_BAR_WIDTH - filled)
        tokens_per_sec, _ = self._recent_rates()
        return (
            f"{self._last_step}/{self.max_steps} [{bar}] {done:4.0%} | "
            f"loss {_fmt(self._last_loss, '.4f')} | {_fmt(tokens_per_sec, ',.0f')} tok/s | "
            f"eta {self._eta()}"
        )


class _Console:
    """Log lines, and in bar mode one live line kept below them.

    Registered as the live line while it lives, so log records from other modules clear
    the bar first and redraw it after (see configure_logging).
    """

    def __init__(self, stream: IO[str], *, bar: bool) -> None:
        self._stream = stream
        self._bar = bar
        self._width = shutil.get_terminal_size((100, 24)).columns - 1
        self._text = ""  # the bar's current text; "" before the first step
        self._visible = False
        self._drawn_at = -math.inf
        self._lock = threading.Lock()  # log records may come from other threads
        if bar:
            set_live_line(self)

    def line(self, text: str, bar_text: str) -> None:
        """Print one log line; in bar mode above the (redrawn) bar."""
        with self._lock:
            if not self._bar:
                self._stream.write(text + "\n")
            else:
                self._stream.write("\r" + text + _CLEAR_TO_EOL + "\n")
                self._visible = False
                self._set_and_draw(bar_text)
            self._stream.flush()

    def bar_due(self, now: float) -> bool:
        return self._bar and now - self._drawn_at >= _BAR_REDRAW_S

    def draw_bar(self, bar_text: str) -> None:
        if not self._bar:
            return
        with self._lock:
            self._set_and_draw(bar_text)
            self._stream.flush()

    def _set_and_draw(self, bar_text: str) -> None:
        self._text = bar_text[: self._width]
        if self._text:
            self._stream.write("\r" + self._text + _CLEAR_TO_EOL)
            self._visible = True
            self._drawn_at = time.perf_counter()

    def clear(self) -> None:
        """Erase the bar (before someone else prints a line)."""
        with self._lock:
            if self._visible:
                self._stream.write("\r" + _CLEAR_TO_EOL)
                self._stream.flush()
                self._visible = False

    def redraw(self) -> None:
        """Draw the bar again after a foreign line."""
        with self._lock:
            if self._bar and not self._visible and self._text:
                self._stream.write("\r" + self._text + _CLEAR_TO_EOL)
                self._stream.flush()
                self._visible = True

    def close(self) -> None:
        """Leave the bar's last state on its own line."""
        with self._lock:
            if self._visible:
                self._stream.write("\n")
                self._stream.flush()
                self._visible = False
            self._bar = False
        if get_live_line() is self:
            set_live_line(None)


def _resolve_progress(progress: str, stream: IO[str]) -> str:
    """'auto' becomes 'bar' on an interactive terminal, else 'plain'."""
    if progress != "auto":
        return progress
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        tty = False
    return "bar" if tty and os.environ.get("TERM") != "dumb" else "plain"


def _open_append(path: str) -> IO[str]:
    """Open metrics.jsonl for appending, starting a fresh line after a torn last row."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torn = False
    if os.path.exists(path) and os.path.getsize(path) > 0:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
    # Held open for the whole run and closed by MetricsTracker.close, hence no `with`.
    handle = open(path, "a", encoding="utf-8")  # noqa: SIM115
    if torn:
        handle.write("\n")
    return handle


def _merge(row: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    clash = row.keys() & more.keys()
    if clash:
        raise ValueError(f"metric keys {sorted(clash)} are already in the row; rename them")
    return {**row, **more}


def _jsonable(value: Any) -> Any:
    """The value with non-finite floats as None and non-JSON scalars converted."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, str | int):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, numbers.Integral):  # numpy integers
        return int(value)
    if isinstance(value, numbers.Real):  # numpy floats
        return _jsonable(float(value))
    return str(value)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _fmt(value: Any, spec: str = "") -> str:
    """A console figure: `spec` for finite numbers, 'nan'/'inf' as such, '-' for None."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if not spec:
            spec = ".4f" if 1e-3 <= abs(value) < 1e5 or value == 0 else ".3e"
    return format(value, spec)


def _duration(seconds: float) -> str:
    """6m40s-style duration for the ETA."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"
