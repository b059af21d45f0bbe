"""LossSpikeRule: whether a step's loss is far above the losses of the steps before it."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SpikeBound:
    """The window's statistics a loss was judged against."""

    mean: float
    std: float
    threshold: float
    """mean + sigmas * std: a loss above it is a spike."""
    history: int
    """How many losses the window held."""


class LossSpikeRule:
    """A rolling window of recent losses; a loss above mean + ``sigmas`` * std is a spike.

    The rule OLMo-core's skip-step optimizers use by default: the last 128 losses, 6
    standard deviations (the sample standard deviation), judged only once the window holds
    half its length. Every attempt with a finite loss enters the window, spikes included,
    so a lasting change of level (a new data phase) is accepted after a while instead of
    being skipped for ever. The loss judged is the globally reduced one, the same number
    on every rank, so every rank reaches the same verdict without a collective.
    """

    def __init__(self, window: int, sigmas: float, min_history: int = 0) -> None:
        if window < 0 or window == 1:
            raise ValueError(f"window must be 0 (off) or >= 2, got {window}")
        self.window = window
        self.sigmas = float(sigmas)
        self.min_history = min_history or max(2, window // 2)
        self.losses: deque[float] = deque(maxlen=max(window, 1))

    @property
    def enabled(self) -> bool:
        return self.window > 0

    def bound(self) -> SpikeBound | None:
        """The threshold the next loss is judged against; None while the window is short
        (or the rule is off)."""
        if not self.enabled or len(self.losses) < self.min_history:
            return None
        n = len(self.losses)
        mean = math.fsum(self.losses) / n
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in self.losses) / (n - 1))
        return SpikeBound(mean, std, mean + self.sigmas * std, n)

    def is_spike(self, loss: float) -> bool:
        """Whether a finite ``loss`` is a spike against the window as it stands."""
        bound = self.bound()
        return bound is not None and math.isfinite(loss) and loss > bound.threshold

    def record(self, loss: float) -> None:
        """Add an attempt's loss to the window (a non-finite one is left out)."""
        if self.enabled and math.isfinite(loss):
            self.losses.append(float(loss))

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a saved window; a longer one than this rule keeps loses its oldest losses."""
        self.losses.clear()
        for loss in state.get("losses", []):
            self.record(float(loss))
