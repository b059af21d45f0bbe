"""The training step loop, and the choice of its step body.

run_training_loop owns everything that repeats: the step body, NaN handling,
optimizer/scheduler advance, freeze and phase transitions, metrics, eval, checkpointing,
and shutdown. The step body itself is a plain callable chosen once by select_step_fn(), so
a model family with a different forward contract is a new function rather than another
branch inside the loop. The three step bodies live in steps.py; they and TrainingSession,
StepResult and BatchStream (session.py) are re-exported here.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kempnerforge.checkpoint.memory_tier import snapshot
from kempnerforge.config.job import JobConfig
from kempnerforge.config.loader import config_to_dict
from kempnerforge.config.model import ModelConfig
from kempnerforge.core.logging import get_logger
from kempnerforge.distributed.gradients import total_grad_norm
from kempnerforge.model.moe import add_router_losses, finish_router_step
from kempnerforge.optim.optimizer import optimizer_eval_mode
from kempnerforge.resilience.agreement import agreed_stop
from kempnerforge.resilience.hang import CHECKPOINT, EVAL, STEP, watch
from kempnerforge.training.eval import evaluate, evaluate_tasks, tasks_due
from kempnerforge.training.families import family_of
from kempnerforge.training.faults import (
    attempt_step,
    drain_after_failure,
    roll_back_or_stop,
    tolerating_failed_saves,
)
from kempnerforge.training.hooks import HookRunner, StepContext, announce_commit
from kempnerforge.training.layout import layout_of
from kempnerforge.training.lr import refresh_learning_rates
from kempnerforge.training.mixture_metrics import dataset_metrics_row
from kempnerforge.training.objectives import finish_mtp_step, objective_metrics_row, objective_of
from kempnerforge.training.phases import PhaseState
from kempnerforge.training.session import BatchStream, StepResult, TrainingSession
from kempnerforge.training.state import capture_train_state
from kempnerforge.training.steps import pipeline_step, text_step, vlm_step
from kempnerforge.training.transitions import advance_phases

__all__ = [
    "BatchStream",
    "StepResult",
    "TrainingSession",
    "add_moe_losses",
    "checkpoint_extra",
    "clip_grads",
    "pipeline_step",
    "run_training_loop",
    "select_step_fn",
    "text_step",
    "vlm_step",
]

logger = get_logger(__name__)


def clip_grads(model: torch.nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm to max_norm (0: no clipping); return the norm before."""
    return float(total_grad_norm(model, max_norm))


def add_moe_losses(loss: torch.Tensor, model: torch.nn.Module, mc: ModelConfig) -> torch.Tensor:
    """MoE auxiliary + router z-loss terms; ``loss`` itself for a model without MoE layers.

    ``loss`` plus moe_aux_loss_weight times the summed load-balancing losses, plus
    moe_router_z_loss_weight times the summed z-losses, of every MoE layer's latest
    forward: model/moe/router_step.py's add_router_losses, which the step bodies use too.
    """
    return add_router_losses(loss, model, mc)


def select_step_fn(config: JobConfig) -> Callable[[TrainingSession, int], StepResult]:
    """Pick the step body for this job: PP wins, then VLM, then text-only.

    A pipeline layout brings its own step body (pipeline_step); otherwise the model family
    names its own (vlm_step, text_step).
    """
    return layout_of(config.distributed).step or family_of(config).step


def checkpoint_extra(config: JobConfig, step: int, phases: PhaseState) -> dict:
    """Metadata saved alongside every checkpoint so a resume is exact.

    ``config`` is the whole resolved config: a resume compares it field by field with
    its own (see resume_guard) and a run's effective settings stay recoverable from any
    of its checkpoints. The model family adds its own keys: a VLM's ``vlm_freeze`` is the
    freeze state after the last FreezeStage at or before ``step``: a stage firing at
    ``step`` runs before the save, so the checkpoint of a transition step holds the new
    state, and a resume checks its own schedule against it.
    """
    extra = {"step": step, "phases": phases.state_dict(), "config": config_to_dict(config)}
    extra.update(family_of(config).checkpoint_extra(config, step))
    return extra


# --- The loop ---------------------------------------------------------------------------


@dataclass
class _Progress:
    """Where the loop stands: optimizer steps taken, tokens trained on, the last step saved."""

    step: int
    tokens_seen: int
    last_saved: int


def run_training_loop(
    session: TrainingSession, *, step: int = 0, tokens_seen: int = 0
) -> tuple[int, int]:
    """Run the step loop from step to train.max_steps.

    Returns the final (step, tokens_seen). Drains any pending async checkpoint before
    returning so the caller can tear down the process group safely, and stops the training
    loader's workers (its position is kept: another call continues at the next batch).
    session.data is read once and must stay fixed for the duration; only its dataloader
    may be swapped mid-run.

    ``step`` counts optimizer updates: a step skipped for a non-finite loss or gradient
    norm consumes its batches but advances neither ``step`` nor the scheduler, so the LR
    schedule and the step count always agree. A shutdown request is honoured at every
    step boundary, before the first step and after skipped steps included, with a
    checkpoint of the last good step unless it is already on disk.
    """
    progress = _Progress(step, tokens_seen, last_saved=step if step > 0 else -1)
    max_steps = session.config.train.max_steps
    _start(session, step)
    try:
        # Every rank stops after the same step and saves the same checkpoint, whichever rank
        # got the signal: the step bodies vote as part of their one host read (finish_step),
        # and only when no vote was taken since the last boundary (before the first step,
        # after a rollback) is there a vote here. (NaN verdicts need no such agreement: the
        # step bodies reduce loss and gradient norm, so every rank judges the same numbers.)
        while progress.step < max_steps and not agreed_stop(
            session.shutdown_handler, session.runtime
        ):
            with watch(STEP, progress.step + 1):  # the hang watchdog's limit (hang.py)
                _train_step(session, progress)
        _finish(session, progress)
    except BaseException:
        drain_after_failure(session.checkpointer)
        raise
    finally:
        if session.profiler is not None:
            session.profiler.stop()
    # Drain the pending save first: teardown must not race a background write.
    with watch(CHECKPOINT, progress.step):
        session.checkpointer.wait()
    if session.memory_tier is not None:
        session.memory_tier.close(finished=progress.step >= max_steps)
    # The run's position is recorded; its loader workers go now, not whenever the session
    # is collected. Training again on this session continues at the same batch.
    session.batches.reset()
    session.hooks.on_train_end(progress.step, progress.tokens_seen)
    return progress.step, progress.tokens_seen


def _train_step(session: TrainingSession, progress: _Progress) -> None:
    """One attempt at the next step: the step body, then its update or its skip."""
    session.tracker.start_step()
    result, good = attempt_step(session, progress.step)  # run again on a fault
    if good:
        _finish_good_step(session, result, progress)
    else:
        _skip_bad_step(session, result, progress)


def _start(session: TrainingSession, step: int) -> None:
    """Before the first step: phases due now, hooks, the data iterator and the profiler."""
    session.model.train()
    session.checkpointer.on_commit = functools.partial(
        announce_commit,
        session.hooks,
        session.tracker,
        session.config.checkpoint.async_mode == "async",
    )
    advance_phases(session, step)  # phases starting at step 0 (or missed before a resume)
    session.hooks.on_train_begin(session.config)
    if session.batches.has_data:
        session.batches.ensure_started()  # spawns workers outside the timed region
    if session.profiler is not None:
        session.profiler.start()


def _skip_bad_step(session: TrainingSession, result: StepResult, progress: _Progress) -> None:
    """The step's loss or gradient norm is not finite: drop its gradients, advance nothing,
    and after a streak roll back to the last checkpoint (or stop)."""
    session.optimizer.zero_grad(set_to_none=True)
    session.batches.take_wait_s()  # a skipped step is not timed
    detector = session.nan_detector
    session.tracker.log_event(
        progress.step + 1,
        "nan_skip",
        reason=detector.last_reason,
        loss=result.loss,
        grad_norm=result.grad_norm,
        attempt=detector.attempt,
        consecutive=detector.consecutive,
        data=detector.last_data_position,
    )
    if detector.exhausted:
        with watch(CHECKPOINT, progress.step):
            progress.step, progress.tokens_seen = roll_back_or_stop(session, progress.step)
        progress.last_saved = progress.step


def _finish_good_step(session: TrainingSession, result: StepResult, progress: _Progress) -> None:
    """Update the weights, advance step, schedule and phases, then log, evaluate and save."""
    lr = session.optimizer.param_groups[0]["lr"]  # the LR this update uses
    tokens = _tokens_per_step(session, result, progress.step + 1)
    progress.step += 1
    progress.tokens_seen += tokens
    ctx = StepContext(
        progress.step,
        result.loss,
        result.grad_norm,
        lr,
        progress.tokens_seen,
        session.model,
        session.optimizer,
    )
    _update_weights(session.optimizer, session.scheduler, session.hooks, ctx)
    refresh_learning_rates(session)  # the phase and rollback scales on top of the schedule
    # An MoE model's routers after the update: the sigmoid routers' balancing step, from this
    # step's load over every rank, and on log steps their metrics row, every pipeline stage's
    # layers included (model/moe/router_step.py; nothing for a model without MoE layers).
    router_row = finish_router_step(
        session.model,
        session.config.model,
        session.runtime.group("dp_cp"),
        max_steps=session.config.train.max_steps,
        with_metrics=session.tracker.logs_step(progress.step),
        stage_group=session.runtime.group("pp"),
    )
    # The multi-token-prediction loss on log steps (training/objectives/mtp.py; nothing without it).
    mtp_row = finish_mtp_step(
        session.model,
        session.runtime.group("dp_cp"),
        with_metrics=session.tracker.logs_step(progress.step),
    )
    # The objective's own metrics on log steps (DPO's rewards; nothing for the token loss).
    objective_row = objective_metrics_row(
        objective_of(session.config),
        session.objective_sums,
        session.runtime.group("dp_cp"),
        with_metrics=session.tracker.logs_step(progress.step),
    )
    router_row = {**(router_row or {}), **(mtp_row or {}), **(objective_row or {})} or None
    advance_phases(session, progress.step)
    _log_step(session, result, ctx, tokens, router_row)
    _evaluate_if_due(session, progress.step)
    if session.profiler is not None:
        session.profiler.step()
    _save_if_due(session, progress)


def _tokens_per_step(session: TrainingSession, result: StepResult, step: int) -> int:
    """Tokens the step trained on, over every rank, as the model family counts them (a
    VLM's supervised text tokens, from its step body; a text model's every position)."""
    family = family_of(session.config)
    # Every data-parallel rank of every designed replica group: a step always trains on
    # the whole global batch, however many groups took part in it.
    dp_size = session.runtime.dp_size * session.replicas.num_groups
    tokens = family.tokens_per_step(session.config.train, dp_size, result)
    if tokens is None:
        name = getattr(session.step_fn, "__name__", session.step_fn)
        raise RuntimeError(
            f"the step body {name} returned no text_tokens at step {step}, which a "
            f"{family.name} run counts as its tokens: its tokens/s and tokens_seen would be "
            "wrong; count the supervised text tokens in StepResult"
        )
    return tokens


def _update_weights(
    optimizer: torch.optim.Optimizer, scheduler: Any, hooks: HookRunner, ctx: StepContext
) -> None:
    """The optimizer update of step ``ctx.step``: the gradient hooks see the gradients
    first, then the optimizer and the schedule step and the gradients are dropped."""
    if len(hooks):
        hooks.on_gradients(ctx)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def _log_step(
    session: TrainingSession,
    result: StepResult,
    ctx: StepContext,
    tokens: int,
    router_row: dict[str, object] | None,
) -> None:
    """The metrics row of step ``ctx.step`` (with the mixture, router and health columns),
    then the hooks' on_step_end."""
    step = ctx.step
    mixture_row = dataset_metrics_row(
        result.dataset_loss_sums, result.dataset_loss_counts, result.dataset_token_counts
    )
    health_row = {
        **({} if result.text_tokens is None else {"supervised_tokens": result.text_tokens}),
        "skipped_steps": session.nan_detector.total_skipped,
        **session.replicas.metrics_row(),
    }
    extra = {
        **(mixture_row or {}),
        **(router_row or {}),
        # On log steps: the NaN-skipped steps so far (the same number on every rank) and
        # the replica groups' participation (each group's own, no collective).
        **(health_row if session.tracker.logs_step(step) else {}),
    }
    session.tracker.end_step(
        step,
        loss=result.loss,
        grad_norm=result.grad_norm,
        lr=ctx.lr,
        tokens=tokens,
        tokens_seen=ctx.tokens_seen,
        data_wait_s=session.batches.take_wait_s(),
        extra=extra or None,
    )
    session.hooks.on_step_end(ctx)


def _evaluate_if_due(session: TrainingSession, step: int) -> None:
    """In-loop eval every eval.interval steps, and each downstream task at its interval and
    after the last step, at the optimizer's evaluation point. Pipeline stages have no
    whole-model forward for the held-out sets (the build warned); the tasks go through the
    stages' schedule."""
    config = session.config
    heldout = config.eval.enabled and step % config.eval.interval == 0
    heldout = heldout and layout_of(config.distributed).forward_refusal is None
    tasks = tasks_due(config.eval, config.train.max_steps, session.data.eval_tasks, step)
    if not heldout and not tasks:
        return
    began = time.perf_counter()
    with watch(EVAL, step), optimizer_eval_mode(session.optimizer):
        metrics = evaluate(session.model, session.data, config, session.runtime) if heldout else {}
        metrics.update(
            evaluate_tasks(
                session.model,
                session.data,
                config,
                session.runtime,
                tasks,
                pipeline=session.pipeline,
            )
        )
    if metrics:
        # The loop's seconds in eval, for the goodput account (metrics/goodput.py).
        eval_time_s = round(time.perf_counter() - began, 3)
        session.tracker.log_eval(step, {**metrics, "eval_time_s": eval_time_s})
        session.hooks.on_eval_end(step, metrics)


def _save_if_due(session: TrainingSession, progress: _Progress) -> None:
    """Commit a finished background save, and start a save when one is due; a save that
    fails is reported and training goes on (faults/save_failures.py)."""
    checkpointer = session.checkpointer
    with tolerating_failed_saves(session):
        # Never blocks: the step's reduction (finish_step) already asked every rank whether
        # its write is done, so this holds no collective.
        checkpointer.poll()
    if checkpointer.should_save(progress.step, session.config.train.max_steps):
        with tolerating_failed_saves(session), watch(CHECKPOINT, progress.step):
            checkpointer.wait()  # the save in flight fails on its own account, not this one's
        with tolerating_failed_saves(session):
            save_checkpoint(session, progress.step, progress.tokens_seen)
            progress.last_saved = progress.step
    elif session.config.checkpoint.memory_interval:
        memory = session.config.checkpoint.memory_interval
        if progress.step % memory == 0 and progress.step < session.config.train.max_steps:
            # The memory tier's copy (checkpoint/memory_tier.py); the end's checkpoint follows
            # the last step.
            save_checkpoint(session, progress.step, progress.tokens_seen, to_memory=True)


def _finish(session: TrainingSession, progress: _Progress) -> None:
    """After the last step or a stop: log a shutdown, and save what is not saved yet."""
    unsaved = progress.step != progress.last_saved and progress.step > 0
    if session.shutdown_handler.requested:
        session.tracker.flush()  # the steps since the last row still get their row
        name = session.shutdown_handler.signal_name or "a stop request"
        what = "saving and exiting" if unsaved else "nothing new to save, exiting"
        logger.warning("shutdown requested by %s at step %d: %s", name, progress.step, what)
        session.tracker.log_event(progress.step, "shutdown", signal=name)
    if unsaved:
        # Off-schedule end (or a shutdown): never lose the steps since the last save.
        save_checkpoint(session, progress.step, progress.tokens_seen)
        progress.last_saved = progress.step


def save_checkpoint(
    session: TrainingSession, step: int, tokens_seen: int, *, to_memory: bool = False
) -> str:
    """Start a checkpoint of ``step`` (committed now in sync mode, later in async mode) with
    the loop's metadata and train state, and log its ``checkpoint`` event (with the seconds
    the loop blocked for); its path. ``to_memory``: this rank's copy in the memory tier
    instead (host memory; a ``memory_copy`` event), written in the background."""
    began = time.perf_counter()
    extra = checkpoint_extra(session.config, step, session.phases)
    train_state = capture_train_state(
        session.data,
        session.nan_detector,
        step,
        tokens_seen,
        extra,
        session.batches.state_dict(),
    )
    # Schedule-free optimizers save their averaged point (a no-op for the others); the
    # save stages its copy before returning, so leaving the context right after is safe.
    with watch(CHECKPOINT, step), optimizer_eval_mode(session.optimizer):
        if to_memory and session.memory_tier is not None:
            copy = snapshot(session.model, session.optimizer, session.scheduler, train_state)
            path = session.memory_tier.save(step, copy)
        else:
            path = session.checkpointer.save(
                step,
                model=session.model,
                optimizer=session.optimizer,
                scheduler=session.scheduler,
                train_state=train_state,
            )
    # seconds: what the loop blocked for (in async mode the staging only), for goodput.
    seconds = round(time.perf_counter() - began, 3)
    event = "memory_copy" if to_memory else "checkpoint"
    session.tracker.log_event(step, event, path=path, seconds=seconds)
    return path
