"""The configs the layout sweep runs: dense, Mixture-of-Experts and vision-language (the
joint decoder, and cross-attention with accumulation), each
without gradient accumulation (document masking on, as the debug configs have it) and with
12 micro-batches (a multiple of every pp up to 4 and enough for DualPipeV at pp = 4;
document masking off, so these cover the unmasked path); sliding windows in every
other layer over packed documents with 12 micro-batches (document masking on: pipeline
stages carry the document ids); the dense config with query and key norms per head
(Qwen3); attention sinks with biased projections and YaRN over those windows
(GPT-OSS); and Gemma 3's block over them (sandwich norms, GeGLU, a RoPE per kind of
layer). Sizes are tiny so a run takes seconds: 8 layers (a stage each at pp = 4 with
2 stages per rank), a batch of 12 (divided by every data-parallel degree up to 4) and a
sequence that cp up to 4 divides, also into the 2 x ring chunks of every ring."""

from __future__ import annotations

import pathlib

REPO = pathlib.Path(__file__).parents[2]
MAX_WORLD = 4
"""Largest world size swept."""
STEPS = 3
"""Optimizer steps each layout trains and compares."""

_TINY = ["--model.dim=64", "--model.n_layers=8", "--model.n_heads=4", "--train.batch_size=12"]
_NO_ACCUM = ["--train.grad_accum_steps=1"]
_ACCUM = ["--train.grad_accum_steps=12", "--data.document_masking=false"]
_DENSE = [*_TINY, "--train.seq_len=48"]
_MOE = [*_DENSE, "--model.moe_expert_hidden_dim=32"]
# Query and key norms per head of 32 channels, 4 x 32 wider than dim 64 (Qwen3).
_QK_HEAD = ["--model.qk_norm=per_head", "--model.head_size=32"]
# Windows of 16 of the 48 positions in every other layer (Gemma 2, GPT-OSS).
_WINDOWS = ["--model.sliding_window=16", "--model.sliding_window_pattern=2"]
# GPT-OSS's attention: a sink per head and biases on every projection, with YaRN RoPE; over
# the windows above, dense so that tp (which splits the sinks with the heads) is swept too.
_SINKS = [
    *("--model.attention_sinks=true", "--model.attention_bias=true"),
    *("--model.rope_scaling=yarn", "--model.rope_scaling_factor=4"),
    "--model.rope_original_max_seq_len=16",
]
# Gemma 3's block over the windows above: four zero-centred norms, GeGLU, embeddings times
# sqrt(64), a logit scale apart from the head size, the sliding layers' own RoPE base
# beside the global layers' linearly scaled one (two RoPE tables).
_GEMMA = [
    *("--model.norm_placement=sandwich", "--model.zero_centered_norms=true"),
    *("--model.qk_norm=per_head", "--model.ffn_activation=gelu_tanh"),
    *("--model.embedding_multiplier=8.0", "--model.attention_scale_size=24"),
    *("--model.rope_local_theta=10000", "--model.rope_scaling=linear"),
    "--model.rope_scaling_factor=8",
]
# DeepSeek-V3's latent attention (values narrower than the query/key heads) with YaRN and
# its mscales over its grouped sigmoid routing after a dense first layer; tp splits its
# heads and each expert's hidden features (tp with ep is refused).
_MLA = [
    *("--model.mla_kv_rank=32", "--model.mla_q_rank=24"),
    *("--model.mla_nope_head_size=16", "--model.mla_rope_head_size=8"),
    "--model.mla_value_head_size=16",
    *("--model.rope_scaling=yarn", "--model.rope_scaling_factor=4"),
    "--model.rope_original_max_seq_len=16",
    *("--model.rope_yarn_mscale=0.8", "--model.rope_yarn_mscale_all_dim=0.6"),
    *("--model.moe_router=sigmoid", "--model.moe_num_groups=4", "--model.moe_top_groups=2"),
    *("--model.moe_routed_scaling=2.5", "--model.moe_shared_experts=1"),
    "--model.moe_first_dense_layers=1",
]
# The joint decoder's sequence is the image's 16 tokens and 32 of text: 48; cross-attention
# splits the 32 text tokens. cp up to 4 divides both.
_VLM = [*_TINY, "--vlm.max_text_len=32"]

VARIANTS: dict[str, tuple[str, list[str]]] = {
    # Full attention heads without accumulation; grouped key/value heads (2 for 4 query
    # heads, which cp = 4 repeats) with it.
    "dense": ("configs/train/debug.toml", [*_DENSE, "--model.n_kv_heads=4", *_NO_ACCUM]),
    "dense-accum": ("configs/train/debug.toml", [*_DENSE, "--model.n_kv_heads=2", *_ACCUM]),
    "window-accum": (
        "configs/train/debug.toml",
        [*_DENSE, "--model.n_kv_heads=2", *_WINDOWS, "--train.grad_accum_steps=12"],
    ),
    "qk-norm-head": (
        "configs/train/debug.toml",
        [*_DENSE, "--model.n_kv_heads=4", *_QK_HEAD, *_NO_ACCUM],
    ),
    "sinks-window": (
        "configs/train/debug.toml",
        [*_DENSE, "--model.n_kv_heads=2", *_WINDOWS, *_SINKS, *_NO_ACCUM],
    ),
    "gemma3-window": (
        "configs/train/debug.toml",
        [*_DENSE, "--model.n_kv_heads=2", *_WINDOWS, *_GEMMA, *_NO_ACCUM],
    ),
    "moe": ("configs/train/debug_moe.toml", [*_MOE, "--model.n_kv_heads=4", *_NO_ACCUM]),
    "moe-accum": ("configs/train/debug_moe.toml", [*_MOE, "--model.n_kv_heads=4", *_ACCUM]),
    "mla-moe": ("configs/train/debug_moe.toml", [*_MOE, "--model.n_kv_heads=4", *_MLA, *_NO_ACCUM]),
    # The joint decoder without accumulation; cross-attention blocks with it.
    "vlm": ("configs/train/vlm_debug.toml", [*_VLM, "--model.n_kv_heads=4", *_NO_ACCUM]),
    "vlm-cross-accum": (
        "configs/train/vlm_debug.toml",
        [*_VLM, "--vlm.arch=cross_attention", "--model.n_kv_heads=2", *_ACCUM],
    ),
}


def sweep_argv(variant: str, *extra: str) -> list[str]:
    """`kempnerforge check-parallel` arguments that sweep ``variant``'s layouts."""
    config, overrides = VARIANTS[variant]
    return [
        str(REPO / config),
        "--layouts",
        "all",
        "--nproc",
        str(MAX_WORLD),
        "--steps",
        str(STEPS),
        *overrides,
        *extra,
    ]
