"""Example hook: per-group gradient statistics, written beside the run's metrics.

Enable it with `train.hooks = ["examples.gradient_stats:GradientStats"]` (launch from the
repository root, or with it on PYTHONPATH). Every `every` steps it writes one JSON line to
<run_dir>/gradient_stats.jsonl: for each top-level module group (the embedding, each
block, the final norm, the head) the gradient's L2 norm and the update-free ratio
grad norm / weight norm, which shows which layers the optimizer is pushing hardest.

It reads gradients in `on_gradients`, the one event at which they exist (after backward
and clipping, before the optimizer step and zero_grad). Under FSDP each rank holds a
shard, so the norms here are of this rank's shard; run it on one process, or reduce the
squared sums over ranks before the square root.
"""

from __future__ import annotations

import json
import os

import torch

from kempnerforge.config.job import JobConfig
from kempnerforge.training.hooks import StepContext, TrainingHook

OUTPUT = "gradient_stats.jsonl"


def group_of(name: str) -> str:
    """'layers.3.attention.wq.weight' -> 'layers.3'; 'norm.weight' -> 'norm'."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


class GradientStats(TrainingHook):
    """Gradient norm and grad/weight ratio per module group, every `every` steps."""

    def __init__(self, every: int = 10) -> None:
        self.every = every
        self.path: str | None = None

    def on_train_begin(self, config: JobConfig) -> None:
        self.path = os.path.join(config.run_dir, OUTPUT)

    @torch.no_grad()
    def on_gradients(self, ctx: StepContext) -> None:
        if self.path is None or ctx.step % self.every:
            return
        grad_sq: dict[str, float] = {}
        weight_sq: dict[str, float] = {}
        for name, param in ctx.model.named_parameters():
            if param.grad is None:
                continue
            group = group_of(name)
            grad_sq[group] = grad_sq.get(group, 0.0) + float(param.grad.float().square().sum())
            weight_sq[group] = weight_sq.get(group, 0.0) + float(param.float().square().sum())
        row = {
            "step": ctx.step,
            "grad_norm": {g: v**0.5 for g, v in grad_sq.items()},
            "grad_to_weight": {
                g: (v / weight_sq[g]) ** 0.5 if weight_sq[g] > 0 else None
                for g, v in grad_sq.items()
            },
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
