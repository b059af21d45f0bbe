"""ModelConfig.num_params: the decoder's exact size, known before anything is built."""

from __future__ import annotations

import pytest

from kempnerforge.config.model import ModelConfig
from kempnerforge.model.transformer import build_model

TINY = {"dim": 32, "n_layers": 2, "n_heads": 2, "multiple_of": 16, "max_seq_len": 64}


@pytest.mark.parametrize(
    "shape",
    [
        {},
        {"tie_embeddings": True},
        {"dim": 64, "n_heads": 8, "n_kv_heads": 2},  # GQA
        {"dim": 64, "n_heads": 4, "n_kv_heads": 1, "tie_embeddings": True},
        {"n_layers": 3, "ffn_hidden_dim": 40, "vocab_size": 300},
        {"ffn_multiplier": 1.3, "multiple_of": 7},
    ],
    ids=["untied", "tied", "gqa", "mqa_tied", "explicit_hidden", "multiplier"],
)
def test_num_params_equals_the_built_model(shape):
    cfg = ModelConfig(**{**TINY, **shape})
    model = build_model(cfg)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())


def test_num_params_by_hand():
    # hidden = 16 * ceil(int(8 * 32 / 3) / 16) = 96; per block 4 * 32 * 32 (attention)
    # + 3 * 32 * 96 (SwiGLU) + 2 * 32 (norms) = 13376; embedding and head 259 * 32 each.
    assert ModelConfig(**TINY).num_params() == 2 * 259 * 32 + 2 * 13376 + 32
    assert ModelConfig(**TINY, tie_embeddings=True).num_params() == 259 * 32 + 2 * 13376 + 32


def test_num_params_of_a_large_config_needs_no_memory():
    cfg = ModelConfig(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_hidden_dim=14336,
        rope_theta=500000.0,
    )
    assert cfg.num_params() == 8_030_261_248  # Llama-3 8B


MOE = {"num_experts": 4, "moe_top_k": 2}


@pytest.mark.parametrize(
    "shape",
    [
        MOE,
        {**MOE, "moe_shared_experts": 2},
        {**MOE, "moe_frequency": 2},
        {**MOE, "tie_embeddings": True, "moe_expert_hidden_dim": 24},
        {**MOE, "n_layers": 3, "moe_frequency": 3, "moe_router": "sigmoid"},
    ],
    ids=["moe", "shared_experts", "every_second_block", "tied_fine_grained", "sigmoid"],
)
def test_num_params_of_an_moe_config_equals_the_built_model(shape):
    cfg = ModelConfig(**{**TINY, **shape})
    model = build_model(cfg)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())


def test_num_params_and_active_params_of_an_moe_config_by_hand():
    # Dense block as above: 4096 attention + 9216 SwiGLU + 64 norms. An MoE block swaps the
    # SwiGLU for a 32 x 4 router and four experts of 3 * 32 * 96 = 9216, one shared expert
    # too; a token passes the router, 2 routed experts and the shared one.
    cfg = ModelConfig(**TINY, num_experts=4, moe_top_k=2, moe_shared_experts=1, moe_frequency=2)
    outside = 2 * 259 * 32 + 32
    dense_block = 4096 + 9216 + 64
    assert cfg.num_params() == outside + dense_block + 4096 + 128 + 5 * 9216 + 64
    assert cfg.num_active_params() == outside + dense_block + 4096 + 128 + 3 * 9216 + 64
    assert ModelConfig(**TINY).num_active_params() == ModelConfig(**TINY).num_params()
