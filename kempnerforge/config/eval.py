"""[eval]: periodic evaluation on held-out data, optionally on several named sets, and on
downstream tasks (`[[eval.tasks]]`)."""

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
from kempnerforge.core.errors import ConfigError

DEFAULT_EVAL_SET = "heldout"
"""The name of the single eval set data.eval_path (or the built-in held-out split) gives."""


@dataclass
class EvalSetConfig:
    """One `[[eval.sets]]` table: a named held-out set from a prepare-data directory."""

    name: str = ""
    """Name of the set in metric keys (eval_loss/<name>); letters, digits, '_' and '-'."""
    path: str = ""
    """Directory written by `kempnerforge prepare-data` with the job's tokenizer."""


TASK_KINDS = ("multiple_choice", "bits_per_byte")
"""What a task measures: the choice the model finds likeliest, or the bits it needs per byte
of text (docs/evaluation.md)."""

MAX_FEWSHOT = 1000
"""Most solved examples a multiple-choice task puts before each example."""


@dataclass
class EvalTaskConfig:
    """One `[[eval.tasks]]` table: a downstream task read from a local file."""

    name: str = ""
    """Name of the task in metric keys (eval/<name>/acc); letters, digits, '_' and '-'."""
    path: str = ""
    """The task's file. multiple_choice: JSONL, one example a line, {"context", "choices",
    "gold"}, optionally "subject" and "description" (`kempnerforge convert-task` writes it
    from HellaSwag, ARC, PIQA and MMLU);
    bits_per_byte: JSONL of {"text"} documents, or a plain text file as one document."""
    kind: str = "multiple_choice"
    """'multiple_choice' (metrics acc and acc_norm) or 'bits_per_byte' (metric bpb)."""
    limit: int = 0
    """Score the file's first N examples (documents) only; 0 scores them all."""
    interval: int = 0
    """Every N optimizer steps during training, and after the last step; 0 means
    eval.interval. The task runs in training only when the interval that applies is > 0."""
    fewshot_path: str = ""
    """multiple_choice only: a JSONL of solved examples in the task's format; the first
    num_fewshot of them of an example's subject (those without one for an example without
    one), each its context and its gold choice, precede the example's context."""
    num_fewshot: int = 0
    """How many of fewshot_path's examples precede every example; 0 to 1000."""


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

    tasks: list[EvalTaskConfig] = field(default_factory=list)
    """Downstream tasks (`[[eval.tasks]]` tables): scored in training at their interval and
    after the last step, and by the `eval` command's `--tasks`; see docs/evaluation.md."""

    def __post_init__(self) -> None:
        check_at_least("eval.interval", self.interval, 0, MAX_STEPS)
        check_positive("eval.steps", self.steps, MAX_SIZE)
        check_at_least("eval.batch_size", self.batch_size, 0, MAX_SIZE)
        check_named_paths("eval.sets", self.sets, "eval set")
        check_tasks(self.tasks)

    def task_interval(self, task: EvalTaskConfig) -> int:
        """The steps between a task's evaluations in training; 0 when it never runs there."""
        return task.interval or self.interval

    @property
    def enabled(self) -> bool:
        return self.interval > 0


def check_tasks(tasks: list[EvalTaskConfig]) -> None:
    """Each `[[eval.tasks]]` table on its own, and the names unique; the files are read
    (and their contents checked) when the tasks are loaded, before training starts."""
    check_named_paths("eval.tasks", tasks, "task", path_is="a task file")
    for i, task in enumerate(tasks):
        where = f"eval.tasks[{i}]"
        if task.kind not in TASK_KINDS:
            raise ConfigError(f"{where}.kind", task.kind, f"one of {', '.join(TASK_KINDS)}")
        check_at_least(f"{where}.limit", task.limit, 0, MAX_SIZE)
        check_at_least(f"{where}.interval", task.interval, 0, MAX_STEPS)
        check_at_least(f"{where}.num_fewshot", task.num_fewshot, 0, MAX_FEWSHOT)
        if task.kind != "multiple_choice" and (task.fewshot_path or task.num_fewshot):
            raise ConfigError(
                f"{where}.num_fewshot",
                task.num_fewshot,
                "0 and no fewshot_path for a bits_per_byte task",
                "solved examples are for multiple-choice tasks",
            )
        if bool(task.fewshot_path) != bool(task.num_fewshot):
            raise ConfigError(
                f"{where}.num_fewshot",
                task.num_fewshot,
                "> 0 exactly when fewshot_path is set",
                "name the file of solved examples and how many of them to show",
            )


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
