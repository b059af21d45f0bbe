"""End to end: `kempnerforge check-parallel` trains each published family's decoder options
(the tiny debug model with them set) under FSDP, tensor, pipeline and context parallelism,
and an MoE family also under expert parallelism, one invocation per family, and compares
them with one process."""

from __future__ import annotations

from typing import NamedTuple

import pytest

from tests.e2e.test_check_parallel import (
    DEBUG,
    DEBUG_MOE,
    assert_every_layout_passes,
    check_parallel,
)

pytestmark = pytest.mark.slow

WORLDS = {"dp_shard=2": "2", "tp=2": "2", "pp=2": "2", "cp=2": "2"}
MOE_WORLDS = {"dp_shard=2": "2", "tp=2": "2", "pp=2": "2", "cp=2": "2", "dp_shard=2,ep=2": "2"}
"""An MoE model's layouts: tp splits each expert's hidden features (and the attention's
heads, latent attention's included), ep the experts over data-parallel ranks."""


class Family(NamedTuple):
    args: list[str]
    config: str = DEBUG
    """The debug run it shrinks: an MoE family starts from the MoE one."""
    worlds: dict[str, str] = WORLDS


FAMILIES = {
    # Per-head query and key norms, 4 heads of 32 (twice dim 64). Untied, as Qwen3 4B and
    # up are: pipeline stages refuse a tied head (the embedding and the head live on
    # different stages), so the small sizes' tied head trains on the other layouts only.
    "qwen3": Family(["--model.qk_norm=per_head", "--model.head_size=32", "--model.n_kv_heads=2"]),
    # A window of 8 of the 32 positions on every layer, over packed documents.
    "mistral": Family(["--model.sliding_window=8", "--model.n_kv_heads=2"]),
    # Norms after each sublayer; query and key norms whose mean square spans the tp shards.
    "olmo2": Family(
        ["--model.qk_norm=projection", "--model.norm_placement=post", "--model.n_kv_heads=2"]
    ),
    # Gemma 3's block: four zero-centred norms, per-head q/k norms, GeGLU, embeddings times
    # sqrt(256), a logit scale of 1/sqrt(48) for heads of 64, sliding layers (window 8)
    # alternating with global ones, each kind with its RoPE (the global one scaled 8x).
    # Untied, as under Qwen3 (pipeline stages refuse a tied head).
    "gemma3": Family(
        [
            *("--model.norm_placement=sandwich", "--model.zero_centered_norms=true"),
            *("--model.qk_norm=per_head", "--model.ffn_activation=gelu_tanh"),
            *("--model.embedding_multiplier=16.0", "--model.attention_scale_size=48"),
            *("--model.sliding_window=8", "--model.sliding_window_pattern=2"),
            *("--model.rope_theta=1000000", "--model.rope_local_theta=10000"),
            *("--model.rope_scaling=linear", "--model.rope_scaling_factor=8"),
            "--model.n_kv_heads=2",
        ]
    ),
    # Qwen3's attention over the debug MoE's 8 softmax-routed experts (top-2, renormalised,
    # no shared expert, every layer MoE), each 32 wide; its experts split under ep.
    "qwen3_moe": Family(
        [
            *("--model.qk_norm=per_head", "--model.head_size=32", "--model.n_kv_heads=2"),
            "--model.moe_expert_hidden_dim=32",
        ],
        config=DEBUG_MOE,
        worlds=MOE_WORLDS,
    ),
    # GPT-OSS over the debug MoE's 8 experts (top-2): biased projections and a sink per
    # head, a window of 8 on every other layer, YaRN RoPE, a biased router and biased
    # experts with a clamped SwiGLU whose clamp binds; its experts split under ep.
    "gpt_oss": Family(
        [
            *("--model.attention_sinks=true", "--model.attention_bias=true"),
            *("--model.head_size=32", "--model.n_kv_heads=2"),
            *("--model.sliding_window=8", "--model.sliding_window_pattern=2"),
            *("--model.rope_scaling=yarn", "--model.rope_scaling_factor=4"),
            "--model.rope_original_max_seq_len=16",
            *("--model.moe_router_bias=true", "--model.moe_expert_bias=true"),
            *("--model.moe_activation=clamped_swiglu", "--model.moe_swiglu_limit=0.5"),
            "--model.moe_expert_hidden_dim=32",
        ],
        config=DEBUG_MOE,
        worlds=MOE_WORLDS,
    ),
    # DeepSeek-V3 over the debug MoE's 8 experts: latent attention (query latent 48, key/value
    # latent 32, query/key heads of 32 + 16 RoPE channels, values of 32, padded for the CPU's
    # kernels), YaRN with both mscales, the first layer dense, then sigmoid routing in 4
    # groups of which 2 are kept, gates times 2.5, a shared expert; experts split under ep.
    "deepseek_v3": Family(
        [
            *("--model.mla_kv_rank=32", "--model.mla_q_rank=48"),
            *("--model.mla_nope_head_size=32", "--model.mla_rope_head_size=16"),
            "--model.mla_value_head_size=32",
            *("--model.rope_scaling=yarn", "--model.rope_scaling_factor=4"),
            "--model.rope_original_max_seq_len=16",
            *("--model.rope_yarn_mscale=0.8", "--model.rope_yarn_mscale_all_dim=0.6"),
            *("--model.moe_router=sigmoid", "--model.moe_num_groups=4"),
            *("--model.moe_top_groups=2", "--model.moe_routed_scaling=2.5"),
            *("--model.moe_shared_experts=1", "--model.moe_first_dense_layers=1"),
            "--model.moe_expert_hidden_dim=32",
        ],
        config=DEBUG_MOE,
        worlds=MOE_WORLDS,
    ),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_layouts_match_one_process(family, tmp_path, builtin_cache):
    args, config, worlds = FAMILIES[family]
    proc = check_parallel(
        "--layouts",
        *worlds,
        "--steps",
        "3",
        *args,
        cwd=tmp_path,
        cache=builtin_cache,
        config=config,
    )
    assert_every_layout_passes(proc, worlds)
