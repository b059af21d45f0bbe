"""build_scheduler: linear warmup, then a named decay shape, as a state_dict-able LambdaLR."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kempnerforge.config.registry import Registry
from kempnerforge.config.scheduler import SchedulerConfig

# A decay shape maps progress p in [0, 1] through the post-warmup steps to an LR factor.
DecayShape = Callable[[float, SchedulerConfig], float]
SCHEDULES: Registry[DecayShape] = Registry("scheduler.name")


@SCHEDULES.register("cosine")
def cosine(progress: float, cfg: SchedulerConfig) -> float:
    r = cfg.min_lr_ratio
    return r + (1 - r) * 0.5 * (1 + math.cos(math.pi * progress))


@SCHEDULES.register("linear")
def linear(progress: float, cfg: SchedulerConfig) -> float:
    return 1 - (1 - cfg.min_lr_ratio) * progress


@SCHEDULES.register("constant")
def constant(progress: float, cfg: SchedulerConfig) -> float:
    return 1.0


@SCHEDULES.register("none")
def no_schedule(progress: float, cfg: SchedulerConfig) -> float:
    """Factor 1 throughout; lr_factor also skips the warmup for this name."""
    return 1.0


@SCHEDULES.register("rex")
def rex(progress: float, cfg: SchedulerConfig) -> float:
    """REX: (1 - p) / (1 - p/2), i.e. flat early and steep late, from 1 down to min_lr_ratio."""
    r = cfg.min_lr_ratio
    return r + (1 - r) * (1 - progress) / (1 - progress / 2)


# WSD's final decay: decay progress q in [0, 1] -> fraction of (1 - min_lr_ratio) still left.
WSD_DECAY_SHAPES: dict[str, Callable[[float], float]] = {
    "linear": lambda q: 1 - q,
    "cosine": lambda q: 0.5 * (1 + math.cos(math.pi * q)),
    "sqrt": lambda q: 1 - math.sqrt(q),
}


@SCHEDULES.register("wsd")
def warmup_stable_decay(progress: float, cfg: SchedulerConfig) -> float:
    """Flat at the peak, then a wsd_decay_type decay to min_lr_ratio over the last
    wsd_decay_fraction."""
    stable = 1 - cfg.wsd_decay_fraction
    if progress <= stable or cfg.wsd_decay_fraction == 0:
        return 1.0
    decay_progress = (progress - stable) / cfg.wsd_decay_fraction
    r = cfg.min_lr_ratio
    return r + (1 - r) * WSD_DECAY_SHAPES[cfg.wsd_decay_type](decay_progress)


def lr_factor(step: int, cfg: SchedulerConfig, max_steps: int) -> float:
    """LR multiplier used for optimizer step ``step + 1`` (``step`` steps already taken).

    Warmup ramps linearly so the first step already trains (factor 1/warmup), reaching the
    peak after warmup steps; the decay shape then runs from progress 0 to 1 at max_steps.
    The warmup is min(warmup_steps, max_steps): a run shorter than its warmup still reaches
    the peak, at its last step (JobConfig.validate warns). The 'none' schedule has no warmup:
    factor 1 from step 0.
    """
    if cfg.name == "none":
        return 1.0
    warmup = min(cfg.warmup_steps, max_steps)
    if step < warmup:
        return (step + 1) / warmup
    decay_steps = max(max_steps - warmup, 1)
    progress = min((step - warmup) / decay_steps, 1.0)
    return SCHEDULES.get(cfg.name)(progress, cfg)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: SchedulerConfig, max_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR whose state (last_epoch, base_lrs) is all a resume needs.

    The factor function is rebuilt from the config, so resuming with a longer max_steps
    reshapes the remaining schedule rather than replaying the old one.
    """
    SCHEDULES.get(cfg.name)  # unknown names fail here, at build time, not at step 1
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg, max_steps)
    )
