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
from kempnerforge.config.data import DataConfig

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
    """Evaluate every N optimizer steps; 0 disables periodic eval; at most 2**62 - 1. A job
    without held-out data (see data.eval_path) warns at start-up and does not evaluate."""
    steps: int = 10
    """Eval steps per evaluation and per set, each of batch_size sequences: a set is
    evaluated on its first steps * batch_size windows, the same ones every time and in
    every layout; 1 to 2**31 - 1."""
    batch_size: int = 0
    """Sequences per eval step over all data-parallel ranks together, each rank taking its
    share in batches of at most train.batch_size; 0 means the training's global batch
    (train.batch_size * train.grad_accum_steps * data-parallel degree, which a resume on
    another number of ranks keeps); at most 2**31 - 1."""
    sets: list[EvalSetConfig] = field(default_factory=list)
    """Named held-out sets (`[[eval.sets]]` tables with name and path); empty means the one
    set "heldout" from data.eval_path, or without it the built-in corpus's held-out split
    when data.path and data.datasets are empty (none otherwise)."""

    def __post_init__(self) -> None:
        check_at_least("eval.interval", self.interval, 0, MAX_STEPS)
        check_positive("eval.steps", self.steps, MAX_SIZE)
        check_at_least("eval.batch_size", self.batch_size, 0, MAX_SIZE)
        check_named_paths("eval.sets", self.sets, "eval set")

    @property
    def enabled(self) -> bool:
        return self.interval > 0


def missing_eval_data(data: DataConfig, eval_cfg: EvalConfig) -> str:
    """Why a token job has no held-out data and what to set, or "" when it has some (or
    names no token data: a vision-language job's pairs are config/vlm.py's to check).

    Decided from the config alone, as build_data_pipeline decides it: only the built-in
    corpus brings its own.
    """
    if eval_cfg.sets or data.eval_path or not (data.path or data.datasets):
        return ""
    given = "data.path" if data.path else "data.datasets"
    return (
        f"{given} is set and data.eval_path is empty (only the built-in corpus has a "
        "held-out split of its own); set data.eval_path to a prepare-data directory "
        "(prepare-data --eval-fraction F --eval-output DIR writes one) or give [[eval.sets]]"
    )
