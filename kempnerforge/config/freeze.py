"""The freeze types: which module groups of a model train, at step 0 and from a given
step on. A family with freeze groups (the vision-language model's [vlm] table) holds them;
training/freeze.py applies them to any model's groups."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FreezeSpec:
    """One ``{module = "...", frozen = true}`` entry of a freeze list."""

    module: str = ""
    """The module group: 'encoder', 'adapter', 'decoder' or 'cross_attention'."""
    frozen: bool = True
    """True freezes the group's parameters (no gradient, no update, no optimizer state);
    false trains them."""


@dataclass
class FreezeStage:
    """One ``[[vlm.freeze_schedule]]`` entry: from optimizer step start_step on, the specs
    override the freeze state of the groups they name."""

    start_step: int = 1
    """The step from which the stage holds: it is applied right after optimizer step
    start_step (so step start_step + 1 is the first trained with it); >= 1."""
    specs: list[FreezeSpec] = field(default_factory=list)
    """The groups this stage freezes or unfreezes; the others keep their state."""
