"""The micro-batch half of a step: forward and backward over each micro-batch, token-weighted.

text_step and vlm_step share it, so the normalisation by the step's supervised tokens (all
micro-batches, all data-parallel ranks) exists once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from kempnerforge.config.model import ModelConfig
from kempnerforge.data.dataset import IGNORE_INDEX
from kempnerforge.training.grad import maybe_no_sync
from kempnerforge.training.session import TrainingSession

MoELosses = Callable[[torch.Tensor, torch.nn.Module, ModelConfig], torch.Tensor]


def autocast(session: TrainingSession) -> contextlib.AbstractContextManager:
    """bf16 autocast on the session's device when train.mixed_precision says so."""
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


def accumulate(
    session: TrainingSession,
    micro_batches: list[dict[str, torch.Tensor]],
    forward: Forward,
    add_moe_losses: MoELosses,
) -> tuple[float, int]:
    """Forward and backward every micro-batch; return (mean loss, supervised tokens).

    The loss is normalised by the supervised tokens of the whole step (every micro-batch,
    every data-parallel rank), so each token weighs the same however the micro-batches
    split them. Labels are counted on the host before any forward, which costs no device
    sync; the loss is read back once, at the end. ``add_moe_losses`` (the loop's) adds
    the router terms of an MoE model to each micro-batch's objective.
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
            with autocast(session):
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
