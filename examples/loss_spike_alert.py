"""Example hook: warn when the training loss spikes above its running mean.

Enable it with `train.hooks = ["examples.loss_spike_alert:LossSpikeAlert"]` and launch from
the repository root (hook modules are looked up in the working directory first), or from
anywhere with the repository root on PYTHONPATH.
"""

from __future__ import annotations

import math

from kempnerforge.core.logging import get_logger
from kempnerforge.training.hooks import StepContext, TrainingHook

logger = get_logger(__name__)


class LossSpikeAlert(TrainingHook):
    """Warn when a step's loss exceeds `factor` times the running mean of earlier losses.

    The mean is a plain average over the first `warmup_steps` losses, then an exponential
    moving average (weight `decay` on the past), so it follows the falling loss of a long
    run instead of remembering its first, high, steps. Nothing is checked during warmup;
    non-finite losses are left to the NaN detector and kept out of the mean. The
    ratio is only meaningful for a positive loss such as cross-entropy.
    """

    def __init__(self, factor: float = 2.0, warmup_steps: int = 10, decay: float = 0.98) -> None:
        self.factor = factor
        self.warmup_steps = warmup_steps
        self.decay = decay
        self.mean = 0.0
        self.count = 0

    def on_step_end(self, ctx: StepContext) -> None:
        if not math.isfinite(ctx.loss):
            return
        spiked = self.mean > 0 and ctx.loss > self.factor * self.mean
        if self.count >= self.warmup_steps and spiked:
            logger.warning(
                "loss spike at step %d: %.4f is %.1fx the running mean %.4f",
                ctx.step,
                ctx.loss,
                ctx.loss / self.mean,
                self.mean,
            )
        self.count += 1
        if self.count <= self.warmup_steps:
            self.mean += (ctx.loss - self.mean) / self.count
        else:
            self.mean = self.decay * self.mean + (1 - self.decay) * ctx.loss
