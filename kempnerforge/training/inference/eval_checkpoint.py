"""Evaluating a saved checkpoint outside training (`kempnerforge eval`): its eval data, the
eval batch its run used, the report and the table printed from it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kempnerforge.checkpoint.disk_format import read_marker
from kempnerforge.config.eval import DEFAULT_EVAL_SET, EvalConfig, EvalTaskConfig
from kempnerforge.config.job import JobConfig
from kempnerforge.config.train import TrainConfig
from kempnerforge.core.errors import ConfigError, DataError
from kempnerforge.core.logging import get_logger
from kempnerforge.data.pipeline import DataPipeline
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.evaluation.document_start import training_start
from kempnerforge.evaluation.tasks import LoadedTask, load_tasks
from kempnerforge.training.eval import eval_global_batch, evaluate_model, evaluate_tasks
from kempnerforge.training.families import family_of
from kempnerforge.training.inference.loading import InferenceJob, write_output
from kempnerforge.training.resume_guard import global_batch

logger = get_logger(__name__)


def build_eval_data(config: JobConfig, runtime: RuntimeContext) -> DataPipeline:
    """Tokenizer and eval sets only (no training loader); a DataError when there are none."""
    family = family_of(config)
    data = family.build_data(config, runtime, False)
    if not data.eval_datasets:
        raise DataError(family.no_eval_data)
    return data


def eval_batch_of_checkpoint(
    ec: EvalConfig, tc: TrainConfig, checkpoint: Path, recorded: dict[str, Any] | None
) -> int:
    """Sequences per eval step for evaluating ``checkpoint`` in one process: eval.batch_size,
    or when it is 0 the global batch of the run that saved the checkpoint (``recorded``,
    its config, at the world size its marker records), so this evaluates the windows the
    run's own eval did.

    A checkpoint without a recorded config falls back to this config's global batch in one
    process, with a warning.
    """
    if ec.batch_size:
        return ec.batch_size
    world_size = int((read_marker(checkpoint) or {}).get("world_size", 1))
    trained = global_batch(recorded, world_size) if recorded is not None else None
    if trained is not None:
        return trained
    fallback = eval_global_batch(ec, tc, 1)
    logger.warning(
        "%s records no config of the run that saved it: evaluating %d sequences per eval "
        "step (this config's global batch in one process); set --eval.batch_size to the "
        "run's global batch to evaluate the windows its eval did",
        checkpoint,
        fallback,
    )
    return fallback


def evaluate_checkpoint(
    job: InferenceJob, model: torch.nn.Module, data: DataPipeline
) -> dict[str, Any]:
    """Evaluate ``model`` (the weights of ``job``'s checkpoint) on ``data``'s eval sets,
    over the windows the run's own eval used; the report `kempnerforge eval` writes."""
    config = job.config
    batch = eval_batch_of_checkpoint(config.eval, config.train, job.checkpoint, job.recorded_config)
    config = job.config
    batch_loss = family_of(config).batch_loss(config)
    metrics = evaluate_model(
        model, data, batch_loss, config.eval, config.train, job.runtime.device, global_batch=batch
    )
    return {
        "checkpoint": job.source,
        "step": job.step,
        "eval_steps": job.config.eval.steps,
        "eval_batch_size": batch,
        "metrics": metrics,
    }


def write_report(report: dict[str, Any], path: str) -> None:
    """``report`` as indented JSON at ``path`` (a local path, its directory created, or a
    store URL)."""

    def write(local: str) -> None:
        with open(local, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")

    write_output(path, write)


def format_table(metrics: dict[str, Any], names: list[str], *, named: bool) -> str:
    """One row per eval set (set, tokens, loss, perplexity), plus "all" for several sets."""
    rows: list[tuple[str, float, float, float]] = []
    if named:
        for name in names:
            keys = (f"eval_tokens/{name}", f"eval_loss/{name}", f"eval_ppl/{name}")
            rows.append((name, *(metrics[k] for k in keys)))
    overall = (metrics["eval_tokens"], metrics["eval_loss"], metrics["eval_ppl"])
    if not named:
        rows.append((names[0] if names else DEFAULT_EVAL_SET, *overall))
    elif len(rows) > 1:
        rows.append(("all", *overall))
    width = max(len("set"), *(len(r[0]) for r in rows))
    lines = [f"{'set':<{width}}  {'tokens':>12}  {'loss':>10}  {'perplexity':>12}"]
    for name, tokens, loss, ppl in rows:
        lines.append(f"{name:<{width}}  {int(tokens):>12,}  {loss:>10.6f}  {ppl:>12.4f}")
    return "\n".join(lines)


def select_tasks(configured: list[EvalTaskConfig], names: list[str]) -> list[EvalTaskConfig]:
    """The tasks `--tasks` names, in the order named; every configured task when it names
    none."""
    if not configured:
        raise ConfigError(
            "eval.tasks", [], "at least one [[eval.tasks]] table for --tasks", "docs/evaluation.md"
        )
    by_name = {task.name: task for task in configured}
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise ConfigError("--tasks", unknown, f"names of eval.tasks: {', '.join(by_name)}")
    return [by_name[name] for name in names] if names else list(configured)


def load_checkpoint_tasks(
    job: InferenceJob, data: DataPipeline, names: list[str]
) -> list[LoadedTask]:
    """The tasks `--tasks` names (all when none), read and packed with ``data``'s tokenizer:
    before the model is loaded, so a wrong name or a bad task file costs no load."""
    config = job.config
    tasks = select_tasks(config.eval.tasks, names)
    start = training_start(data.tokenizer, config.data, data)
    return load_tasks(tasks, data.tokenizer, start, config.train.seq_len)


def evaluate_checkpoint_tasks(
    job: InferenceJob, model: torch.nn.Module, data: DataPipeline, tasks: list[LoadedTask]
) -> dict[str, Any]:
    """Score ``model`` (the weights of ``job``'s checkpoint) on ``tasks``, in batches of
    the eval batch the run used; the report it writes."""
    config = job.config
    batch = eval_batch_of_checkpoint(config.eval, config.train, job.checkpoint, job.recorded_config)
    metrics = evaluate_tasks(model, data, config, job.runtime, tasks, global_batch=batch)
    return {
        "checkpoint": job.source,
        "step": job.step,
        "tasks": [task.name for task in tasks],
        "eval_batch_size": batch,
        "metrics": metrics,
    }


def format_task_table(metrics: dict[str, Any], tasks: list[str]) -> str:
    """One row per task: examples, its metrics (acc and acc_norm, or bpb) and seconds."""
    lines = [f"{'task':<20}  {'examples':>9}  {'acc':>8}  {'acc_norm':>8}  {'bpb':>8}  {'s':>8}"]
    for name in tasks:
        key = f"eval/{name}"

        def cell(metric: str, key: str = key) -> str:
            value = metrics.get(f"{key}/{metric}")
            return "-" if value is None else f"{value:.4f}"

        examples = int(metrics[f"{key}/examples"])
        seconds = metrics[f"{key}/seconds"]
        lines.append(
            f"{name:<20}  {examples:>9,}  {cell('acc'):>8}  {cell('acc_norm'):>8}  "
            f"{cell('bpb'):>8}  {seconds:>8.2f}"
        )
    return "\n".join(lines)
