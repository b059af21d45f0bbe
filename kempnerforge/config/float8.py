"""The rules of train.float8 that the config alone decides (a text model, no tensor
parallelism, every dim an FP8 matmul sees a multiple of 16), checked by JobConfig.validate;
the device and torchao are checked before the build (training/float8.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kempnerforge.core.errors import ConfigError

if TYPE_CHECKING:
    from kempnerforge.config.job import JobConfig

FP8_MULTIPLE = 16
"""FP8 matmuls (torch._scaled_mm) need every dim of both operands to be a multiple of 16."""


def check_float8_config(config: JobConfig) -> None:
    """The rules of train.float8 that the config alone decides: a text model, no tensor
    parallelism, and every dim an FP8 matmul sees a multiple of 16 (the field named)."""
    if not config.train.float8:
        return
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
