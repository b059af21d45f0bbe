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

from kempnerforge.config.job import JobConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.core.logging import get_logger
from kempnerforge.distributed.runtime import resolve_device

logger = get_logger(__name__)

MIN_CAPABILITY = (8, 9)
"""CUDA compute capability from which GPUs have FP8 tensor cores (Ada, Hopper, Blackwell)."""

FP8_MULTIPLE = 16
"""FP8 matmuls (torch._scaled_mm) need every dim of both operands to be a multiple of 16."""

INSTALL_HINT = "install the float8 extra: pip install 'kempnerforge[float8]' (torchao)"


def check_float8(config: JobConfig) -> None:
    """Refuse train.float8 where it cannot run, before anything is built: a ConfigError
    whose one line names the field and says why. Does nothing when FP8 is off.

    The rules of the config alone come first, then the device train.device resolves to
    on this rank, then whether torchao is installed.
    """
    if not config.train.float8:
        return
    check_float8_config(config)
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))
    check_float8_device(resolve_device(config.train.device, local_rank))
    check_torchao_installed()


def check_float8_config(config: JobConfig) -> None:
    """The rules of train.float8 that the config alone decides: a text model, no tensor
    parallelism, and every dim an FP8 matmul sees a multiple of 16 (the field named)."""
    if not config.train.float8:
        return
    if config.is_vlm:
        raise ConfigError(
            "train.float8",
            True,
            "false for a vision-language job ([vlm])",
            "FP8 linear layers cover the text models, dense and MoE",
        )
    if config.distributed.tp > 1:
        raise ConfigError(
            "train.float8",
            True,
            f"false with distributed.tp = {config.distributed.tp}",
            "tensor-parallel FP8 layers are not supported; shard with distributed.dp_shard",
        )
    for field, value, size, what in float8_dims(config):
        if size % FP8_MULTIPLE:
            raise ConfigError(
                field,
                value,
                f"a value that makes {what} ({size}) a multiple of {FP8_MULTIPLE} with "
                "train.float8 = true",
                "FP8 matmuls need every dim of both operands to be a multiple of 16; or set "
                "train.float8 = false",
            )


def float8_dims(config: JobConfig) -> list[tuple[str, object, int, str]]:
    """(field, its value, the dim it sets, what that dim is) for every dim of an FP8
    matmul: the inputs and outputs of the converted projections, and the tokens of a
    micro-batch row, whose multiples are the inner dim of the weight gradient."""
    m = config.model
    dims: list[tuple[str, object, int, str]] = [
        ("model.dim", m.dim, m.dim, "the model width"),
        ("model.n_kv_heads", m.n_kv_heads, m.kv_heads * m.head_dim, "n_kv_heads * head_dim"),
        ("train.seq_len", config.train.seq_len, config.train.seq_len, "the sequence length"),
    ]
    if any(not m.is_moe_layer(i) for i in range(m.n_layers)):
        dims.append(
            ("model.ffn_hidden_dim", m.ffn_hidden_dim, m.hidden_dim, "the feed-forward width")
        )
    if m.is_moe and m.moe_shared_experts:
        shared = m.moe_shared_experts * m.expert_hidden_dim
        dims.append(
            (
                "model.moe_expert_hidden_dim",
                m.moe_expert_hidden_dim,
                shared,
                "moe_shared_experts * the expert width",
            )
        )
    return dims


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
