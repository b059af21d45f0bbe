"""Per-dataset loss and token sums of one mixture step, kept on the device until the end."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from kempnerforge.data.dataset import IGNORE_INDEX

if TYPE_CHECKING:
    from kempnerforge.training.session import Replicas


class DatasetSums:
    """Accumulates, per source dataset, loss sums and token counts over a step's micro-batches.

    Rows are attributed by the batch's ``dataset_idx``. Everything stays on the device
    (index_add) and is read back in one transfer by ``finish``. The losses are the
    per-token values of the step's own objective (cross-entropy plus the z-loss term, as
    the step's loss), so the per-dataset sums add up to the step's loss sum.
    """

    def __init__(self, names: list[str], device: torch.device) -> None:
        self.names = names
        self.loss_sums = torch.zeros(len(names), dtype=torch.float64, device=device)
        self.loss_counts = torch.zeros(len(names), dtype=torch.int64, device=device)
        self.token_counts = torch.zeros(len(names), dtype=torch.int64, device=device)

    @torch.no_grad()
    def add(self, token_losses: torch.Tensor | None, batch: dict[str, torch.Tensor]) -> None:
        """Add one micro-batch: ``token_losses`` (batch, seq) is its objective per
        position, 0 where the label is ignored (HeadLoss.token_losses); None counts the
        tokens only (a pipeline stage without the head)."""
        labels, source = batch["labels"], batch["dataset_idx"]
        supervised = labels != IGNORE_INDEX
        if token_losses is not None:
            self.loss_sums.index_add_(0, source, token_losses.detach().sum(1).double())
        self.loss_counts.index_add_(0, source, supervised.sum(1))
        self.token_counts.index_add_(0, source, torch.full_like(source, labels.shape[1]))

    def finish(
        self,
        group: dist.ProcessGroup | None,
        loss_group: dist.ProcessGroup | None = None,
        replicas: Replicas | None = None,
    ) -> tuple[dict[str, int], dict[str, float], dict[str, int]]:
        """(token counts, loss sums, supervised-token counts) by name, summed over ``group``
        (the data-parallel ranks; None in a single process) and over ``replicas`` (the
        replica groups of the step's quorum, whose batches are other slots of the step). The
        loss sums are also summed over ``loss_group``: the pipeline ranks, of which only the
        last stage's holds them.

        The three go as one float64 vector (counts are exact in float64 up to 2**53), so a
        step pays one all-reduce per group and one read to the host.
        """
        n = len(self.names)
        if loss_group is not None:  # exact: the other stages add zeros
            dist.all_reduce(self.loss_sums, group=loss_group)
        flat = torch.cat([self.loss_sums, self.loss_counts.double(), self.token_counts.double()])
        if group is not None:
            dist.all_reduce(flat, group=group)
        if replicas is not None:
            replicas.sum_(flat)
        values = flat.tolist()
        sums, counts, tokens = values[:n], values[n : 2 * n], values[2 * n :]
        return (
            {name: int(t) for name, t in zip(self.names, tokens, strict=True)},
            dict(zip(self.names, sums, strict=True)),
            {name: int(c) for name, c in zip(self.names, counts, strict=True)},
        )


def dataset_metrics_row(
    loss_sums: dict[str, float], loss_counts: dict[str, int], token_counts: dict[str, int]
) -> dict[str, float] | None:
    """loss/<name> (NaN when the step drew nothing from it) and tokens/<name> for a mixture
    step's metrics row; None for a step without per-dataset sums."""
    if not loss_counts:
        return None
    row: dict[str, float] = {}
    for name, count in loss_counts.items():
        row[f"loss/{name}"] = loss_sums[name] / count if count else math.nan
        row[f"tokens/{name}"] = token_counts.get(name, 0)
    return row
