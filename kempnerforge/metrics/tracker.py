"""MetricsTracker: step timing, the metrics.jsonl rows and the console display of one run."""

from __future__ import annotations

import collections
import json
import math
import os
import sys
import time
from typing import IO, Any

import torch

from kempnerforge.config.metrics import MetricsConfig
from kempnerforge.core.metrics_file import METRICS_FILE, jsonable, merge_row, open_append
from kempnerforge.metrics.backends import MetricBackend, scalar_values
from kempnerforge.metrics.console import Console, duration, fmt, resolve_progress
from kempnerforge.metrics.goodput import START_EVENT, STATE_KEY, GoodputAccount, resume_account
from kempnerforge.metrics.memory import memory_row, peak_memory_gib, reset_peak_memory
from kempnerforge.metrics.mfu import mfu

STEP_KEYS = (
    "step",
    "loss",
    "loss_avg",
    "grad_norm",
    "lr",
    "tokens_seen",
    "tokens_per_sec",
    "tokens_per_sec_per_device",
    "step_time_s",
    "data_wait_share",
    "mfu",
    "peak_memory_gib",
    "host_rss_gib",
    "cuda_allocated_gib",
    "cuda_reserved_gib",
    "time",
    "goodput",
)
"""Keys of a training row, in order; 'mfu' only when a peak is known, the memory keys only
when the tracker knows the device (the cuda_* ones on a GPU, host_rss_gib on Linux),
'goodput' only on rank 0 (the writer: metrics/goodput.py). Extra keys follow."""
SNAPSHOT_EVENTS = (START_EVENT, "checkpoint")
"""Events whose rows carry the goodput account's state (metrics/goodput.py STATE_KEY)."""
MEMORY_KEYS = ("peak_memory_gib", "host_rss_gib", "cuda_allocated_gib", "cuda_reserved_gib")

_RECENT_STEPS = 20  # steps averaged for the ETA and the bar's tok/s
_BAR_WIDTH = 24


class MetricsTracker:
    """Times optimizer steps and reports them to metrics.jsonl and the console.

    Every `end_step` is cheap (a clock read and a few additions, all on host floats); a
    file write and a console line happen only on log steps: the first step this tracker
    sees, every `cfg.log_interval` steps, and `max_steps`. A logged row carries the
    current step's `loss` and `grad_norm`, and, over the steps since the previous row,
    `loss_avg` (their mean loss), `tokens_per_sec` (their tokens / their timed seconds) and
    `step_time_s` (their mean timed seconds), so throughput is not a one-step figure;
    `data_wait_share` is the part of those seconds spent waiting for batches (the loop
    passes each step's wait), and `peak_memory_gib` the peak memory of those steps on
    `device` (docs/performance.md says what each device counts).

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
        device: the device whose peak memory each row reports; None reports none.
        backends: further destinations of the training and eval rows' numbers
            (metrics/backends.py: TensorBoard, W&B), given on rank 0 only; closed with
            the tracker.
        num_devices: the devices whose tokens `tokens` counts (the world size when it is a
            global count): rows also carry `tokens_per_sec_per_device`.
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
        device: torch.device | None = None,
        backends: list[MetricBackend] | None = None,
        num_devices: int = 1,
    ) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self.cfg = cfg
        self.max_steps = max_steps
        self.rank = rank
        self.path = os.path.join(run_dir, METRICS_FILE)
        self._flops_per_token = flops_per_token
        self._peak = peak_flops_per_sec
        self._device = device
        self._num_devices = max(1, num_devices)
        if device is not None:
            reset_peak_memory(device)
        # The run's account so far, for each row's running `goodput`: restored from the
        # state the newest start or checkpoint event carries, and the rows after it.
        self._account: GoodputAccount | None = resume_account(self.path) if rank == 0 else None
        self._file = open_append(self.path) if rank == 0 else None
        self._backends = list(backends or []) if rank == 0 else []
        out: IO[str] = stream if stream is not None else sys.stdout
        mode = resolve_progress(cfg.progress, out) if rank == 0 else "off"
        self._console = Console(out, bar=mode == "bar") if mode != "off" else None

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
        self._interval_wait = 0.0
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

    def logs_step(self, step: int) -> bool:
        """Whether end_step(step) will write a row: the first step, every log_interval-th
        and the last. Callers use it to gather costly extra metrics only for those."""
        return not self._seen_step or step % self.cfg.log_interval == 0 or step == self.max_steps

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
        data_wait_s: float = 0.0,
    ) -> dict[str, Any] | None:
        """Record one finished optimizer step; on log steps, write and return its row.

        Args:
            step: the step just finished (1-based, as the loop counts).
            tokens: tokens trained on in this step.
            tokens_seen: tokens trained on so far in the run, this step included.
            extra: more keys for the row (Python numbers or strings), e.g. per-dataset
                losses; a key that clashes with a training key raises ValueError.
            data_wait_s: seconds of this step spent waiting for batches.

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
        self._interval_wait += data_wait_s
        self._recent.append((step_time, tokens))
        self._last_step = step
        self._last_loss = loss

        due = self.logs_step(step)
        self._seen_step = True
        self._unlogged = (step, loss, grad_norm, lr, tokens_seen, extra)
        if not due:
            if self._console is not None and self._console.bar_due(now):
                self._console.draw_bar(self._bar_text())
            return None

        return self._log_interval_row()

    def flush(self) -> dict[str, Any] | None:
        """Write the row of a part-finished interval now (a run stopping off the cadence).

        Without it the steps since the last row would appear in no row's averages; the loop
        calls this when it stops early. Returns the row, or None when nothing is pending.
        """
        if self._unlogged is None or self._interval_steps == 0:
            return None
        return self._log_interval_row()

    def _log_interval_row(self) -> dict[str, Any]:
        """Write and return the row of the interval ending at the step in ``_unlogged``
        (which end_step has just set, or flush found set), then start the next interval."""
        assert self._unlogged is not None
        row = self._step_row(*self._unlogged)
        self._unlogged = None
        self._interval_steps = self._interval_tokens = 0
        self._interval_time = self._interval_loss = self._interval_wait = 0.0
        if self._device is not None:
            reset_peak_memory(self._device)
        self._write(row)
        if self._console is not None:
            self._console.line(self._step_line(row), self._bar_text())
        return row

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Write an evaluation row {"step", **metrics, "time"} and a console line.

        The caller names the keys ("eval_loss", "eval_ppl", ...) and computes them.
        """
        row = merge_row({"step": step}, metrics)
        row = merge_row(row, {"time": time.time()})
        self._account_row(row)
        self._write(row)
        if self._console is not None:
            fields = " | ".join(f"{k} {fmt(v)}" for k, v in metrics.items())
            self._console.line(f"eval step {step}/{self.max_steps} | {fields}", self._bar_text())

    def log_event(self, step: int, event: str, **fields: Any) -> None:
        """Write an event row {"step", "event", **fields, "time"} and a console line.

        For what happens once rather than every step: a skipped NaN step, a resume, a
        checkpoint saved.
        """
        row = merge_row({"step": step, "event": event}, fields)
        row = merge_row(row, {"time": time.time()})
        self._account_row(row)
        if self._account is not None and event in SNAPSHOT_EVENTS:
            row[STATE_KEY] = self._account.state_dict()  # the next launch starts from it
        self._write(row)
        if self._console is not None:
            text = " | ".join([f"event step {step}/{self.max_steps}", event])
            text += "".join(f" | {k} {fmt(v)}" for k, v in fields.items())
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
        backends, self._backends = self._backends, []
        for backend in backends:
            backend.close()
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except OSError as e:
                raise OSError(e.errno, e.strerror, self.path) from e

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
            "tokens_per_sec_per_device": (
                None if tokens_per_sec is None else tokens_per_sec / self._num_devices
            ),
            "step_time_s": self._interval_time / self._interval_steps,
            "data_wait_share": _ratio(self._interval_wait, self._interval_time),
        }
        if self._flops_per_token is not None and self._peak is not None:
            row["mfu"] = (
                None
                if tokens_per_sec is None
                else mfu(tokens_per_sec, self._flops_per_token, self._peak)
            )
        if self._device is not None:
            row["peak_memory_gib"] = peak_memory_gib(self._device)
            row.update(memory_row(self._device))
        row["time"] = time.time()
        if self._account is not None:
            self._account.add(row)
            row["goodput"] = self._account.goodput()
        return merge_row(row, extra) if extra else row

    def _account_row(self, row: dict[str, Any]) -> None:
        if self._account is not None:
            self._account.add(row)

    def _write(self, row: dict[str, Any]) -> None:
        if self._file is None:
            return
        try:
            self._file.write(json.dumps(jsonable(row), allow_nan=False) + "\n")
            self._file.flush()
        except OSError as e:
            # A full disk surfaces here with no file name; the user needs to know which.
            raise OSError(e.errno, e.strerror, self.path) from e
        if self._backends and "event" not in row:
            values = scalar_values(row)
            for backend in self._backends:
                backend.log(int(row["step"]), values)

    def _recent_rates(self) -> tuple[float | None, float | None]:
        """(tokens/s, seconds/step) over the recent steps, for the ETA and the bar."""
        seconds = sum(t for t, _ in self._recent)
        tokens = sum(n for _, n in self._recent)
        return _ratio(tokens, seconds), _ratio(seconds, len(self._recent))

    def _eta(self) -> str:
        _, step_time = self._recent_rates()
        if step_time is None:
            return "?"
        return duration(step_time * max(self.max_steps - self._last_step, 0))

    def _step_line(self, row: dict[str, Any]) -> str:
        parts = [
            f"step {row['step']}/{self.max_steps}",
            f"loss {fmt(row['loss'], '.4f')}",
            f"lr {fmt(row['lr'], '.2e')}",
            f"gnorm {fmt(row['grad_norm'], '.2f')}",
            f"{fmt(row['tokens_per_sec'], ',.0f')} tok/s",
            f"{fmt(row['step_time_s'], '.3g')} s/step",
        ]
        if row.get("mfu") is not None:
            parts.append(f"mfu {row['mfu']:.1%}")
        if row.get("data_wait_share") is not None and row["data_wait_share"] >= 0.01:
            parts.append(f"data wait {row['data_wait_share']:.0%}")
        if row.get("peak_memory_gib") is not None:
            parts.append(f"mem {row['peak_memory_gib']:.2f} GiB")
        if row.get("moe/imbalance") is not None:
            parts.append(f"moe aux {fmt(row.get('moe/aux_loss'), '.3f')}")
            parts.append(f"imbalance {row['moe/imbalance']:.2f}")
            if row.get("moe/dropped_share"):
                parts.append(f"dropped {row['moe/dropped_share']:.1%}")
        if row.get("mtp/loss") is not None:
            parts.append(f"mtp {fmt(row['mtp/loss'], '.4f')}")
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
            f"loss {fmt(self._last_loss, '.4f')} | {fmt(tokens_per_sec, ',.0f')} tok/s | "
            f"eta {self._eta()}"
        )


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None
