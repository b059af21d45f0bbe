"""NaNDetector: tells the loop which steps to skip (non-finite, or a loss spike), and when too
many in a row mean stop."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kempnerforge.core.logging import get_logger
from kempnerforge.resilience.spikes import LossSpikeRule

logger = get_logger(__name__)

_KEPT_SKIPS = 100

NON_FINITE = "non_finite"
"""Why an attempt was skipped: its loss or gradient norm was not finite."""
LOSS_SPIKE = "loss_spike"
"""Why an attempt was skipped: its loss spiked (resilience/spikes.py)."""


@dataclass(frozen=True)
class SkippedAttempt:
    """One attempt at a step that was skipped: the step it tried to make, which try of that
    step it was (1 for the first), and where in the data its batches came from."""

    step: int
    attempt: int
    data: str = ""
    reason: str = NON_FINITE


def describe_attempts(skips: Sequence[SkippedAttempt]) -> str:
    """'step 6, attempts 1-3 (data: ...; ...)' for a run of skips, grouped by step."""
    groups: list[list[SkippedAttempt]] = []
    for skip in skips:
        if groups and groups[-1][0].step == skip.step:
            groups[-1].append(skip)
        else:
            groups.append([skip])
    parts = []
    for group in groups:
        first, last = group[0].attempt, group[-1].attempt
        tries = f"attempt {first}" if first == last else f"attempts {first}-{last}"
        data = "; ".join(s.data for s in group if s.data)
        parts.append(f"step {group[0].step}, {tries}" + (f" (data: {data})" if data else ""))
    return "; ".join(parts)


class NaNAbortError(RuntimeError):
    """Too many consecutive non-finite steps: the run stops (the CLI exits with NAN_ABORT)."""

    def __init__(
        self, skips: Sequence[SkippedAttempt], rollbacks: int = 0, reason: str = ""
    ) -> None:
        self.skips = list(skips)
        self.rollbacks = rollbacks
        after = f" after {rollbacks} rollback(s)" if rollbacks else ""
        why = f" ({reason})" if reason else ""
        what = "a non-finite loss or gradient norm"
        if any(s.reason == LOSS_SPIKE for s in self.skips):
            what += ", or a loss spike"
        super().__init__(
            f"{len(self.skips)} consecutive attempts had {what} "
            f"({describe_attempts(self.skips)}){after}{why}; lower the learning rate, check "
            "the data named, or resume from an earlier checkpoint"
        )


class NaNDetector:
    """Judges each step by its loss and gradient norm; counts the bad ones.

    A step is good only when both values are finite: a finite loss with an inf/NaN
    gradient norm would otherwise let the clip scale the gradients by NaN. With a
    ``spikes`` rule a finite loss far above the recent ones is bad too. The caller
    skips the optimizer step for a bad one and stops once `exhausted` is True. A skipped
    step is tried again with the next batches, so one step number can fail several times:
    each failure is a numbered attempt of that step, recorded with its data position.
    """

    def __init__(self, max_consecutive: int, spikes: LossSpikeRule | None = None) -> None:
        if max_consecutive < 1:
            raise ValueError(f"max_consecutive must be >= 1, got {max_consecutive}")
        self.max_consecutive = max_consecutive
        self.spikes = spikes if spikes is not None else LossSpikeRule(0, 1.0)
        """The loss-spike rule and its window (off by default)."""
        self.hardware_faults = 0
        """Faults that did not repeat when the step was run again, in this launch (not
        saved: a requeue on other nodes starts again at 0)."""
        self.local_loss: Any = None
        """This rank's own share of the last attempt's loss, a device scalar set by the step
        body before the loss is reduced: which rank a fault showed on (never read on a good
        step, so it costs no host sync)."""
        self.consecutive = 0
        """Bad attempts in a row, reset by a good step."""
        self.total_skipped = 0
        """Bad attempts over the whole run, resumes included."""
        self.skipped: list[SkippedAttempt] = []
        """The most recent bad attempts, oldest first (the last 100)."""
        self.rollbacks = 0
        """Rollbacks to a checkpoint after a streak of bad steps, over the whole run."""
        self.lr_scale = 1.0
        """Product of the LR scales applied by those rollbacks."""

    @property
    def skipped_steps(self) -> list[int]:
        """The step numbers of the recorded bad attempts (a step appears once per attempt)."""
        return [skip.step for skip in self.skipped]

    @property
    def attempt(self) -> int:
        """Which attempt at its step the last bad one was (0 before any)."""
        return self.skipped[-1].attempt if self.skipped else 0

    @property
    def last_reason(self) -> str:
        """Why the last bad attempt was skipped (NON_FINITE or LOSS_SPIKE; '' before any)."""
        return self.skipped[-1].reason if self.skipped else ""

    @property
    def last_data_position(self) -> str:
        """Where the data of the last bad attempt came from ('' if unknown)."""
        return self.skipped[-1].data if self.skipped else ""

    def fault_of(self, loss: float, grad_norm: float) -> str | None:
        """Why an attempt with these numbers would be skipped (NON_FINITE, LOSS_SPIKE), or
        None for a good one; records nothing."""
        if not (_finite(loss) and _finite(grad_norm)):
            return NON_FINITE
        return LOSS_SPIKE if self.spikes.is_spike(float(loss)) else None

    def check(
        self,
        loss: float,
        grad_norm: float,
        step: int,
        data_position: Callable[[], str] | None = None,
    ) -> bool:
        """True when the step is good (loss and gradient norm both finite, and no loss
        spike); logs a bad one.

        ``data_position`` describes where the step's batches came from; it is called only
        for a bad step, so it may be slow. A finite loss then joins the spike window.
        """
        reason = self.fault_of(loss, grad_norm)
        bound = self.spikes.bound() if reason == LOSS_SPIKE else None
        self.spikes.record(float(loss))
        if reason is None:
            self.consecutive = 0
            return True
        self.consecutive += 1
        self.total_skipped += 1
        previous = self.skipped[-1] if self.skipped and self.consecutive > 1 else None
        attempt = previous.attempt + 1 if previous and previous.step == step else 1
        data = data_position() if data_position is not None else ""
        self.skipped = [*self.skipped, SkippedAttempt(step, attempt, data, reason)][-_KEPT_SKIPS:]
        if bound is not None:
            what = (
                f"loss spike (loss={loss}, above {bound.threshold:.6g} = mean {bound.mean:.6g} "
                f"+ {self.spikes.sigmas:g} x std {bound.std:.6g} of the last {bound.history})"
            )
        else:
            bad = [n for n, v in (("loss", loss), ("grad_norm", grad_norm)) if not _finite(v)]
            what = f"non-finite {' and '.join(bad)} (loss={loss}, grad_norm={grad_norm})"
        logger.warning(
            "step %d, attempt %d: %s%s; skipping the update (%d bad attempts in a row, limit %d)",
            step,
            attempt,
            what,
            f"; data: {data}" if data else "",
            self.consecutive,
            self.max_consecutive,
        )
        return False

    @property
    def exhausted(self) -> bool:
        """True once `max_consecutive` bad attempts have come in a row."""
        return self.consecutive >= self.max_consecutive

    @property
    def streak(self) -> list[SkippedAttempt]:
        """The bad attempts of the current streak, oldest first."""
        return self.skipped[-self.consecutive :] if self.consecutive else []

    def record_rollback(self, lr_scale: float) -> None:
        """A rollback happened: the streak starts over, the LR scale compounds."""
        self.consecutive = 0
        self.rollbacks += 1
        self.lr_scale *= lr_scale

    def state_dict(self) -> dict[str, Any]:
        return {
            "consecutive": self.consecutive,
            "total_skipped": self.total_skipped,
            "skipped": [[s.step, s.attempt, s.data, s.reason] for s in self.skipped],
            "rollbacks": self.rollbacks,
            "lr_scale": self.lr_scale,
            "spikes": self.spikes.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consecutive = int(state["consecutive"])
        self.total_skipped = int(state["total_skipped"])
        if "skipped" in state:
            records = [
                SkippedAttempt(int(r[0]), int(r[1]), str(r[2]), str(r[3]) if r[3:] else NON_FINITE)
                for r in state["skipped"]
            ]
        else:  # saved before attempts were numbered: step ids only
            records = [SkippedAttempt(int(s), 1) for s in state.get("skipped_steps", [])]
        self.skipped = records[-_KEPT_SKIPS:]
        self.rollbacks = int(state.get("rollbacks", 0))
        self.lr_scale = float(state.get("lr_scale", 1.0))
        self.load_spike_window(state)

    def load_spike_window(self, state: dict[str, Any]) -> None:
        """Take only the spike window of a saved state (a rollback: the losses that led to
        the weights it goes back to, not the streak's that follow them)."""
        self.spikes.load_state_dict(state.get("spikes", {}))


def _finite(value: float) -> bool:
    # float() also accepts 0-d tensors, so a caller holding a device scalar still works.
    return math.isfinite(float(value))
