"""Log-likelihood sums of packed windows, spread over the data-parallel ranks.

Every rank holds the same windows (evaluation/windows.py). Each step takes the next
``global_batch`` of them; data-parallel rank r scores its contiguous share, in forwards of
at most ``max_rows`` rows, and a rank with a short share pads it with windows that score
nothing, so every rank runs the same forwards (a sharded model gathers its weights in
each). Tensor-parallel and pipeline peers hold the same share; context-parallel peers
score their slices of each row. Each rank adds its tokens' negative log-likelihoods into a
float64 sum per slot, and one all-reduce over the data- and context-parallel ranks
(``group``) gives every rank every slot's total: each window was scored by one of them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from kempnerforge.data.dataset import IGNORE_INDEX
from kempnerforge.evaluation.windows import Windows
from kempnerforge.model.head_loss import HeadLossSpec

BatchSlice = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


@torch.no_grad()
def slot_sums(
    model: torch.nn.Module,
    windows: Windows,
    slots: int,
    *,
    device: torch.device,
    dp_rank: int,
    dp_size: int,
    global_batch: int,
    max_rows: int,
    loss_chunk_tokens: int,
    group: dist.ProcessGroup | None = None,
    batch_slice: BatchSlice | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> torch.Tensor:
    """(slots, 2) float64: each slot's summed negative log-likelihood (nats) and its count
    of scored tokens, the same on every rank. The model runs in eval mode (its mode is
    restored after) under ``autocast`` (the training step's precision)."""
    sums = torch.zeros(slots, 2, dtype=torch.float64, device=device)
    global_batch = max(1, min(global_batch, windows.rows))  # a small task pads no further
    per_rank = math.ceil(global_batch / dp_size)
    spec = HeadLossSpec(loss_chunk_tokens, z_loss_weight=0.0)
    was_training = model.training
    model.eval()
    try:
        for step_start in range(0, windows.rows, global_batch):
            step_end = min(step_start + global_batch, windows.rows)
            first = min(step_start + dp_rank * per_rank, step_end)
            share = _rows(windows, first, min(first + per_rank, step_end), per_rank)
            for start in range(0, per_rank, max_rows):
                batch = {k: v[start : start + max_rows] for k, v in share.items()}
                _score(model, batch, sums, device, spec, batch_slice, autocast)
    finally:
        model.train(was_training)
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


def _score(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    sums: torch.Tensor,
    device: torch.device,
    spec: HeadLossSpec,
    batch_slice: BatchSlice | None,
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> None:
    """One forward: its tokens' negative log-likelihoods added into their slots."""
    slots = batch["slots"]
    if batch_slice is not None:  # this rank's slice of each row (context parallelism)
        batch = {
            **batch,
            **batch_slice({"input_ids": batch["input_ids"], "labels": batch["labels"]}),
        }
        slots = batch_slice({"labels": slots})["labels"]
    inputs = {k: batch[k].to(device) for k in ("input_ids", "labels", "doc_ids")}
    with autocast():
        result = model(
            inputs["input_ids"], doc_ids=inputs["doc_ids"], labels=inputs["labels"], loss_spec=spec
        )
    scored = slots >= 0
    if not bool(scored.any()):
        return
    index = slots[scored].to(device)
    nll = result.token_losses[scored.to(device)].double()
    sums[:, 0].index_add_(0, index, nll)
    sums[:, 1].index_add_(0, index, torch.ones_like(nll))
