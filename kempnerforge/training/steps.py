"""The three step bodies: one optimizer step's forward, backward and clip, reported as a
StepResult.

text_step and vlm_step are the model families' (training/families/), pipeline_step the
pipeline layout's (training/layout.py); select_step_fn in loop.py picks one per job, and
loop.py re-exports all three. They share the micro-batch loop (training/accumulate.py).
"""

from __future__ import annotations

import torch

from kempnerforge.data.pipeline import DataPipeline
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.distributed.tied_head import sum_tied_gradients
from kempnerforge.model.attention import needs_document_mask
from kempnerforge.model.heads import HeadLossSpec, logits_head_loss
from kempnerforge.model.moe import begin_router_step, record_stage_router_stats
from kempnerforge.training.accumulate import accumulate, finish_step, step_tokens
from kempnerforge.training.forward import training_autocast
from kempnerforge.training.loss import TokenCrossEntropy
from kempnerforge.training.mixture_metrics import DatasetSums
from kempnerforge.training.objectives import mtp_forward_args, objective_of
from kempnerforge.training.session import Replicas, StepResult, TrainingSession


def text_step(session: TrainingSession, step: int) -> StepResult:
    """Standard step (no PP, text-only), with optional per-dataset mixture metrics.

    The loss is the job's objective (training/objectives/, by train.loss_fn), weighted by
    its units over the whole step (see accumulate): for the token objective, supervised
    tokens. With train.loss_chunk_tokens > 0 the model computes the per-token losses itself
    from labels, never holding the whole logits (see model/heads/head_loss.py); with 0 it
    returns logits for session.loss_fn (the token objective) or for per-token losses that
    the objective reads. When batches carry
    ``dataset_idx`` (a mixture), the result also holds per-dataset sums of the same loss
    (z-loss term included), taken from the per-token losses the loss already has, so
    their token-weighted mean is the step's loss. ``step`` goes to an MoE model's routers
    (their balancing schedule); dense models do not use it. A model with
    multi-token-prediction modules (model.mtp_depth) gets their targets, and their loss
    joins the objective but not the reported loss (training/objectives/mtp.py).
    """
    model, tc = session.model, session.config.train
    begin_router_step(model, step)
    mask_docs = session.config.data.document_masking
    micro_batches = session.batches.step_batches(tc.grad_accum_steps)
    if mask_docs:
        # A micro-batch of one document per row needs only the causal mask: dropping its
        # doc_ids (read on the host, no sync) lets attention take the causal kernels.
        micro_batches = [
            b if needs_document_mask(b.get("doc_ids")) else _without(b, "doc_ids")
            for b in micro_batches
        ]
    per_dataset = _dataset_sums(session.data, micro_batches, session.runtime.device)
    objective = objective_of(session.config)
    metric_sums = session.objective_sums
    metric_sums.clear()  # a step run again after a fault starts its sums afresh
    spec = HeadLossSpec(tc.loss_chunk_tokens, tc.z_loss_weight)
    # The model computes the loss only when it is the built-in one (a replaced
    # session.loss_fn gets the logits).
    fused = (
        spec.chunk_tokens > 0
        and isinstance(session.loss_fn, TokenCrossEntropy)
        and not objective.per_token_grad
    )
    whole_logits_loss = objective.logits_loss and per_dataset is None

    def micro_loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        doc_ids = batch.get("doc_ids") if mask_docs else None
        inputs, labels = batch["input_ids"], batch["labels"]
        mtp = mtp_forward_args(batch, session.config.model)
        if fused:
            head = model(inputs, doc_ids=doc_ids, labels=labels, loss_spec=spec, **mtp)
        elif whole_logits_loss:
            return session.loss_fn(model(inputs, doc_ids=doc_ids, **mtp), labels)
        else:
            logits = model(inputs, doc_ids=doc_ids, **mtp)
            head = logits_head_loss(logits, labels, tc.z_loss_weight, objective.per_token_grad)
        if per_dataset is not None:
            per_dataset.add(head.token_losses, batch)
        if objective.metric_sums is not None:
            metric_sums.append(objective.metric_sums(head, batch))
        return objective.loss(head, batch)

    loss, grad_norm, supervised = accumulate(session, micro_batches, micro_loss, objective.count)
    # The supervised tokens (the loss's normaliser): every position of pretraining text but
    # a document's last, only the assistant's tokens of a chat corpus. Logged, not counted
    # as the step's tokens (a text model trains on every position it reads).
    result = StepResult(loss=loss, grad_norm=grad_norm, text_tokens=supervised)
    _report_dataset_sums(result, per_dataset, session.runtime, session.replicas)
    return result


def _dataset_sums(
    data: DataPipeline, micro_batches: list[dict[str, torch.Tensor]], device: torch.device
) -> DatasetSums | None:
    """Per-dataset sums on ``device`` for a mixture's step (batches carry ``dataset_idx``),
    else None."""
    names = getattr(data, "dataset_names", [])
    if names and "dataset_idx" in micro_batches[0]:
        return DatasetSums(names, device)
    return None


def _report_dataset_sums(
    result: StepResult,
    per_dataset: DatasetSums | None,
    runtime: RuntimeContext,
    replicas: Replicas,
) -> None:
    """Reduce the step's per-dataset sums over the data- and context-parallel ranks (losses
    also over the pipeline) and the replica groups into ``result``."""
    if per_dataset is None:
        return
    (
        result.dataset_token_counts,
        result.dataset_loss_sums,
        result.dataset_loss_counts,
    ) = per_dataset.finish(runtime.group("dp_cp"), runtime.group("pp"), replicas)


def _step_doc_ids(
    micro_batches: list[dict[str, torch.Tensor]], document_masking: bool
) -> torch.Tensor | None:
    """The step's document ids for the pipeline's stages (its micro-batches' rows in
    order), or None when no row holds two documents: the schedule splits one tensor for
    every micro-batch, so a step masks all its micro-batches or none (read on the host)."""
    packed = any(needs_document_mask(b.get("doc_ids")) for b in micro_batches)
    if not document_masking or not packed:
        return None
    return torch.cat([b["doc_ids"] for b in micro_batches])


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
    begin_router_step(model, step)
    if not session.batches.has_data:
        raise RuntimeError("a VLM step needs a dataloader of image-text batches")
    micro_batches = session.batches.step_batches(tc.grad_accum_steps)
    spec = HeadLossSpec(tc.loss_chunk_tokens, tc.z_loss_weight)
    fused = spec.chunk_tokens > 0 and isinstance(session.loss_fn, TokenCrossEntropy)

    def micro_loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        pixels, input_ids, labels = batch["pixel_values"], batch["input_ids"], batch["labels"]
        if fused:
            return model(pixels, input_ids, labels=labels, loss_spec=spec).loss_sum
        return session.loss_fn(model(pixels, input_ids), labels)

    loss, grad_norm, text_tokens = accumulate(session, micro_batches, micro_loss)
    return StepResult(loss=loss, grad_norm=grad_norm, text_tokens=text_tokens)


def pipeline_step(session: TrainingSession, step: int) -> StepResult:
    """PP step: collect microbatches, hand them to the schedule, broadcast loss.

    The micro-batches are the step's train.grad_accum_steps micro-batches, and the loss is
    normalised exactly as in text_step (summed cross-entropy over the step's supervised
    tokens on every data-parallel rank), so a pipelined run logs and trains on the same
    numbers as one process. The stage holding the head reduces its loss over the
    data-parallel and pipeline groups in finish_step, so every rank of every stage reports
    it; the gradient norm covers all stages, so a NaN anywhere skips the step everywhere.
    An MoE model's stages add their router terms to their own backward and record their
    loads (model/moe/router_stage.py); ``step`` goes to the routers as in text_step.
    With data.document_masking every stage masks packed documents from the step's
    document ids, as the whole model does.
    With train.loss_chunk_tokens > 0 the last stage computes the loss itself, chunked, never
    holding whole logits (distributed/pipeline_parallel.py). A mixture's per-dataset sums take the
    last stage's per-token losses, summed over the pipeline group with the loss.
    """
    bundle = session.pipeline
    if bundle is None:
        raise RuntimeError("pipeline_step needs session.pipeline (distributed.pp > 1)")
    runtime, tc = session.runtime, session.config.train
    begin_router_step(session.model, step)
    micro_batches = session.batches.step_batches(tc.grad_accum_steps)
    tokens = step_tokens(runtime, micro_batches)
    inputs = torch.cat([b["input_ids"] for b in micro_batches]).to(runtime.device)
    labels = torch.cat([b["labels"] for b in micro_batches]).to(runtime.device)
    doc_ids = _step_doc_ids(micro_batches, session.config.data.document_masking)
    if doc_ids is not None:
        doc_ids = doc_ids.to(runtime.device)
    per_dataset = _dataset_sums(session.data, micro_batches, runtime.device)
    with training_autocast(tc, runtime.device):
        loss_sums = bundle.run(inputs, labels, tokens.scale, doc_ids)
    record_stage_router_stats([stage.submod for stage in bundle.stages], bundle.num_microbatches)
    # A tied embedding and head on two stages: each copy gets both gradients.
    sum_tied_gradients(session.model, bundle.group, bundle.pp_size)
    if per_dataset is not None:
        # Only the last stage has per-token losses; every stage counts the tokens.
        token_losses: list[torch.Tensor | None] = list(bundle.token_losses)
        token_losses += [None] * (len(micro_batches) - len(token_losses))
        for batch, losses in zip(micro_batches, token_losses, strict=True):
            sources = {k: batch[k].to(runtime.device) for k in ("labels", "dataset_idx")}
            per_dataset.add(losses, sources)
    loss_sum = torch.stack(loss_sums).sum() if loss_sums else torch.zeros((), device=runtime.device)
    loss, grad_norm, _ = finish_step(session, loss_sum, tokens)
    result = StepResult(loss=loss, grad_norm=grad_norm)
    _report_dataset_sums(result, per_dataset, runtime, session.replicas)
    return result
