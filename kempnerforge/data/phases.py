"""PhaseState: a schedule of data-mixture and LR-scale phases keyed by optimizer step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainingPhase:
    """From start_step on, sample with dataset_weights and scale the LR by lr_scale."""

    start_step: int
    dataset_weights: dict[str, float] = field(default_factory=dict)
    lr_scale: float = 1.0


class PhaseState:
    """Which phases have fired, and the LR scale now in force.

    ``next_index`` points at the next phase to fire. A phase fires once the step count
    reaches its start_step (``>=``, so a resume or a skipped step never misses one).
    """

    def __init__(self, phases: list[TrainingPhase] | None = None) -> None:
        self.phases = sorted(phases or [], key=lambda p: p.start_step)
        self.next_index = 0
        self.lr_scale = 1.0

    @property
    def active(self) -> bool:
        return bool(self.phases)

    @property
    def current(self) -> TrainingPhase | None:
        """The phase in force, or None before the first one fires."""
        return self.phases[self.next_index - 1] if self.next_index else None

    def advance(self, step: int) -> list[TrainingPhase]:
        """Fire every phase whose start_step <= step; return those fired, in order."""
        fired = []
        while (
            self.next_index < len(self.phases) and self.phases[self.next_index].start_step <= step
        ):
            phase = self.phases[self.next_index]
            self.lr_scale = phase.lr_scale
            self.next_index += 1
            fired.append(phase)
        return fired

    def state_dict(self) -> dict[str, Any]:
        return {"next_index": self.next_index, "lr_scale": self.lr_scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_index = int(state["next_index"])
        self.lr_scale = float(state["lr_scale"])
