"""The training step loop and the three step bodies it dispatches to.

run_training_loop owns everything that repeats: the step body, NaN handling,
optimizer/scheduler advance, freeze and phase transitions, metrics, eval, checkpointing,
and shutdown. The step body itself is a plain callable chosen once by select_step_fn(), so
a model family with a different forward contract is a new function rather than another
branch inside the loop. TrainingSession, StepResult and BatchStream live in session.py and
are re-exported here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kempnerforge.config.job import JobConfig
from kempnerforge.config.loader import config_to_dict
from kempnerforge.config.model import ModelConfig
from kempnerforge.core.logging import get_logger
from kempnerforge.model.attention import needs_document_mask
from kempnerforge.model.head_loss import HeadLossSpec, logits_head_loss
from kempnerforge.model.moe import begin_router_step, finish_router_step, moe_layers
from kempnerforge.optim.optimizer import optimizer_eval_mode
from kempnerforge.resilience.agreement import agreed_stop
from kempnerforge.training.accumulate import accumulate, autocast, finish_step, step_tokens
from kempnerforge.training.eval import evaluate
from kempnerforge.training.freeze import freeze_meta_at_step
from kempnerforge.training.grad import total_grad_norm
from kempnerforge.training.hooks import StepContext
from kempnerforge.training.loss import TokenCrossEntropy
from kempnerforge.training.lr import refresh_learning_rates
from kempnerforge.training.mixture_metrics import DatasetSums, dataset_metrics_row
from kempnerforge.training.phases import PhaseState
from kempnerforge.training.phasing import advance_phases
from kempnerforge.training.rollback import data_position, roll_back_or_stop
from kempnerforge.training.session import BatchStream, StepResult, TrainingSession
from kempnerforge.training.state import capture_train_state

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
    """MoE auxiliary + router z-loss terms (only called when mc.is_moe).

    ``loss`` plus moe_aux_loss_weight times the summed load-balancing losses, plus
    moe_router_z_loss_weight times the summed z-losses, of every MoE layer's latest
    forward (model/moe.py). The layers are found once per model, not by walking every
    module each micro-batch; a weight of 0 adds nothing (and no graph).
    """
    stats = [layer.last for layer in moe_layers(model) if layer.last is not None]
    if stats and mc.moe_aux_loss_weight > 0:
        loss = loss + mc.moe_aux_loss_weight * torch.stack([s.aux_loss for s in stats]).sum()
    if stats and mc.moe_router_z_loss_weight > 0:
        z = torch.stack([s.z_loss for s in stats]).sum()
        loss = loss + mc.moe_router_z_loss_weight * z
    return loss


def text_step(session: TrainingSession, step: int) -> StepResult:
    """Standard step (no PP, text-only), with optional per-dataset mixture metrics.

    Token-weighted over the whole step (see accumulate). With train.loss_chunk_tokens > 0
    the model computes the loss itself from labels, never holding the whole logits (see
    model/head_loss.py); with 0 it returns logits for session.loss_fn. When batches carry
    ``dataset_idx`` (a mixture), the result also holds per-dataset sums of the same loss
    (z-loss term included), taken from the per-token losses the loss already has, so
    their token-weighted mean is the step's loss. ``step`` goes to an MoE model's routers
    (their balancing schedule); dense models do not use it.
    """
    model, tc = session.model, session.config.train
    if session.config.model.is_moe:
        begin_router_step(model, step)
    mask_docs = session.config.data.document_masking
    micro_batches = [session.batches.next_batch() for _ in range(tc.grad_accum_steps)]
    if mask_docs:
        # A micro-batch of one document per row needs only the causal mask: dropping its
        # doc_ids (read on the host, no sync) lets attention take the causal kernels.
        micro_batches = [
            b if needs_document_mask(b.get("doc_ids")) else _without(b, "doc_ids")
            for b in micro_batches
        ]
    names = getattr(session.data, "dataset_names", [])
    per_dataset = (
        DatasetSums(names, session.runtime.device)
        if names and "dataset_idx" in micro_batches[0]
        else None
    )
    spec = HeadLossSpec(tc.loss_chunk_tokens, tc.z_loss_weight)
    # The model computes the loss only when it is the built-in one (a replaced
    # session.loss_fn gets the logits).
    fused = spec.chunk_tokens > 0 and isinstance(session.loss_fn, TokenCrossEntropy)

    def micro_loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        doc_ids = batch.get("doc_ids") if mask_docs else None
        inputs, labels = batch["input_ids"], batch["labels"]
        if fused:
            head = model(inputs, doc_ids=doc_ids, labels=labels, loss_spec=spec)
        elif per_dataset is None:
            return session.loss_fn(model(inputs, doc_ids=doc_ids), labels)
        else:
            head = logits_head_loss(model(inputs, doc_ids=doc_ids), labels, tc.z_loss_weight)
        if per_dataset is not None:
            per_dataset.add(head.token_losses, batch)
        return head.loss_sum

    loss, grad_norm, _ = accumulate(session, micro_batches, micro_loss, add_moe_losses)
    result = StepResult(loss=loss, grad_norm=grad_norm)
    if per_dataset is not None:
        (
            result.dataset_token_counts,
            result.dataset_loss_sums,
            result.dataset_loss_counts,
        ) = per_dataset.finish(session.runtime.group("dp"))
    return result


def _without(batch: dict[str, torch.Tensor], key: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in batch.items() if k != key}


def vlm_step(session: TrainingSession, step: int) -> StepResult:
    """VLM step (no PP): pixel_values + input_ids forward, with a text-token count.

    The model is called as ``model(pixel_values, input_ids)`` and returns logits over the
    text positions, aligned with ``labels`` (the data shifts them: each text position
    predicts the next token); session.loss_fn turns them into the summed loss, or, with
    train.loss_chunk_tokens > 0, the model computes it from the labels in chunks, as in
    text_step. The loss is token-weighted over the step's supervised text tokens, and
    ``text_tokens`` is their count over every data-parallel rank, which the loop counts
    as the step's tokens. An MoE decoder's routers get ``step`` as in text_step.
    """
    model, tc = session.model, session.config.train
    if session.config.model.is_moe:
        begin_router_step(model, step)
    if not session.batches.has_data:
        raise RuntimeError("a VLM step needs a dataloader of image-text batches")
    micro_batches = [session.batches.next_batch() for _ in range(tc.grad_accum_steps)]
    spec = HeadLossSpec(tc.loss_chunk_tokens, tc.z_loss_weight)
    fused = spec.chunk_tokens > 0 and isinstance(session.loss_fn, TokenCrossEntropy)

    def micro_loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        pixels, input_ids, labels = batch["pixel_values"], batch["input_ids"], batch["labels"]
        if fused:
            return model(pixels, input_ids, labels=labels, loss_spec=spec).loss_sum
        return session.loss_fn(model(pixels, input_ids), labels)

    loss, grad_norm, text_tokens = accumulate(session, micro_batches, micro_loss, add_moe_losses)
    return StepResult(loss=loss, grad_norm=grad_norm, text_tokens=text_tokens)


def pipeline_step(session: TrainingSession, step: int) -> StepResult:
    """PP step: collect microbatches, hand them to the schedule, broadcast loss.

    The micro-batches are the step's train.grad_accum_steps micro-batches, and the loss is
    normalised exactly as in text_step (summed cross-entropy over the step's supervised
    tokens on every data-parallel rank), so a pipelined run logs and trains on the same
    numbers as one process. The stage holding the head reduces its loss over the
    data-parallel and pipeline groups in finish_step, so every rank of every stage reports
    it; the gradient norm covers all stages, so a NaN anywhere skips the step everywhere.
    step is unused: MoE (the only step-dependent branch) is rejected with PP in
    JobConfig.validate.
    """
    bundle = session.pipeline
    if bundle is None:
        raise RuntimeError("pipeline_step needs session.pipeline (distributed.pp > 1)")
    device = session.runtime.device
    micro_batches = [
        session.batches.next_batch() for _ in range(session.config.train.grad_accum_steps)
    ]
    tokens = step_tokens(session, micro_batches)
    inputs = torch.cat([b["input_ids"] for b in micro_batches]).to(device)
    labels = torch.cat([b["labels"] for b in micro_batches]).to(device)
    with autocast(session):
        loss_sums = bundle.run(inputs, labels, tokens.scale)
    loss_sum = torch.stack(loss_sums).sum() if loss_sums else torch.zeros((), device=device)
    loss, grad_norm, _ = finish_step(session, loss_sum, tokens)
    return StepResult(loss=loss, grad_norm=grad_norm)


def select_step_fn(config: JobConfig) -> Callable[[TrainingSession, int], StepResult]:
    """Pick the step body for this job: PP wins, then VLM, then text-only."""
    if config.distributed.pp > 1:
        return pipeline_step
    return vlm_step if config.is_vlm else text_step


def checkpoint_extra(config: JobConfig, step: int, phases: PhaseState) -> dict:
    """Metadata saved alongside every checkpoint so a resume is exact.

    ``config`` is the whole resolved config: a resume compares it field by field with
    its own (see resume_guard) and a run's effective settings stay recoverable from any
    of its checkpoints. A VLM's ``vlm_freeze`` is the freeze state after the last
    FreezeStage at or before ``step`` (freeze_meta_at_step): a stage firing at ``step``
    runs before the save, so the checkpoint of a transition step holds the new state, and
    a resume checks its own schedule against it.
    """
    extra = {"step": step, "phases": phases.state_dict(), "config": config_to_dict(config)}
    if config.is_vlm:
        extra["vlm_freeze"] = freeze_meta_at_step(config, step)
    return extra


# --- What the loop does around the step body ------------------------------------------


@dataclass
class _Progress:
    """Where the loop stands: optimizer steps taken, tokens trained on, the last step saved."""

    step: int
    tokens_seen: int
    last_saved: int


def _save_checkpoint(session: TrainingSession, progress: _Progress) -> None:
    step = progress.step
    extra = checkpoint_extra(session.config, step, session.phases)
    # Schedule-free optimizers save their averaged point (a no-op for the others); the
    # save stages its copy before returning, so leaving the context right after is safe.
    with optimizer_eval_mode(session.optimizer):
        path = session.checkpointer.save(
            step,
            model=session.model,
            optimizer=session.optimizer,
            scheduler=session.scheduler,
            train_state=capture_train_state(session, step, progress.tokens_seen, extra),
        )
    progress.last_saved = step
    session.tracker.log_event(step, "checkpoint", path=path)


def _checkpoint_committed(session: TrainingSession, step: int, path: str, seconds: float) -> None:
    """A checkpoint is durable under its final name: only now are the hooks told, so a hook
    that copies or uploads ``path`` always finds it complete. In async mode, where that is
    steps after the save started, a ``checkpoint_committed`` event marks the moment; a sync
    save is committed when its ``checkpoint`` event is written."""
    if session.config.checkpoint.async_mode == "async":
        session.tracker.log_event(
            step, "checkpoint_committed", path=path, seconds=round(seconds, 3)
        )
    session.hooks.on_checkpoint_save(step, path)


def _tokens_per_step(session: TrainingSession, result: StepResult) -> int:
    """Tokens the step trained on, over every rank: a VLM's supervised text tokens (from
    its step body), a text model's every position of every sequence."""
    if session.config.is_vlm:
        if result.text_tokens is None:
            raise RuntimeError(
                f"the step body {getattr(session.step_fn, '__name__', session.step_fn)} "
                "returned no text_tokens for a vision-language run: its tokens/s and "
                "tokens_seen would be wrong; count the supervised text tokens in StepResult"
            )
        return result.text_tokens
    tc = session.config.train
    return tc.batch_size * tc.seq_len * tc.grad_accum_steps * session.runtime.dp_size


def _stop_agreed(session: TrainingSession) -> bool:
    """Whether to stop at this step boundary, agreed by every rank.

    Every rank must stop after the same step and save the same checkpoint, whichever rank
    got the signal. The step bodies vote as part of their one host read (finish_step);
    only when no vote was taken since the last boundary (before the first step, after a
    rollback) is there a vote here. (NaN verdicts need no such agreement: the step bodies
    reduce loss and gradient norm, so every rank judges the same numbers.)
    """
    handler = session.shutdown_handler
    vote = handler.take_vote()
    if vote is not None and session.runtime.is_distributed:
        return vote  # one process has no one to agree with: it acts at once, below
    return agreed_stop(handler, session.runtime)


def _start(session: TrainingSession, step: int) -> None:
    """Before the first step: phases due now, hooks, the data iterator and the profiler."""
    session.model.train()
    session.checkpointer.on_commit = functools.partial(_checkpoint_committed, session)
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
        loss=result.loss,
        grad_norm=result.grad_norm,
        attempt=detector.attempt,
        consecutive=detector.consecutive,
        data=detector.last_data_position,
    )
    if detector.exhausted:
        progress.step, progress.tokens_seen = roll_back_or_stop(session, progress.step)
        progress.last_saved = progress.step


def _finish_good_step(session: TrainingSession, result: StepResult, progress: _Progress) -> None:
    """Update the weights, advance step, schedule and phases, then log, evaluate and save."""
    config, optimizer = session.config, session.optimizer
    lr = optimizer.param_groups[0]["lr"]  # the LR this update uses
    tokens = _tokens_per_step(session, result)
    if len(session.hooks):
        session.hooks.on_gradients(
            StepContext(
                progress.step + 1,
                result.loss,
                result.grad_norm,
                lr,
                progress.tokens_seen + tokens,
                session.model,
                optimizer,
            )
        )
    optimizer.step()
    session.scheduler.step()
    refresh_learning_rates(session)  # the phase and rollback scales on top of the schedule
    optimizer.zero_grad(set_to_none=True)
    progress.step += 1
    progress.tokens_seen += tokens
    step, tokens_seen = progress.step, progress.tokens_seen
    router_row = None
    if config.model.is_moe:
        # The sigmoid routers' balancing step, from this step's load over every rank.
        router_row = finish_router_step(
            session.model,
            config.model,
            session.runtime.group("dp"),
            max_steps=config.train.max_steps,
            with_metrics=session.tracker.logs_step(step),
        )
    advance_phases(session, step)
    session.tracker.end_step(
        step,
        loss=result.loss,
        grad_norm=result.grad_norm,
        lr=lr,
        tokens=tokens,
        tokens_seen=tokens_seen,
        data_wait_s=session.batches.take_wait_s(),
        extra={
            **(
                dataset_metrics_row(
                    result.dataset_loss_sums,
                    result.dataset_loss_counts,
                    result.dataset_token_counts,
                )
                or {}
            ),
            **(router_row or {}),
            **_run_health_row(session, step),
        }
        or None,
    )
    session.hooks.on_step_end(
        StepContext(step, result.loss, result.grad_norm, lr, tokens_seen, session.model, optimizer)
    )
    if config.eval.enabled and step % config.eval.interval == 0:
        _run_eval(session, step)
    if session.profiler is not None:
        session.profiler.step()
    # Commit a finished background save, never blocks; the step's reduction (finish_step)
    # already asked every rank whether its write is done, so this holds no collective.
    session.checkpointer.poll()
    if session.checkpointer.should_save(step, config.train.max_steps):
        _save_checkpoint(session, progress)


def _run_health_row(session: TrainingSession, step: int) -> dict[str, float]:
    """On log steps: the NaN-skipped steps so far (the same number on every rank)."""
    if not session.tracker.logs_step(step):
        return {}
    return {"skipped_steps": session.nan_detector.total_skipped}


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
        _save_checkpoint(session, progress)


def _drain_after_failure(session: TrainingSession) -> None:
    """Wait for a save in flight while another error propagates, without masking it."""
    try:
        session.checkpointer.wait()
    except Exception:
        logger.exception("the checkpoint in flight also failed while the run was stopping")


def _run_eval(session: TrainingSession, step: int) -> None:
    with optimizer_eval_mode(session.optimizer):
        metrics = evaluate(session)
    if metrics:
        session.tracker.log_eval(step, metrics)
        session.hooks.on_eval_end(step, metrics)


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
        while progress.step < max_steps and not _stop_agreed(session):
            session.tracker.start_step()
            result = session.step_fn(session, progress.step)
            good = session.nan_detector.check(
                result.loss,
                result.grad_norm,
                progress.step + 1,
                data_position=functools.partial(data_position, session),
            )
            if good:
                _finish_good_step(session, result, progress)
            else:
                _skip_bad_step(session, result, progress)
        _finish(session, progress)
    except BaseException:
        _drain_after_failure(session)
        raise
    finally:
        if session.profiler is not None:
            session.profiler.stop()
    # Drain the pending save first: teardown must not race a background write.
    session.checkpointer.wait()
    # The run's position is recorded; its loader workers go now, not whenever the session
    # is collected. Training again on this session continues at the same batch.
    session.batches.reset()
    session.hooks.on_train_end(progress.step, progress.tokens_seen)
    return progress.step, progress.tokens_seen
