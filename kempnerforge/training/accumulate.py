"""The micro-batch half of a step: forward and backward over each micro-batch, token-weighted.

text_step and vlm_step share it, so the normalisation by the step's supervised tokens (all
micro-batches, all data-parallel ranks) exists once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kempnerforge.distributed.gradients import maybe_no_sync, total_grad_norm
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.model.moe import add_micro_batch_router_losses, record_router_stats
from kempnerforge.training.forward import training_autocast
from kempnerforge.training.objectives import Batch, add_mtp_loss, begin_mtp_step, label_count
from kempnerforge.training.session import Replicas, TrainingSession


def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@dataclass
class StepTokens:
    """The step's supervised tokens over every micro-batch and data-parallel rank.

    Both stay on the device: counting costs no host sync before the forward.
    """

    count: torch.Tensor
    """Global supervised-token count, a 0-d int64 tensor."""
    scale: torch.Tensor
    """Ranks / count: turns this rank's summed loss into its share of the token mean. The
    gradient reduction averages over the data-parallel (and context-parallel) ranks, so
    their number brings it back to a sum; the division makes every token weigh the same."""


def step_tokens(
    runtime: RuntimeContext,
    micro_batches: list[dict[str, torch.Tensor]],
    replicas: Replicas | None = None,
    units: Callable[[Batch], int] = label_count,
) -> StepTokens:
    """Count the step's supervised tokens (or the objective's ``units``): on the host
    per rank, summed over the data-parallel and context-parallel group on the device
    (``dp_cp``: context-parallel peers hold different positions of the same sequences;
    tensor-parallel and pipeline peers hold the same batches, so they are not counted
    again), then over the replica groups, if any."""
    local = sum(units(b) for b in micro_batches)
    count = torch.tensor(local, dtype=torch.int64, device=runtime.device)
    group = runtime.group("dp_cp")
    if group is not None:
        dist.all_reduce(count, group=group)
    if replicas is not None:
        replicas.sum_(count)
    ranks = runtime.mesh_size("dp_cp")
    return StepTokens(count, (ranks / count.clamp(min=1).double()).float())


def finish_step(
    session: TrainingSession, loss_sum: torch.Tensor, tokens: StepTokens
) -> tuple[float, float, int]:
    """Reduce the step's loss, clip, vote on stopping; return (loss, grad norm, tokens).

    ``loss_sum`` is this rank's summed loss (zero on a pipeline stage without the head).
    It is summed over the data-parallel (and context-parallel) group, then over the
    pipeline group, then over the replica groups, so every rank reports the global
    token-weighted mean that one process would; the gradients (and an MoE model's router
    totals, which the bias step reads) are summed over the replica groups before the clip,
    and the gradient norm is global over every mesh, stage and group (total_grad_norm).
    Two votes are taken over the world in one all-reduce: stop
    (any rank asked to) and whether any rank's background checkpoint write is still
    running. All of it comes to the host together, in the step's one read. The votes are
    left with the shutdown handler and the checkpoint manager, so neither the loop's stop
    check nor its checkpoint poll needs a collective of its own before the next step.
    """
    runtime, handler, checkpointer = session.runtime, session.shutdown_handler, session.checkpointer
    loss_sum = loss_sum.detach().double()
    if session.config.train.attribute_faults:
        # This rank's own share (before the reduction), read only if the step is faulty.
        session.nan_detector.local_loss = loss_sum * tokens.scale.double()
    for name in ("dp_cp", "pp"):
        group = runtime.group(name)
        if group is not None:
            dist.all_reduce(loss_sum, group=group)
    session.replicas.sum_(loss_sum)
    session.replicas.sum_gradients(session.model)
    session.replicas.sum_router_totals(session.model)
    grad_norm = total_grad_norm(session.model, session.config.train.grad_clip_norm)
    votes = torch.tensor(
        [float(handler.requested), float(checkpointer.writing)], device=runtime.device
    )
    world = runtime.group("world")
    if world is not None:
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=world)
    reduced = torch.stack([loss_sum, tokens.count.double(), grad_norm.double()])
    loss_total, count, norm, stop_vote, writing_vote = torch.cat([reduced, votes.double()]).tolist()
    handler.record_vote(bool(stop_vote))
    checkpointer.record_write_vote(bool(writing_vote))
    return loss_total / max(count, 1.0), norm, int(count)


MicroLoss = Callable[[dict[str, torch.Tensor]], torch.Tensor]
"""A step body's forward for one micro-batch (on the device): its summed loss, 0-d."""


def accumulate(
    session: TrainingSession,
    micro_batches: list[dict[str, torch.Tensor]],
    micro_loss: MicroLoss,
    units: Callable[[Batch], int] = label_count,
) -> tuple[float, float, int]:
    """Forward and backward every micro-batch; return (mean loss, grad norm, tokens).

    ``micro_loss`` (the step body's) runs the forward of one micro-batch under autocast
    and returns its summed loss. The loss is normalised by the supervised tokens of the
    whole step (every micro-batch, every data-parallel rank), so each token weighs the
    same however the micro-batches and ranks split them. The data-parallel gradient
    reduction runs on the last micro-batch only (maybe_no_sync). Nothing is read to the
    host until finish_step, which also clips. The router terms of an MoE model join each
    micro-batch's objective, and its router statistics the step's totals (model/moe/router_step.py;
    both do nothing for a model without MoE layers); so do the multi-token-prediction
    modules' losses (training/objectives/mtp.py), which the returned loss leaves out. ``units``
    gives a micro-batch's units of the loss (the objective's, training/objectives/): its
    supervised tokens by default.
    """
    config, model, device = session.config, session.model, session.runtime.device
    tokens = step_tokens(session.runtime, micro_batches, session.replicas, units)
    begin_mtp_step(model)
    loss_sum = torch.zeros((), device=device)
    for micro, cpu_batch in enumerate(micro_batches):
        batch = _to_device(cpu_batch, device)
        with maybe_no_sync(model, micro, len(micro_batches)):
            with training_autocast(config.train, device):
                loss = micro_loss(batch)
            objective = add_micro_batch_router_losses(
                loss * tokens.scale, model, config.model, config.train.grad_accum_steps
            )
            objective = add_mtp_loss(objective, model, config.model, tokens.scale)
            record_router_stats(model)
            objective.backward()
        loss_sum += loss.detach()
    return finish_step(session, loss_sum, tokens)
