"""FP8 linear layers (train.float8): the rules that refuse a job FP8 cannot run, and the
swap of the Transformer blocks' nn.Linear modules for torchao's Float8Linear.

What FP8 covers: every projection of a block that is an nn.Linear (attention wq, wk, wv,
wo; the dense SwiGLU's w1, w2, w3; an MoE block's shared experts). What it leaves as it
was: the embedding, the output head (the chunked head loss reads its weight directly),
the norms, the MoE router (it scores tokens in fp32 on purpose) and the routed experts,
whose stacked weights go through grouped matmuls, not nn.Linear.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from kempnerforge.config.train import TrainConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.core.logging import get_logger
from kempnerforge.distributed.runtime import resolve_device

logger = get_logger(__name__)

MIN_CAPABILITY = (8, 9)
"""CUDA compute capability from which GPUs have FP8 tensor cores (Ada, Hopper, Blackwell)."""

INSTALL_HINT = "install the float8 extra: pip install 'kempnerforge[float8]' (torchao)"


def check_float8(train: TrainConfig) -> None:
    """Refuse train.float8 where it cannot run, before anything is built: a ConfigError
    whose one line names the field and says why. Does nothing when FP8 is off.

    The device train.device resolves to on this rank, then whether torchao is installed;
    the rules of the config alone (config/float8.py) ran in JobConfig.validate before.
    """
    if not train.float8:
        return
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))
    check_float8_device(resolve_device(train.device, local_rank))
    check_torchao_installed()


def check_float8_device(device: torch.device) -> None:
    """Refuse a device without FP8 tensor cores: the CPU, or a GPU older than 8.9."""
    if device.type != "cuda":
        raise ConfigError(
            "train.float8",
            True,
            f"false on a {device.type} device",
            "FP8 matmuls need a CUDA GPU of compute capability 8.9 or newer (L4, L40, "
            "H100, H200, B200); set train.float8 = false here",
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            "train.float8",
            True,
            f"false on {name} (compute capability {capability[0]}.{capability[1]})",
            "FP8 matmuls need compute capability 8.9 or newer (L4, L40, H100, H200, B200)",
        )


def check_torchao_installed() -> None:
    """Refuse FP8 without torchao, naming the extra that brings it."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as error:
        raise ConfigError(
            "train.float8", True, "false when torchao is not installed", INSTALL_HINT
        ) from error


def is_float8_projection(module: nn.Module, fqn: str) -> bool:
    """Whether the nn.Linear at ``fqn`` runs in FP8: a block's projection, not its router."""
    del module
    parts = fqn.split(".")
    return "layers" in parts and "router" not in parts


def apply_float8(model: nn.Module, device: torch.device, compiled: bool) -> int:
    """Swap the blocks' projections for Float8Linear, in place; the number swapped.

    Call on the model as built (the meta device is fine) and before activation
    checkpointing, compile and FSDP wrap it, as those must see the FP8 modules. Parameter
    names and values do not change (a Float8Linear holds the same fp32 weight), so
    checkpoints read the same with FP8 on or off. Refuses a device without FP8 (the CLI
    refused it earlier; this guards other callers of the build).
    """
    check_float8_device(device)
    check_torchao_installed()
    count = convert_projections(model)
    logger.info(
        "train.float8: %d block projections run as FP8 matmuls (tensorwise dynamic scaling); "
        "the embedding, head, norms, router and routed experts compute as before",
        count,
    )
    if not compiled:
        logger.warning(
            "train.float8 without train.compile: the FP8 casts run as separate kernels and "
            "usually cost more than FP8 matmuls save; set train.compile = true"
        )
    return count


def convert_projections(model: nn.Module) -> int:
    """The swap itself, on any device: Float8Linear for each block projection."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(
        model, module_filter_fn=is_float8_projection, config=Float8LinearConfig()
    )
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())
