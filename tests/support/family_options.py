"""Each published family's decoder options on the tiny debug model: the overrides that make
configs/train/debug.toml (or debug_moe.toml, for an MoE family) compute that family's
block. The layout tests (tests/e2e/test_check_parallel_families.py) and the training-path
tests (tests/unit/test_family_paths.py) train the same options."""

from __future__ import annotations

import pathlib
from typing import NamedTuple

REPO = pathlib.Path(__file__).parents[2]
DEBUG = str(REPO / "configs" / "train" / "debug.toml")
DEBUG_MOE = str(REPO / "configs" / "train" / "debug_moe.toml")


class FamilyOptions(NamedTuple):
    args: list[str]
    config: str = DEBUG
    """The debug run it shrinks: an MoE family starts from the MoE one."""

    @property
    def is_moe(self) -> bool:
        return self.config == DEBUG_MOE


FAMILY_OPTIONS = {
    # Per-head query and key norms, 4 heads of 32 (twice dim 64), the head tied to the
    # embedding as in Qwen3 0.6B and 1.7B (on two pipeline stages: two copies summing their
    # gradients, distributed/tied_head.py).
    "qwen3": FamilyOptions(
        [
            *("--model.qk_norm=per_head", "--model.head_size=32", "--model.n_kv_heads=2"),
            "--model.tie_embeddings=true",
        ]
    ),
    # A window of 8 of the 32 positions on every layer, over packed documents.
    "mistral": FamilyOptions(["--model.sliding_window=8", "--model.n_kv_heads=2"]),
    # Norms after each sublayer; query and key norms whose mean square spans the tp shards.
    "olmo2": FamilyOptions(
        ["--model.qk_norm=projection", "--model.norm_placement=post", "--model.n_kv_heads=2"]
    ),
    # Gemma 3's block: four zero-centred norms, per-head q/k norms, GeGLU, embeddings times
    # sqrt(256), a logit scale of 1/sqrt(48) for heads of 64, sliding layers (window 8)
    # alternating with global ones, each kind with its RoPE (the global one scaled 8x); the
    # head tied to the embedding, as in every Gemma 3.
    "gemma3": FamilyOptions(
        [
            "--model.tie_embeddings=true",
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
    # no shared expert, every layer MoE), each 32 wide.
    "qwen3_moe": FamilyOptions(
        [
            *("--model.qk_norm=per_head", "--model.head_size=32", "--model.n_kv_heads=2"),
            "--model.moe_expert_hidden_dim=32",
        ],
        config=DEBUG_MOE,
    ),
    # GPT-OSS over the debug MoE's 8 experts (top-2): biased projections and a sink per
    # head, a window of 8 on every other layer, YaRN RoPE, a biased router and biased
    # experts with a clamped SwiGLU whose clamp binds.
    "gpt_oss": FamilyOptions(
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
    ),
    # DeepSeek-V3 over the debug MoE's 8 experts: latent attention (query latent 48, key/value
    # latent 32, query/key heads of 32 + 16 RoPE channels, values of 32, padded for the CPU's
    # kernels), YaRN with both mscales, the first layer dense, then sigmoid routing in 4
    # groups of which 2 are kept, gates times 2.5, a shared expert.
    "deepseek_v3": FamilyOptions(
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
    ),
}
