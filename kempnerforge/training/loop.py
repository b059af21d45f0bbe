"""The training step loop and the three step bodies it dispatches to.

run_training_loop owns everything that repeats: the step body, NaN handling,
optimizer/scheduler advance, freeze and phase transitions, metrics, eval, checkpointing,
and shutdown. The step body itself is a plain callable (StepFn) chosen once by
select_step_fn(), so a model family with a different forward contract is a new function
rather than another branch inside the loop.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from kempnerforge.checkpoint.manager import CheckpointManager
from kempnerforge.config.job import JobConfig
from kempnerforge.config.model import ModelConfig
from kempnerforge.data.phases import PhaseState
from kempnerforge.data.pipeline import DataPipeline
from kempnerforge.distributed.pipeline import PipelineBundle
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.metrics.logging import get_logger
from kempnerforge.metrics.tracker import MetricsTracker
from kempnerforge.resilience.agreement import agree_on_stop
from kempnerforge.resilience.nan import NaNDetector
from kempnerforge.resilience.shutdown import ShutdownHandler
from kempnerforge.training.eval import evaluate
from kempnerforge.training.grad import maybe_no_sync, total_grad_norm
from kempnerforge.training.hooks import HookRunner, StepContext
from kempnerforge.training.loss import IGNORE_INDEX
from kempnerforge.training.mixture_metrics import DatasetSums, dataset_metrics_row
from kempnerforge.training.optimizer import optimizer_eval_mode
from kempnerforge.training.phasing import advance_phases, apply_phase_lr_scale
from kempnerforge.training.state import capture_train_state, math_fingerprint, roll_back_or_stop

logger = get_logger(__name__)


class BatchStream:
    """The training dataloader plus its live iterator.

    Wraps the epoch-boundary restart and the "no dataloader configured" case so the step
    bodies don't each re-implement them. The loader is read off the pipeline on every
    access, so swapping pipeline.dataloader takes effect on the next step instead of
    leaving a stale snapshot.
    """

    def __init__(self, pipeline: DataPipeline) -> None:
        self._pipeline = pipeline
        self._iterator: Iterator[dict[str, torch.Tensor]] | None = None
        self._iterator_loader: Any = None  # the loader the live iterator came from

    @property
    def dataloader(self) -> Any:
        return self._pipeline.dataloader

    @property
    def has_data(self) -> bool:
        return self.dataloader is not None

    def ensure_started(self) -> None:
        """Materialize the iterator, if it isn't already, for the loader in use.

        next_batch does this itself; the loop calls it up front so building an iterator
        (which spawns dataloader workers) stays outside the region MetricsTracker times.
        """
        loader = self.dataloader
        if loader is None:
            raise RuntimeError(
                "no training data is configured (the data pipeline has no dataloader); "
                "set data.path or leave it empty for the built-in corpus"
            )
        if self._iterator is None or self._iterator_loader is not loader:
            self._iterator = iter(loader)
            self._iterator_loader = loader

    def reset(self) -> None:
        """Drop the iterator so the next step takes a fresh one from the loader.

        A StatefulDataLoader re-applies its recorded skip, so this picks up inside the
        current epoch rather than restarting it.
        """
        loader = self.dataloader
        if self._iterator is not None and hasattr(loader, "state_dict"):
            # Record the exact position (prefetched-but-unconsumed batches excluded) and
            # have the loader start its next iterator there.
            loader.load_state_dict(loader.state_dict())
        self._iterator = None
        self._iterator_loader = None

    def next_batch(self) -> dict[str, torch.Tensor]:
        self.ensure_started()
        assert self._iterator is not None
        try:
            return next(self._iterator)
        except StopIteration:
            # Epoch boundary: a new iterator starts the next epoch.
            self._iterator = iter(self._iterator_loader)
            try:
                return next(self._iterator)
            except StopIteration:
                raise RuntimeError(
                    "the training dataloader yields no batches: the dataset has fewer "
                    "windows than one batch per data-parallel rank"
                ) from None


@dataclass
class StepResult:
    """What one training step reports back to the loop.

    The per-dataset fields stay empty for step bodies that don't produce them;
    text_tokens stays None, which a VLM run treats as an error rather than logging a zero.
    """

    loss: float
    grad_norm: float
    text_tokens: int | None = None
    dataset_token_counts: dict[str, int] = field(default_factory=dict)
    dataset_loss_sums: dict[str, float] = field(default_factory=dict)
    dataset_loss_counts: dict[str, int] = field(default_factory=dict)


StepFn = Callable[["TrainingSession", int], StepResult]


@dataclass
class TrainingSession:
    """Everything one training run needs after the build phase."""

    config: JobConfig
    runtime: RuntimeContext
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    step_fn: Callable[[TrainingSession, int], StepResult]
    data: DataPipeline
    phases: PhaseState
    checkpointer: CheckpointManager
    tracker: MetricsTracker
    hooks: HookRunner
    nan_detector: NaNDetector
    shutdown_handler: ShutdownHandler
    pipeline: PipelineBundle | None = None
    eval_dataloader: Any | None = None
    profiler: Any | None = None

    @property
    def batches(self) -> BatchStream:
        """The live batch iterator. Rebuilt if data is replaced wholesale."""
        stream = self.__dict__.get("_batches")
        if stream is None or stream._pipeline is not self.data:
            stream = BatchStream(self.data)
            self.__dict__["_batches"] = stream
        return stream


def clip_grads(model: torch.nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm to max_norm (0: no clipping); return the norm before."""
    return float(total_grad_norm(model, max_norm))


def add_moe_losses(loss: torch.Tensor, model: torch.nn.Module, mc: ModelConfig) -> torch.Tensor:
    """MoE auxiliary + router z-loss terms (only called when mc.is_moe).

    Reads the ``aux_loss`` and ``router_z_loss`` tensors that MoE layers leave on
    themselves during forward, and adds their weighted sums to ``loss``.
    """
    for module in model.modules():
        aux = getattr(module, "aux_loss", None)
        if isinstance(aux, torch.Tensor):
            loss = loss + mc.moe_aux_loss_weight * aux
        z = getattr(module, "router_z_loss", None)
        if mc.moe_router_z_loss_weight > 0 and isinstance(z, torch.Tensor):
            loss = loss + mc.moe_router_z_loss_weight * z
    return loss


def _autocast(session: TrainingSession) -> contextlib.AbstractContextManager:
    if session.config.train.mixed_precision == "bf16":
        return torch.autocast(session.runtime.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _global_count(count: int, session: TrainingSession) -> int:
    """Sum a per-rank count over the data-parallel ranks (identity in one process)."""
    if not session.runtime.is_distributed:
        return count
    total = torch.tensor([count], dtype=torch.int64, device=session.runtime.device)
    dist.all_reduce(total)
    return int(total.item())


Forward = Callable[[dict[str, torch.Tensor]], torch.Tensor]


def _accumulate(
    session: TrainingSession, micro_batches: list[dict[str, torch.Tensor]], forward: Forward
) -> tuple[float, int]:
    """Forward and backward every micro-batch; return (mean loss, supervised tokens).

    The loss is normalised by the supervised tokens of the whole step (every micro-batch,
    every data-parallel rank), so each token weighs the same however the micro-batches
    split them. Labels are counted on the host before any forward, which costs no device
    sync; the loss is read back once, at the end.
    """
    tc, mc, model = session.config.train, session.config.model, session.model
    local_tokens = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in micro_batches)
    num_tokens = _global_count(local_tokens, session)
    # DDP/FSDP average gradients over ranks; multiply back so the result is a global sum.
    scale = session.runtime.dp_size / max(num_tokens, 1)
    loss_sum = torch.zeros((), device=session.runtime.device)
    for micro, cpu_batch in enumerate(micro_batches):
        batch = _to_device(cpu_batch, session.runtime.device)
        with maybe_no_sync(model, micro, len(micro_batches)):
            with _autocast(session):
                loss = session.loss_fn(forward(batch), batch["labels"])
            objective = loss * scale
            if mc.is_moe:
                # Aux terms are per-micro-batch means: average them over the micro-batches.
                accum = tc.grad_accum_steps
                objective = add_moe_losses(objective * accum, model, mc) / accum
            objective.backward()
        loss_sum += loss.detach()
    if session.runtime.is_distributed:
        dist.all_reduce(loss_sum)
    return float(loss_sum) / max(num_tokens, 1), num_tokens


def text_step(session: TrainingSession, step: int) -> StepResult:
    """Standard step (no PP, text-only), with optional per-dataset mixture metrics.

    Token-weighted over the whole step (see _accumulate). When batches carry
    ``dataset_idx`` (a mixture), the result also holds per-dataset sums that add up to the
    step's figures. ``step`` is unused by dense models.
    """
    model, tc = session.model, session.config.train
    mask_docs = session.config.data.document_masking
    micro_batches = [session.batches.next_batch() for _ in range(tc.grad_accum_steps)]
    names = getattr(session.data, "dataset_names", [])
    per_dataset = (
        DatasetSums(names, session.runtime.device)
        if names and "dataset_idx" in micro_batches[0]
        else None
    )

    def forward(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(batch["input_ids"], doc_ids=batch.get("doc_ids") if mask_docs else None)
        if per_dataset is not None:
            per_dataset.add(logits, batch)
        return logits

    loss, _ = _accumulate(session, micro_batches, forward)
    result = StepResult(loss=loss, grad_norm=clip_grads(model, tc.grad_clip_norm))
    if per_dataset is not None:
        (
            result.dataset_token_counts,
            result.dataset_loss_sums,
            result.dataset_loss_counts,
        ) = per_dataset.finish(session.runtime.is_distributed)
    return result


def vlm_step(session: TrainingSession, step: int) -> StepResult:
    """VLM step (no PP): pixel_values + input_ids forward, with a text-token count.

    The model is called as ``model(pixel_values, input_ids)`` and returns logits over the
    text positions, aligned with ``labels``.
    """
    model, tc = session.model, session.config.train
    if not session.batches.has_data:
        raise RuntimeError("a VLM step needs a dataloader of image-text batches")
    micro_batches = [session.batches.next_batch() for _ in range(tc.grad_accum_steps)]

    def forward(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(batch["pixel_values"], batch["input_ids"])

    loss, text_tokens = _accumulate(session, micro_batches, forward)
    return StepResult(
        loss=loss, grad_norm=clip_grads(model, tc.grad_clip_norm), text_tokens=text_tokens
    )


def pipeline_step(session: TrainingSession, step: int) -> StepResult:
    """PP step: collect microbatches, hand them to the schedule, broadcast loss.

    step is unused — MoE (the only step-dependent branch) is rejected with PP in
    JobConfig.validate.
    """
    bundle = session.pipeline
    if bundle is None:
        raise RuntimeError("pipeline_step needs session.pipeline (distributed.pp > 1)")
    tc = session.config.train
    device = session.runtime.device
    micro_batches = [session.batches.next_batch() for _ in range(tc.grad_accum_steps)]
    inputs = torch.cat([b["input_ids"] for b in micro_batches]).to(device)
    labels = torch.cat([b["labels"] for b in micro_batches]).to(device)
    losses: list[torch.Tensor] = []
    if bundle.is_first and bundle.is_last:
        bundle.schedule.step(inputs, target=labels, losses=losses)
    elif bundle.is_first:
        bundle.schedule.step(inputs)
    elif bundle.is_last:
        bundle.schedule.step(target=labels, losses=losses)
    else:
        bundle.schedule.step()
    grad_norm = clip_grads(session.model, tc.grad_clip_norm)
    loss = torch.stack(losses).mean() if losses else torch.zeros((), device=device)
    summary = torch.stack([loss.detach().float(), torch.tensor(grad_norm, device=device)])
    if bundle.pp_size > 1:
        # Every stage reports the last stage's loss; the norm is that stage's local norm.
        last = dist.get_global_rank(bundle.group, bundle.pp_size - 1) if bundle.group else None
        dist.broadcast(
            summary, src=last if last is not None else bundle.pp_size - 1, group=bundle.group
        )
    return StepResult(loss=float(summary[0]), grad_norm=float(summary[1]))


def select_step_fn(config: JobConfig) -> Callable[[TrainingSession, int], StepResult]:
    """Pick the step body for this job: PP wins, then VLM, then text-only."""
    if config.distributed.pp > 1:
        return pipeline_step
    return vlm_step if config.is_vlm else text_step


def checkpoint_extra(config: JobConfig, step: int, phases: PhaseState) -> dict:
    """Metadata saved alongside every checkpoint so a resume is exact.

    vlm_freeze reflects the post-transition state when a FreezeStage has fired (see
    freeze_meta_at_step).
    """
    extra: dict[str, Any] = {
        "step": step,
        "phases": phases.state_dict(),
        "math": math_fingerprint(config),
    }
    return extra


def _save_checkpoint(session: TrainingSession, step: int, tokens_seen: int) -> str:
    extra = checkpoint_extra(session.config, step, session.phases)
    # Schedule-free optimizers save their averaged point (a no-op for the others); the
    # save stages its copy before returning, so leaving the context right after is safe.
    with optimizer_eval_mode(session.optimizer):
        path = session.checkpointer.save(
            step,
            model=session.model,
            optimizer=session.optimizer,
            scheduler=session.scheduler,
            train_state=capture_train_state(session, step, tokens_seen, extra),
        )
    session.tracker.log_event(step, "checkpoint", path=path)
    return path


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


def _tokens_per_step(session: TrainingSession) -> int:
    tc = session.config.train
    return tc.batch_size * tc.seq_len * tc.grad_accum_steps * session.runtime.dp_size


def run_training_loop(
    session: TrainingSession, *, step: int = 0, tokens_seen: int = 0
) -> tuple[int, int]:
    """Run the step loop from step to train.max_steps.

    Returns the final (step, tokens_seen). Drains any pending async checkpoint before
    returning so the caller can tear down the process group safely. session.data is read
    once and must stay fixed for the duration; only its dataloader may be swapped mid-run.

    ``step`` counts optimizer updates: a step skipped for a non-finite loss or gradient
    norm consumes its batches but advances neither ``step`` nor the scheduler, so the LR
    schedule and the step count always agree. A shutdown request is honoured at every
    step boundary, skipped steps included, with a checkpoint of the last good step.
    """
    config, tc = session.config, session.config.train
    model, optimizer, tracker = session.model, session.optimizer, session.tracker
    batches = session.batches  # session.data is fixed for the run: resolve the stream once
    tokens_per_step = _tokens_per_step(session)
    last_saved = step if step > 0 else -1  # a resumed step is already on disk
    model.train()
    session.checkpointer.on_commit = functools.partial(_checkpoint_committed, session)
    advance_phases(session, step)  # phases starting at step 0 (or missed before a resume)
    session.hooks.on_train_begin(config)
    if batches.has_data:
        batches.ensure_started()
    if session.profiler is not None:
        session.profiler.start()
    try:
        while step < tc.max_steps:
            tracker.start_step()
            result = session.step_fn(session, step)
            if not session.nan_detector.check(result.loss, result.grad_norm, step + 1):
                optimizer.zero_grad(set_to_none=True)
                tracker.log_event(
                    step + 1,
                    "nan_skip",
                    loss=result.loss,
                    grad_norm=result.grad_norm,
                    consecutive=session.nan_detector.consecutive,
                )
                if session.nan_detector.exhausted:
                    step, tokens_seen = roll_back_or_stop(session, step)
                    last_saved = step
                if _stop_agreed(session):
                    break
                continue
            lr = optimizer.param_groups[0]["lr"]  # the LR this update used
            optimizer.step()
            session.scheduler.step()
            apply_phase_lr_scale(session)
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += tokens_per_step
            advance_phases(session, step)
            tracker.end_step(
                step,
                loss=result.loss,
                grad_norm=result.grad_norm,
                lr=lr,
                tokens=tokens_per_step,
                tokens_seen=tokens_seen,
                extra=dataset_metrics_row(
                    result.dataset_loss_sums,
                    result.dataset_loss_counts,
                    result.dataset_token_counts,
                ),
            )
            session.hooks.on_step_end(
                StepContext(step, result.loss, result.grad_norm, lr, tokens_seen, model, optimizer)
            )
            if config.eval.enabled and step % config.eval.interval == 0:
                _run_eval(session, step)
            if session.profiler is not None:
                session.profiler.step()
            session.checkpointer.poll()  # commit a finished background save, never blocks
            if session.checkpointer.should_save(step, tc.max_steps):
                _save_checkpoint(session, step, tokens_seen)
                last_saved = step
            if _stop_agreed(session):
                break
        if session.shutdown_handler.requested:
            tracker.flush()  # the steps since the last row still get their row
            name = session.shutdown_handler.signal_name or "a stop request"
            logger.warning("shutdown requested by %s at step %d: saving and exiting", name, step)
            tracker.log_event(step, "shutdown", signal=name)
        if step != last_saved and step > 0:
            # Off-schedule end (or a shutdown): never lose the steps since the last save.
            _save_checkpoint(session, step, tokens_seen)
    except BaseException:
        _drain_after_failure(session)
        raise
    finally:
        if session.profiler is not None:
            session.profiler.stop()
    # Drain the pending save first: teardown must not race a background write.
    session.checkpointer.wait()
    session.hooks.on_train_end(step, tokens_seen)
    return step, tokens_seen


def _drain_after_failure(session: TrainingSession) -> None:
    """Wait for a save in flight while another error propagates, without masking it."""
    try:
        session.checkpointer.wait()
    except Exception:
        logger.exception("the checkpoint in flight also failed while the run was stopping")


def _stop_agreed(session: TrainingSession) -> bool:
    """Whether to stop at this step boundary, agreed by every rank.

    One tiny collective per step when distributed, so every rank stops after the same step
    and saves the same checkpoint whichever rank got the signal. (NaN verdicts need no such
    agreement: the step bodies reduce loss and gradient norm, so every rank judges the
    same numbers.)
    """
    handler = session.shutdown_handler
    if not session.runtime.is_distributed:
        return handler.requested
    stop = agree_on_stop(handler.requested, session.runtime.device)
    if stop and not handler.requested:
        handler.request("another rank received a stop signal")
    return stop


def _run_eval(session: TrainingSession, step: int) -> None:
    with optimizer_eval_mode(session.optimizer):
        metrics = evaluate(session)
    if metrics:
        session.tracker.log_eval(step, metrics)
        session.hooks.on_eval_end(step, metrics)
