"""Freeze schedules: which module groups of a model train at which step.

A model family names its freeze groups and schedule (``ModelFamily.freeze_schedule``):
a vision-language model's groups ('encoder', 'adapter', 'decoder', 'cross_attention') are
every parameter under its submodule of that name, ``vlm.freeze`` is the state at step 0
and each ``vlm.freeze_schedule`` stage overrides the groups it names from its start_step
on; a text model has no groups, so every function here leaves it as it is. The state at
any step is a pure function of the schedule (``effective_freeze``), so a resumed run
recomputes it instead of trusting what it finds.

The optimizer knows every parameter from the start, frozen or not (training/optimizer.py):
a frozen parameter has no gradient, so the optimizer skips it, and unfreezing it later
really trains it. When a group is frozen its optimizer state is dropped, so a group that
is unfrozen again starts its moments afresh instead of from stale ones, and a checkpoint
holds state exactly for the parameters that have been trained since they were last
unfrozen (the load reads what is there: checkpoint/resume.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kempnerforge.config.freeze import FreezeSpec, FreezeStage
from kempnerforge.core.errors import ConfigError
from kempnerforge.core.logging import get_logger
from kempnerforge.distributed.fsdp import refresh_sharded_trainable

__all__ = [
    "NO_FREEZE",
    "FreezeSchedule",
    "FreezeSpec",
    "FreezeStage",
    "apply_freeze",
    "canonical_freeze_meta",
    "check_saved_freeze",
    "describe",
    "effective_freeze",
    "freeze_for_step",
    "group_parameters",
]

logger = get_logger(__name__)

FreezeState = dict[str, bool]
"""Frozen or not, by module group."""


def effective_freeze(
    step: int, base: Sequence[FreezeSpec], schedule: Sequence[FreezeStage], groups: Sequence[str]
) -> FreezeState:
    """The freeze state in force after optimizer step ``step`` (step 0: before training).

    Every group starts trainable; ``base`` applies, then every stage with start_step <=
    step in order, the last word on a group winning.
    """
    state = dict.fromkeys(groups, False)
    for spec in base:
        state[spec.module] = spec.frozen
    for stage in schedule:
        if stage.start_step > step:
            break
        for spec in stage.specs:
            state[spec.module] = spec.frozen
    return state


def canonical_freeze_meta(state: FreezeState) -> list[dict[str, object]]:
    """The state as saved in checkpoints: a list of {module, frozen}, sorted by module."""
    return [{"module": name, "frozen": state[name]} for name in sorted(state)]


@dataclass(frozen=True)
class FreezeSchedule:
    """A model's freeze groups, their state at step 0 and the stages that change it.

    ``config_field`` names the config field of the stages, for error messages. No groups
    (NO_FREEZE, a text model's) means nothing is ever frozen.
    """

    groups: tuple[str, ...] = ()
    base: tuple[FreezeSpec, ...] = ()
    stages: tuple[FreezeStage, ...] = ()
    config_field: str = ""

    def state_at(self, step: int) -> FreezeState:
        """The freeze state in force after optimizer step ``step`` (effective_freeze)."""
        return effective_freeze(step, self.base, self.stages, self.groups)

    def meta_at(self, step: int) -> list[dict[str, object]]:
        """The state at ``step`` as a checkpoint records it (``vlm_freeze``)."""
        return canonical_freeze_meta(self.state_at(step))


NO_FREEZE = FreezeSchedule()
"""The schedule of a model without freeze groups."""


def group_parameters(model: torch.nn.Module, group: str) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every parameter of ``group``: those under submodule ``group``."""
    prefix = f"{group}."
    return [(n, p) for n, p in model.named_parameters() if n.startswith(prefix)]


def apply_freeze(
    model: torch.nn.Module,
    state: FreezeState,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, int]:
    """Set requires_grad of each group's parameters from ``state``; return the parameter
    counts that changed, by group ('-' prefix: frozen now).

    A parameter that becomes frozen loses its gradient and, given ``optimizer``, its
    optimizer state. Only parameters whose state differs are touched, so applying the
    same state twice changes nothing. A sharded model is told which of its parameters
    train now (refresh_sharded_trainable).
    """
    changed: dict[str, int] = {}
    for group, frozen in state.items():
        count = 0
        for _, param in group_parameters(model, group):
            if param.requires_grad == (not frozen):
                continue
            param.requires_grad_(not frozen)
            if frozen:
                param.grad = None
                if optimizer is not None:
                    optimizer.state.pop(param, None)
            count += param.numel()
        if count:
            changed[("-" if frozen else "") + group] = count
    if changed:
        refresh_sharded_trainable(model)
    return changed


def freeze_for_step(
    model: torch.nn.Module,
    schedule: FreezeSchedule,
    step: int,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, int]:
    """Put the model in the freeze state of ``step`` (see apply_freeze); {} without groups."""
    return apply_freeze(model, schedule.state_at(step), optimizer)


def describe(state_changes: dict[str, int]) -> str:
    """'froze encoder (1.2M), unfroze adapter (33K)' for a log line."""
    parts = []
    for key, count in state_changes.items():
        verb, group = ("froze", key[1:]) if key.startswith("-") else ("unfroze", key)
        parts.append(f"{verb} {group} ({_count(count)})")
    return ", ".join(parts) or "no change"


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def check_saved_freeze(saved: object, schedule: FreezeSchedule, step: int, where: str) -> None:
    """Refuse a resume whose freeze state at ``step`` differs from the checkpoint's.

    ``saved`` is the checkpoint's vlm_freeze; a changed schedule is fine as long as it
    agrees with the past up to ``step`` (only later stages differ). Groups that only one
    side has (another arch, or a model without groups) are not compared.
    """
    if saved is None:
        return
    expected = schedule.state_at(step)
    try:
        recorded = {str(m["module"]): bool(m["frozen"]) for m in saved}  # type: ignore[union-attr]
    except (TypeError, KeyError):
        raise ValueError(f"{where}: vlm_freeze is not a list of {{module, frozen}}") from None
    differing = sorted(g for g in expected.keys() & recorded.keys() if expected[g] != recorded[g])
    if differing:
        details = ", ".join(
            f"{g} {'frozen' if recorded[g] else 'trainable'} there, "
            f"{'frozen' if expected[g] else 'trainable'} by this config"
            for g in differing
        )
        raise ConfigError(
            schedule.config_field,
            [s.start_step for s in schedule.stages],
            f"a freeze schedule that agrees with {where} at its step {step}",
            f"{details}; change only stages after step {step}",
        )
