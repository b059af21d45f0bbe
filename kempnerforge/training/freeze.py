"""FreezeStage: which parameter groups are trainable, and from which step."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class FreezeSpec:
    """Freeze (or unfreeze) every parameter whose name matches ``module`` or ``module.*``."""

    module: str
    frozen: bool = True

    def matches(self, param_name: str) -> bool:
        return fnmatch.fnmatchcase(param_name, self.module) or fnmatch.fnmatchcase(
            param_name, f"{self.module}.*"
        )


@dataclass(frozen=True)
class FreezeStage:
    """From ``start_step`` on, apply ``specs`` on top of the stages before it."""

    start_step: int
    specs: tuple[FreezeSpec, ...] = field(default_factory=tuple)


def freeze_meta_at_step(
    step: int, base: list[FreezeSpec], stages: list[FreezeStage]
) -> list[dict[str, object]]:
    """The freeze state in force after ``step`` steps, as sorted plain dicts for metadata.

    Stages with start_step <= step apply in order and the last word per module wins, so a
    checkpoint saved right after a transition describes the post-transition state.
    """
    state: dict[str, bool] = {spec.module: spec.frozen for spec in base}
    for stage in sorted(stages, key=lambda s: s.start_step):
        if stage.start_step <= step:
            state.update({spec.module: spec.frozen for spec in stage.specs})
    return [{"module": module, "frozen": frozen} for module, frozen in sorted(state.items())]


def apply_freeze(model: torch.nn.Module, specs: list[FreezeSpec]) -> int:
    """Set requires_grad on matching parameters; return how many elements changed state."""
    changed = 0
    for name, param in model.named_parameters():
        for spec in specs:
            if spec.matches(name) and param.requires_grad == spec.frozen:
                param.requires_grad_(not spec.frozen)
                changed += param.numel()
    return changed
