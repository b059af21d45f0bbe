"""[eval]: periodic evaluation on held-out data, optionally on several named sets."""

from __future__ import annotations

from dataclasses import dataclass, field

from kempnerforge.config.checks import (
    MAX_SIZE,
    MAX_STEPS,
    check_at_least,
    check_named_paths,
    check_positive,
)

DEFAULT_EVAL_SET = "heldout"
"""The name of the single eval set data.eval_path (or the built-in held-out split) gives."""


@dataclass
class EvalSetConfig:
    """One `[[eval.sets]]` table: a named held-out set from a prepare-data directory."""

    name: str = ""
    """Name of the set in metric keys (eval_loss/<name>); letters, digits, '_' and '-'."""
    path: str = ""
    """Directory written by `kempnerforge prepare-data` with the job's tokenizer."""


@dataclass
class EvalConfig:
    interval: int = 0
    """Evaluate every N optimizer steps; 0 disables periodic eval; at most 2**62 - 1."""
    steps: int = 10
    """Held-out batches per evaluation and per set (the same batches every time); 1 to
    2**31 - 1."""
    batch_size: int = 0
    """Sequences per eval batch; 0 means train.batch_size; at most 2**31 - 1."""
    sets: list[EvalSetConfig] = field(default_factory=list)
    """Named held-out sets (`[[eval.sets]]` tables with name and path); empty means the one
    set "heldout" from data.eval_path or the built-in corpus's held-out split."""

    def __post_init__(self) -> None:
        check_at_least("eval.interval", self.interval, 0, MAX_STEPS)
        check_positive("eval.steps", self.steps, MAX_SIZE)
        check_at_least("eval.batch_size", self.batch_size, 0, MAX_SIZE)
        check_named_paths("eval.sets", self.sets, "eval set")

    @property
    def enabled(self) -> bool:
        return self.interval > 0
