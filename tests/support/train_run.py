"""train_steps: a real run of the build and the loop, as the CLI does it, that records each step.

Called in the test process (world size 1) or on every rank of run_distributed (the launch
comes from the environment, as under torchrun). Returns plain data, so it pickles back.
train_ranks runs it on gloo ranks; sample_on_ranks is the end-of-run sample's counterpart.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kempnerforge.config.context_parallel import cp_ring
from kempnerforge.config.loader import load_config
from kempnerforge.distributed.runtime import init_runtime, world_size_from_env
from kempnerforge.training.build import build_session
from kempnerforge.training.inference.sample import sample_text
from kempnerforge.training.loop import StepResult, TrainingSession, run_training_loop
from kempnerforge.training.resume_plan import apply_resume, plan_resume
from tests.support.dist import DEFAULT_TIMEOUT_S, run_distributed


def train_steps(
    overrides: list[str],
    *,
    record_batches: bool = False,
    stop_after: int | None = None,
    config_path: str | None = None,
) -> dict[str, Any]:
    """Train with ``overrides`` (resuming as the config says); record every step body call.

    ``losses``/``grad_norms`` hold each step's StepResult in order (skipped steps
    included), ``dataset_losses`` its per-dataset mean losses (a mixture's; {} otherwise),
    ``batches`` the input_ids of each micro-batch this rank drew (when
    ``record_batches``), ``step``/``tokens_seen`` the loop's final counters. ``stop_after``
    requests a stop (as a signal would) after that many step calls. ``config_path`` is a
    TOML file the overrides apply to (a mixture's [[data.datasets]]).
    """
    config = load_config(config_path, overrides)
    config.validate(world_size_from_env())
    runtime = init_runtime(config.distributed, "cpu", cp_ring(config))
    session = build_session(config, runtime)
    record: dict[str, Any] = {
        "losses": [],
        "grad_norms": [],
        "dataset_losses": [],
        "batches": [],
        "rank": runtime.rank,
    }
    _record_steps(session, record, stop_after)
    if record_batches:
        _record_batches(session, record["batches"])
    with session.tracker:
        plan = plan_resume(config, session.checkpointer)
        step, tokens_seen = apply_resume(session, plan)
        record["start_step"] = step
        step, tokens_seen = run_training_loop(session, step=step, tokens_seen=tokens_seen)
    record.update(step=step, tokens_seen=tokens_seen)
    return record


def _record_steps(session: TrainingSession, record: dict[str, Any], stop_after: int | None) -> None:
    inner = session.step_fn

    def recording(s: TrainingSession, step: int) -> StepResult:
        result = inner(s, step)
        record["losses"].append(result.loss)
        record["grad_norms"].append(result.grad_norm)
        sums, counts = result.dataset_loss_sums or {}, result.dataset_loss_counts or {}
        record["dataset_losses"].append({k: sums[k] / counts[k] for k in counts if counts[k]})
        if stop_after is not None and len(record["losses"]) == stop_after:
            s.shutdown_handler.request("test stop")
        return result

    session.step_fn = recording


def _record_batches(session: TrainingSession, batches: list[torch.Tensor]) -> None:
    stream = session.batches
    inner = stream.next_batch

    def recording() -> dict[str, torch.Tensor]:
        batch = inner()
        batches.append(batch["input_ids"].clone())
        return batch

    stream.next_batch = recording  # type: ignore[method-assign]


def train_on_ranks(rank: int, world_size: int, overrides: list[str], kwargs: dict) -> dict:
    """run_distributed entry point: train_steps on this rank."""
    return train_steps(overrides, **kwargs)


def train_ranks(
    base: list[str],
    run_dir: str | os.PathLike[str],
    world_size: int,
    *extra: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    **kwargs: Any,
) -> list[dict]:
    """train_steps of ``base`` in ``run_dir`` with ``extra`` on ``world_size`` gloo ranks
    (``kwargs`` go to train_steps); one record a rank, by rank. One process is a rank of
    its own too: the build seeds and sets deterministic mode process-wide."""
    overrides = [*base, f"--train.run_dir={run_dir}", *extra]
    return run_distributed(train_on_ranks, world_size, overrides, kwargs, timeout_s=timeout_s)


def sample_on_ranks(rank: int, world_size: int, overrides: list[str]) -> str | None:
    """run_distributed entry point: train for the config's steps, then the end-of-run sample.

    Trained a little first, so the greedy tokens depend on what they attend to: the
    context (and a vision-language model's image)."""
    config = load_config(None, overrides)
    config.validate(world_size_from_env())
    session = build_session(config, init_runtime(config.distributed, "cpu", cp_ring(config)))
    with session.tracker:
        run_training_loop(session, step=0, tokens_seen=0)
    return sample_text(session)
