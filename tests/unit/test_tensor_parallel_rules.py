"""The layout rules of tensor parallelism (config/layout_rules.py): what distributed.tp must
divide (attention heads, a latent attention's heads, the dense and the experts' hidden
sizes) and the one MoE combination it refuses, expert parallelism beside it."""

from __future__ import annotations

import pytest

from kempnerforge.config.loader import load_config
from kempnerforge.core.errors import ConfigError

TP2 = ["--distributed.tp=2"]
MOE = ["--model.num_experts=4", "--model.moe_top_k=2", "--model.moe_expert_hidden_dim=16"]
LATENT = [
    *("--model.dim=64", "--model.n_heads=4", "--model.mla_kv_rank=16"),
    *("--model.mla_nope_head_size=8", "--model.mla_rope_head_size=8"),
    "--model.mla_value_head_size=8",
]
"""DeepSeek-V3's latent attention at a tiny size: 4 heads, no query latent."""


@pytest.mark.parametrize(
    ("overrides", "world_size"),
    [
        pytest.param(MOE, 2, id="moe"),
        pytest.param([*MOE, "--model.moe_shared_experts=1"], 2, id="moe_shared"),
        pytest.param([*MOE, "--model.moe_first_dense_layers=1"], 2, id="moe_dense_first"),
        pytest.param(LATENT, 2, id="latent"),
        pytest.param([*LATENT, "--model.mla_q_rank=24", *MOE], 2, id="latent_moe"),
        pytest.param(
            [*MOE, "--distributed.pp=2", "--train.grad_accum_steps=2"], 4, id="moe_pipeline"
        ),
        pytest.param([*MOE, "--distributed.dp_shard=2"], 4, id="moe_fsdp"),
    ],
)
def test_tensor_parallelism_accepts_moe_and_latent_attention(
    overrides: list[str], world_size: int
) -> None:
    load_config(None, [*overrides, *TP2]).validate(world_size)


def test_a_model_of_moe_layers_only_needs_no_dense_size_tp_divides() -> None:
    # A dense feed-forward of 88 (no layer has one) beside experts of 16.
    load_config(None, [*MOE, "--model.ffn_hidden_dim=87", *TP2]).validate(2)


@pytest.mark.parametrize(
    ("overrides", "world_size", "field", "message"),
    [
        (
            [*MOE, "--model.moe_expert_hidden_dim=15"],
            2,
            "distributed.tp",
            "distributed.tp = 2: expected a divisor of the experts' hidden size 15",
        ),
        (
            [*MOE, "--model.ffn_hidden_dim=87", "--model.moe_first_dense_layers=1"],
            2,
            "distributed.tp",
            "distributed.tp = 2: expected a divisor of the feed-forward size 87",
        ),
        (
            [*MOE, "--distributed.ep=2", "--distributed.dp_shard=2"],
            4,
            "distributed.ep",
            "distributed.ep = 2: expected 1 with distributed.tp > 1",
        ),
        (
            [*LATENT, "--model.n_heads=3", "--model.dim=48"],
            2,
            "distributed.tp",
            "distributed.tp = 2: expected a divisor of model.n_heads = 3",
        ),
    ],
    ids=["expert_hidden", "dense_hidden", "tp_with_ep", "latent_heads"],
)
def test_tensor_parallelism_refuses_what_it_cannot_split(
    overrides: list[str], world_size: int, field: str, message: str
) -> None:
    config = load_config(None, [*overrides, *TP2])
    with pytest.raises(ConfigError) as info:
        config.validate(world_size)
    assert info.value.field == field
    assert str(info.value).startswith(message)
