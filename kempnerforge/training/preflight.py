"""Checks of a validated config that need the training layer, run before anything is written.

JobConfig.validate knows the config alone. These also need what the config names (the
optimizer and schedule registries, the hook classes) or the device (check_model_fits,
check_float8).
A launch that fails here has built nothing and written nothing, so the run directory's
config.toml still holds the last launch that started.
"""

from __future__ import annotations

import os

import torch

from kempnerforge.config.job import JobConfig
from kempnerforge.config.model import ModelConfig
from kempnerforge.config.train import TrainConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.core.logging import get_logger
from kempnerforge.optim.optimizer import OPTIMIZERS
from kempnerforge.optim.scheduler import SCHEDULES
from kempnerforge.training.float8 import check_float8
from kempnerforge.training.hooks import hook_class
from kempnerforge.training.layout import PIPELINE_STAGES, layout_of
from kempnerforge.training.objectives import Objective, objective_of
from kempnerforge.training.store_checks import check_stores

logger = get_logger(__name__)


def preflight(config: JobConfig) -> None:
    """Raise the ConfigError the build would raise later for a bad name or hook, for
    train.float8 where FP8 cannot run (the device, torchao, the dims), or for what this
    torch cannot run; and for a path in an object store that cannot be read or cannot be
    used there yet (store_checks)."""
    check_stores(config)
    OPTIMIZERS.get(config.optimizer.name)
    SCHEDULES.get(config.scheduler.name)
    _check_objective(objective_of(config), config.train)
    for path in config.train.hooks:
        hook_class(path)
    check_float8(config.train)
    check_sequence_split(config, torch.__version__)


def _check_objective(objective: Objective, train: TrainConfig) -> None:
    """Say once when the job's objective (objective_of refuses an unknown train.loss_fn)
    cannot use the chunked head that train.loss_chunk_tokens asks for."""
    chunk_tokens = train.loss_chunk_tokens
    if objective.per_token_grad and chunk_tokens > 0:
        logger.warning(
            "train.loss_chunk_tokens = %d is not used: train.loss_fn = %r weighs per-token "
            "losses, whose gradients need each micro-batch's whole logits",
            chunk_tokens,
            objective.name,
        )


UNEVEN_SEQUENCE_TORCH = (2, 13)
"""The first torch tested to gather a sequence that tp does not divide into a tensor its
linear layers can read: torch 2.11 keeps the padded shard's strides ("view size is not
compatible"); 2.12 is untested."""


def torch_release(torch_version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: '2.11.0+cu130' -> (2, 11); a nightly of a
    release counts as that release."""
    major, minor = torch_version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_sequence_split(config: JobConfig, torch_version: str) -> None:
    """Refuse a train.seq_len that distributed.tp does not divide under sequence
    parallelism (tensor parallelism without pipeline stages) on a torch older than
    UNEVEN_SEQUENCE_TORCH, whose first step would fail inside the attention projections."""
    tp, seq_len = config.distributed.tp, config.train.seq_len
    if tp == 1 or layout_of(config.distributed) is PIPELINE_STAGES or seq_len % tp == 0:
        return
    if torch_release(torch_version) >= UNEVEN_SEQUENCE_TORCH:
        return
    needed = ".".join(map(str, UNEVEN_SEQUENCE_TORCH))
    raise ConfigError(
        "train.seq_len",
        seq_len,
        f"a multiple of distributed.tp = {tp} on torch {torch_version}",
        f"sequence parallelism splits each sequence over the tp ranks, and torch before "
        f"{needed} cannot gather one they do not divide; or use torch {needed} or newer",
    )


# fp32 weights and gradients plus two fp32 moments per parameter (AdamW; Lion and Muon
# keep less): what one process holds for the model before any activation.
TRAINING_BYTES_PER_PARAM = 16


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of `device` (RAM for the CPU), or None where it cannot be read."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def check_model_fits(config: ModelConfig, device: torch.device, shards: int = 1) -> None:
    """Refuse a model whose weights, gradients and optimizer state alone exceed the device.

    Run before the model is built: an absurd size (model.dim = 2**30) is then a one-line
    ConfigError instead of an allocation failure, or a machine swapping itself to a halt.
    ``shards`` is how many ranks split the model (dp_shard * cp * tp * pp); each GPU holds one
    share, while CPU ranks on one host share its memory, so there it does not divide.
    """
    available = device_memory_bytes(device)
    if available is None:
        return
    num_params = config.num_params()
    needed = num_params * TRAINING_BYTES_PER_PARAM
    if device.type == "cuda":
        needed //= shards
    if needed > available:
        # The fields that set the size and are in use (num_experts: an MoE model's).
        sizes = [n for n in ("dim", "n_layers", "vocab_size", "num_experts") if getattr(config, n)]
        knobs = [f"model.{n}" for n in sizes]
        raise ConfigError(
            "model.dim",
            config.dim,
            f"a model whose {TRAINING_BYTES_PER_PARAM} bytes per parameter (fp32 weights, "
            f"gradients, optimizer moments) fit this {device.type} device's "
            f"{available / 2**30:.1f} GiB",
            f"this config builds {num_params:.3g} parameters, {needed / 2**30:.1f} GiB; "
            f"lower {', '.join(knobs[:-1])} or {knobs[-1]}",
        )
