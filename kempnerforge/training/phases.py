"""PhaseState: the schedules keyed by optimizer step: data-mixture and LR-scale phases, and a
vision-language model's freeze stages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kempnerforge.config.freeze import FreezeStage


@dataclass
class TrainingPhase:
    """From start_step on, sample with dataset_weights and scale the LR by lr_scale."""

    start_step: int
    dataset_weights: dict[str, float] = field(default_factory=dict)
    lr_scale: float = 1.0


class PhaseState:
    """Which phases and freeze stages have fired, and the LR scale now in force.

    ``next_index`` points at the next phase to fire, ``freeze_index`` at the next freeze
    stage. Both fire once the step count reaches their start_step (``>=``, so a resume or
    a skipped step never misses one).
    """

    def __init__(
        self,
        phases: list[TrainingPhase] | None = None,
        freeze_stages: list[FreezeStage] | None = None,
    ) -> None:
        self.phases = sorted(phases or [], key=lambda p: p.start_step)
        self.next_index = 0
        self.lr_scale = 1.0
        self.freeze_stages = sorted(freeze_stages or [], key=lambda s: s.start_step)
        self.freeze_index = 0

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

    def advance_freeze(self, step: int) -> list[FreezeStage]:
        """Fire every freeze stage whose start_step <= step; return those fired, in order."""
        fired = []
        while (
            self.freeze_index < len(self.freeze_stages)
            and self.freeze_stages[self.freeze_index].start_step <= step
        ):
            fired.append(self.freeze_stages[self.freeze_index])
            self.freeze_index += 1
        return fired

    def skip_freeze_to(self, step: int) -> None:
        """Mark the stages up to ``step`` fired without firing them: the model was put in
        the freeze state of ``step`` directly (a resume, a rollback)."""
        self.freeze_index = sum(s.start_step <= step for s in self.freeze_stages)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"next_index": self.next_index, "lr_scale": self.lr_scale}
        if self.freeze_stages:
            state["freeze_index"] = self.freeze_index
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_index = int(state["next_index"])
        self.lr_scale = float(state["lr_scale"])
        self.freeze_index = int(state.get("freeze_index", 0))
