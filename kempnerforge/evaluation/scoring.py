"""Log-likelihood sums of packed windows, spread over the data-parallel ranks.

Every rank holds the same windows (evaluation/windows.py). Each step takes the next
``global_batch`` of them; data-parallel rank r scores its contiguous share, in forwards of
``rows_per_forward`` rows, and a rank with a short share pads it with windows that score
nothing, so every rank runs the same forwards (a sharded model gathers its weights in
each). Tensor-parallel peers hold the same share; context-parallel peers score their
slices of each row; pipeline stages pass each forward on, and the last one has the
losses. Each rank adds its tokens' negative log-likelihoods into a float64 sum per slot,
and all-reduces over ``groups`` (the pipeline group, then the data- and
context-parallel ranks) give every rank every slot's total: each window was scored by one
of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from kempnerforge.data.dataset import IGNORE_INDEX
from kempnerforge.distributed.pipeline_parallel import PipelineBundle
from kempnerforge.evaluation.windows import Windows
from kempnerforge.model.heads import HeadLossSpec

BatchSlice = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
TokenLosses = Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor] | None]
"""A forward over a batch of window rows (input_ids, labels, doc_ids, slots on the host):
each scored position's negative log-likelihood and the slots of the same positions, on
the rank that has them; None on a rank that computes no losses (an early pipeline stage)."""


def whole_model_losses(
    model: torch.nn.Module,
    device: torch.device,
    loss_chunk_tokens: int,
    batch_slice: BatchSlice | None = None,
) -> TokenLosses:
    """Token losses from a model that runs whole on the rank (sharded or not): the fused
    head's per-token cross-entropy (no z-loss) with the rows' document ids, on this rank's
    slice of each row under context parallelism (``batch_slice``)."""
    spec = HeadLossSpec(loss_chunk_tokens, z_loss_weight=0.0)

    def forward(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        slots = batch["slots"]
        if batch_slice is not None:
            held = batch_slice({"input_ids": batch["input_ids"], "labels": batch["labels"]})
            batch = {**batch, **held}
            slots = batch_slice({"labels": slots})["labels"]  # cut as the labels are
        inputs = {k: batch[k].to(device) for k in ("input_ids", "labels", "doc_ids")}
        result = model(
            inputs["input_ids"], doc_ids=inputs["doc_ids"], labels=inputs["labels"], loss_spec=spec
        )
        return result.token_losses, slots

    return forward


def pipeline_losses(bundle: PipelineBundle, device: torch.device) -> TokenLosses:
    """Token losses through the pipeline's stages (PipelineBundle.score), on the rank that
    holds the last stage; every stage masks with the rows' document ids, so a row packs
    several requests as the whole model's does."""

    def forward(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        inputs = {k: batch[k].to(device) for k in ("input_ids", "labels", "doc_ids")}
        losses = bundle.score(inputs["input_ids"], inputs["labels"], inputs["doc_ids"])
        if not losses:
            return None
        return torch.cat(losses), batch["slots"]

    return forward


@torch.no_grad()
def slot_sums(
    model: torch.nn.Module,
    windows: Windows,
    slots: int,
    token_losses: TokenLosses,
    *,
    device: torch.device,
    dp_rank: int = 0,
    dp_size: int = 1,
    global_batch: int,
    rows_per_forward: int,
    whole_forwards: bool = False,
    groups: Sequence[dist.ProcessGroup | None] = (),
) -> torch.Tensor:
    """(slots, 2) float64: each slot's summed negative log-likelihood (nats) and its count
    of scored tokens, the same on every rank. ``model`` runs in eval mode (its mode is
    restored after). ``whole_forwards``: every forward takes exactly rows_per_forward rows
    (a pipeline splits them into its micro-batches), padding the last."""
    sums = torch.zeros(slots, 2, dtype=torch.float64, device=device)
    global_batch = max(1, min(global_batch, windows.rows))  # a small task pads no further
    per_rank = math.ceil(global_batch / dp_size)
    if whole_forwards:
        per_rank = math.ceil(per_rank / rows_per_forward) * rows_per_forward
    was_training = model.training
    model.eval()
    try:
        for step_start in range(0, windows.rows, global_batch):
            step_end = min(step_start + global_batch, windows.rows)
            first = min(step_start + dp_rank * per_rank, step_end)
            share = _rows(windows, first, min(first + per_rank, step_end), per_rank)
            for start in range(0, per_rank, rows_per_forward):
                batch = {k: v[start : start + rows_per_forward] for k, v in share.items()}
                _add(sums, token_losses(batch), device)
    finally:
        model.train(was_training)
    for group in groups:
        if group is not None:
            dist.all_reduce(sums, group=group)
    return sums


def _rows(windows: Windows, start: int, end: int, count: int) -> dict[str, torch.Tensor]:
    """Rows start..end of the windows, padded to ``count`` rows that score nothing."""
    pad = count - (end - start)
    rows = {
        "input_ids": windows.input_ids[start:end],
        "labels": windows.labels[start:end],
        "doc_ids": windows.doc_ids[start:end],
        "slots": windows.slots[start:end],
    }
    if pad:
        width = windows.input_ids.size(1)
        fill = {"input_ids": 0, "labels": IGNORE_INDEX, "doc_ids": 0, "slots": -1}
        rows = {
            k: torch.cat([v, torch.full((pad, width), fill[k], dtype=v.dtype)])
            for k, v in rows.items()
        }
    return rows


def _add(
    sums: torch.Tensor,
    scored: tuple[torch.Tensor, torch.Tensor] | None,
    device: torch.device,
) -> None:
    """One forward's token losses added into their slots."""
    if scored is None:
        return
    losses, slots = scored
    where = slots >= 0
    if not bool(where.any()):
        return
    index = slots[where].to(device)
    nll = losses[where.to(device)].double()
    sums[:, 0].index_add_(0, index, nll)
    sums[:, 1].index_add_(0, index, torch.ones_like(nll))
