"""What a resume does with each config field that differs from the checkpoint's.

Every checkpoint carries the resolved config of the run that saved it. On resume each
differing field falls in one of three kinds, and none is ever silent:

- applied: the new value takes effect from the resumed step, with a warning naming the
  field and both values: learning rate, weight decay, betas, eps and the other optimizer
  hyperparameters, the MoE router loss weights and bias update rate, gradient clipping,
  FP8 matmuls (train.float8), the schedule, max_steps, the NaN thresholds, the data
  sources (the sampler restarts its epoch over changed data, and says so), and a VLM's
  freeze list and schedule, as
  long as they give the freeze state the checkpoint recorded (vlm_freeze) at its step:
  only stages still to come may change;
- operational: logged (info) and used: names, directories, intervals, logging, hooks,
  threads and workers, the loss's chunk size, eval, checkpoint and profiling settings;
- refused: anything else, because it changes what the saved state means: the model, the
  sequence length and batch, the seed, precision, the loss and z-loss, document masking,
  the tokenizer, the phase schedule, the optimizer and its parameter groups. The resume
  stops with a ConfigError naming the field and both values, unless
  checkpoint.allow_config_change is set (then each is logged). A different optimizer.name
  is refused unless checkpoint.reset_optimizer is set, which starts its state afresh.

A field added to the config later and not listed here is refused by default.

The batch is the one refused setting a new layout may re-split: a resume on another
world size or mesh may change train.batch_size and train.grad_accum_steps as long as the
global batch (batch_size * grad_accum_steps * data-parallel degree) stays the same; the
run then sees the same samples in every step (see ShardedSampler).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kempnerforge.config.distributed import DistributedConfig
from kempnerforge.config.job import JobConfig
from kempnerforge.config.loader import config_to_dict
from kempnerforge.core.errors import ConfigError
from kempnerforge.core.logging import get_logger

logger = get_logger(__name__)

APPLIED = (
    "optimizer.lr",
    "optimizer.weight_decay",
    "optimizer.betas",
    "optimizer.eps",
    "optimizer.implementation",
    "optimizer.muon_momentum",
    "optimizer.muon_ns_steps",
    "optimizer.muon_adam_lr",
    "optimizer.schedule_free_warmup_steps",
    "model.moe_aux_loss_weight",
    "model.moe_router_z_loss_weight",
    "model.moe_bias_update_rate",
    "model.moe_bias_schedule",
    "train.grad_clip_norm",
    "train.max_steps",
    "train.global_batch_size",
    "train.nan_consecutive_max",
    "train.nan_max_rollbacks",
    "train.nan_rollback_lr_scale",
    "train.spike_window",
    "train.spike_sigmas",
    "train.spike_min_history",
    "train.attribute_faults",
    "train.max_hardware_faults",
    # FP8 matmuls read and write the same fp32 weights and optimizer state: turning them
    # on or off changes the arithmetic of the steps to come, not what the state means.
    "train.float8",
    "scheduler.",
    "data.path",
    "data.eval_path",
    "data.datasets",
    "data.mix_temperature",
    "data.shuffle",
    "data.builtin_eval_fraction",
    "vlm.freeze",
    "vlm.freeze_schedule",
    "vlm.data",
    "vlm.synthetic_samples",
)
"""Fields (or section prefixes ending in '.') whose new value takes effect on resume."""

OPERATIONAL = (
    "train.name",
    "train.run_dir",
    "train.use_existing_dir",
    "train.hooks",
    "train.sample_prompt",
    "train.sample_tokens",
    "train.num_threads",
    "train.allocator",
    "train.device",
    "train.compile",
    "train.attention_kernel",
    "train.deterministic",
    "train.loss_chunk_tokens",
    "train.hang_timeout_s",
    "data.num_workers",
    "data.cache_dir",
    "vlm.eval_data",
    "vlm.bad_images",
    "eval.",
    "checkpoint.",
    "metrics.",
    "profiling.",
    "distributed.",
    "fault_tolerance.enabled",
    "fault_tolerance.lighthouse",
    "fault_tolerance.replica_group",
    "fault_tolerance.min_replica_groups",
    "fault_tolerance.quorum_timeout_s",
    "fault_tolerance.timeout_s",
)
"""Fields that change how the run is operated, not what it computes; logged at info."""

BATCH_SPLIT = ("train.batch_size", "train.grad_accum_steps", "fault_tolerance.num_replica_groups")
"""How the global batch is split over micro-batches, data-parallel ranks and replica groups."""


def global_batch(tree: dict[str, Any], world_size: int) -> int | None:
    """Sequences per optimizer step of a resolved config dict at ``world_size``; None when
    the dict lacks what that takes (a checkpoint from before these fields)."""
    try:
        train, layout = tree["train"], tree.get("distributed", {})
        known = {k: v for k, v in layout.items() if k in DistributedConfig.__dataclass_fields__}
        dp = DistributedConfig(**known).resolved_dp(world_size)
        ft = tree.get("fault_tolerance", {})
        groups = int(ft.get("num_replica_groups", 1)) if ft.get("enabled") else 1
        return int(train["batch_size"]) * int(train["grad_accum_steps"]) * dp * groups
    except (KeyError, TypeError, ValueError, ConfigError):
        return None


@dataclass(frozen=True)
class Change:
    field: str
    saved: Any
    current: Any

    def describe(self) -> str:
        return f"{self.field} changed from {self.saved!r} to {self.current!r}"


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys of the nested sections; lists (betas, phases, datasets) stay whole."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and not prefix:
            flat.update(_flatten(value, f"{dotted}."))
        else:
            flat[dotted] = value
    return flat


def config_changes(saved: dict[str, Any], config: JobConfig) -> list[Change]:
    """The fields whose value in ``config`` differs from the ``saved`` config dict."""
    return _dict_changes(saved, config_to_dict(config))


def _dict_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[Change]:
    """The fields whose value in the ``current`` config dict differs from ``saved``."""
    old, new = _flatten(saved), _flatten(current)
    return [
        Change(field, old.get(field), new.get(field))
        for field in sorted(old.keys() | new.keys())
        if old.get(field) != new.get(field)
    ]


def _matches(field: str, patterns: tuple[str, ...]) -> bool:
    return any(field.startswith(p) if p.endswith(".") else field == p for p in patterns)


def kind_of(field: str) -> str:
    """'applied', 'operational' or 'refused' for a dotted config field."""
    if _matches(field, APPLIED):
        return "applied"
    if _matches(field, OPERATIONAL):
        return "operational"
    return "refused"


def check_config_changes(
    config: JobConfig,
    saved: dict[str, Any] | None,
    path: str,
    *,
    saved_world_size: int = 1,
    world_size: int = 1,
) -> bool:
    """Refuse, apply or log each config change against checkpoint `path`.

    Returns True when the optimizer state must start afresh (a changed optimizer.name
    with checkpoint.reset_optimizer, or reset_optimizer alone). Raises ConfigError naming
    the first refused field. ``saved`` None (a checkpoint without a config) checks nothing
    and says so.
    """
    cfg = config.checkpoint
    if saved is None:
        logger.warning(
            "%s holds no config of the run that saved it: changed settings cannot be "
            "checked on this resume",
            path,
        )
        return cfg.reset_optimizer
    current = config_to_dict(config)
    changes = _without_batch_resplits(
        _dict_changes(saved, current), saved, current, path, saved_world_size, world_size
    )
    _check_optimizer_name(changes, path, reset_optimizer=cfg.reset_optimizer)
    _check_refused(changes, path, allow_config_change=cfg.allow_config_change)
    _log_changes(changes, path)
    return cfg.reset_optimizer


def _without_batch_resplits(
    changes: list[Change],
    saved: dict[str, Any],
    current: dict[str, Any],
    path: str,
    saved_world_size: int,
    world_size: int,
) -> list[Change]:
    """``changes`` less the batch-split fields, each logged, when the global batch of this
    run's config dict ``current`` is the one saved (a resume on a new layout); all of
    ``changes`` otherwise.

    The split alone does not change which samples a step sees, so only a changed global
    batch is left for the refusal rules to judge.
    """
    if not any(c.field in BATCH_SPLIT for c in changes):
        return changes
    before = global_batch(saved, saved_world_size)
    after = global_batch(current, world_size)
    if before is None or before != after:
        return changes
    for change in [c for c in changes if c.field in BATCH_SPLIT]:
        logger.info(
            "resuming %s with %s: the global batch stays %d sequences (%d ranks now, "
            "%d when saved)",
            path,
            change.describe(),
            after,
            world_size,
            saved_world_size,
        )
    return [c for c in changes if c.field not in BATCH_SPLIT]


def _check_optimizer_name(changes: list[Change], path: str, *, reset_optimizer: bool) -> None:
    """A ConfigError on a changed optimizer.name unless checkpoint.reset_optimizer is set:
    the saved optimizer state belongs to the old optimizer."""
    name_change = next((c for c in changes if c.field == "optimizer.name"), None)
    if name_change is not None and not reset_optimizer:
        raise ConfigError(
            "optimizer.name",
            name_change.current,
            f"{name_change.saved!r} as in the checkpoint {path}",
            f"its saved state belongs to {name_change.saved}; set "
            "checkpoint.reset_optimizer=true to resume the weights, step and data with a "
            f"fresh {name_change.current} state, or start a new run",
        )


def _check_refused(changes: list[Change], path: str, *, allow_config_change: bool) -> None:
    """A ConfigError naming the first refused change (and listing the others) unless
    checkpoint.allow_config_change is set; optimizer.name has its own rule."""
    refused = [c for c in changes if kind_of(c.field) == "refused" and c.field != "optimizer.name"]
    if refused and not allow_config_change:
        first = refused[0]
        more = f"; also changed: {', '.join(c.field for c in refused[1:])}" if refused[1:] else ""
        raise ConfigError(
            first.field,
            first.current,
            f"{first.saved!r} as in the checkpoint {path}",
            "this change alters what the saved state means; set "
            "checkpoint.allow_config_change=true to resume anyway, or use another "
            f"train.name to start a new run{more}",
        )


def _log_changes(changes: list[Change], path: str) -> None:
    """One line per change that passed the checks: info for operational fields, a warning
    for the rest, saying what the resume does with it."""
    for change in changes:
        kind = kind_of(change.field)
        if change.field == "optimizer.name":
            logger.warning(
                "resuming %s with %s: the optimizer state starts afresh", path, change.describe()
            )
        elif kind == "operational":
            logger.info("resuming %s with %s", path, change.describe())
        elif kind == "applied":
            logger.warning(
                "resuming %s with %s: the new value takes effect from this step",
                path,
                change.describe(),
            )
        else:
            logger.warning(
                "resuming %s with %s (checkpoint.allow_config_change = true)",
                path,
                change.describe(),
            )
