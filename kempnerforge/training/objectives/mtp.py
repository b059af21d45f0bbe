"""The training step's side of multi-token prediction (model.mtp_depth, model/mtp.py): its
targets for a micro-batch, its term in the objective, and its loss in the step's metrics.

Every function here does nothing for a model without MTP modules, so the step bodies and the
loop call them unconditionally.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from kempnerforge.config.model import ModelConfig
from kempnerforge.model.mtp import mtp_modules, mtp_targets

MTP_LOSS = "mtp/loss"
"""Metric: the MTP modules' cross-entropy per supervised target, averaged over depths."""
MTP_LOSS_BY_DEPTH = "mtp/loss_by_depth"
"""Metric (model.mtp_depth > 1): each depth's cross-entropy per supervised target."""


def mtp_forward_args(batch: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The keyword a text model's training forward takes for its MTP modules: their targets
    from the batch's labels and document ids (every row's, whether or not attention masks
    documents: a target in another document is never predicted); nothing without MTP."""
    if not cfg.mtp_depth:
        return {}
    return {"mtp_targets": mtp_targets(batch["labels"], batch.get("doc_ids"), cfg.mtp_depth)}


def begin_mtp_step(model: nn.Module) -> None:
    """Forget the totals of a step that did not finish (a skipped one)."""
    modules = mtp_modules(model)
    if modules is not None:
        modules.totals = None
        modules.last = None


def add_mtp_loss(
    objective: torch.Tensor, model: nn.Module, cfg: ModelConfig, scale: torch.Tensor
) -> torch.Tensor:
    """One micro-batch's objective plus model.mtp_loss_weight / model.mtp_depth times the
    MTP modules' summed cross-entropies of its forward, times ``scale`` (the step's
    ranks / supervised tokens, as the main loss): the report's lambda / D * sum_k L_k,
    each L_k normalised by the main loss's token count.

    The forward's losses are taken (model.mtp.last becomes None) and added, detached, to
    the step's totals for the metrics. Without a forward of the MTP modules the objective
    comes back as it is.
    """
    modules = mtp_modules(model)
    if modules is None or modules.last is None:
        return objective
    sums, counts = modules.last
    modules.last = None
    step = torch.stack([sums.detach().double(), counts.double()])
    modules.totals = step if modules.totals is None else modules.totals + step
    return objective + (cfg.mtp_loss_weight / cfg.mtp_depth) * sums.sum() * scale


def finish_mtp_step(
    model: nn.Module, group: dist.ProcessGroup | None, *, with_metrics: bool
) -> dict[str, object] | None:
    """On log steps, the step's MTP metrics over every data-parallel rank (one all-reduce
    of 2 * model.mtp_depth values over ``group``); None otherwise or without MTP. Clears
    the totals either way."""
    modules = mtp_modules(model)
    if modules is None:
        return None
    totals, modules.totals = modules.totals, None
    if not with_metrics:
        return None
    if totals is None:  # a rank without a forward this step still joins the reduction
        device = next(modules.parameters()).device
        totals = torch.zeros(2, len(modules), dtype=torch.float64, device=device)
    if group is not None:
        dist.all_reduce(totals, group=group)
    sums, counts = totals.tolist()
    by_depth = [s / c if c else 0.0 for s, c in zip(sums, counts, strict=True)]
    row: dict[str, object] = {MTP_LOSS: sum(by_depth) / len(by_depth)}
    if len(by_depth) > 1:
        row[MTP_LOSS_BY_DEPTH] = by_depth
    return row
