"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): multi-head latent attention (model.mla_*)
with YaRN RoPE and DeepSeek's mscales (model.rope_yarn_mscale, _all_dim), over
GLM-4-MoE's routing: a sigmoid router with a balancing bias (e_score_correction_bias),
group-limited top k (n_group, topk_group), gates renormalised when k > 1 and times
routed_scaling_factor, ungated shared experts, and the first first_k_dense_replace
layers dense.

Attention's tensors map one to one (q_proj or q_a_proj / q_a_layernorm / q_b_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj: our wq or wq_a / q_norm / wq_b,
wkv_a, kv_norm, wkv_b, wo) but for RoPE's channel order: with ``rope_interleave`` (its
default and the published checkpoints') DeepSeek rotates neighbouring channels (2i,
2i + 1) of each RoPE part together and lays the rotated result out in halves, while
ours rotates channel i with i + rope / 2. So the rows of the RoPE part of every query
head (in q_proj / q_b_proj) and of the shared key part (in kv_a_proj_with_mqa) are
permuted on import, evens then odds, and back on export: the rotated queries and keys
are then equal channel for channel. Export writes rope_interleave true.

The class computes its attention with num_key_value_heads = num_attention_heads only
(its keys are decompressed per head), without biases (attention_bias false). Its
multi-token-prediction layers (num_nextn_predict_layers, after the decoder's) are not
computed by DeepseekV3ForCausalLM and are not imported; export writes none. A folder
whose every layer is dense (first_k_dense_replace >= num_hidden_layers) is refused.
"""

from __future__ import annotations

from typing import Any

import torch

from kempnerforge.config.model import ModelConfig
from kempnerforge.interop.architectures.architecture import (
    Architecture,
    Requirement,
    Shapes,
    State,
)
from kempnerforge.interop.architectures.config_keys import HFConfig, common_model_fields
from kempnerforge.interop.architectures.glm4_moe import (
    glm4_moe_tensors_from_hf,
    glm4_moe_tensors_to_hf,
)
from kempnerforge.interop.architectures.moe_parts import (
    DEEPSEEK_ROUTER_FIELDS,
    aux_loss_fields,
    dense_first_fields,
    dense_first_requirement,
    group_routing_fields,
    group_routing_keys,
    moe_requirement,
    renormalised_top_k,
    router_requirement,
)
from kempnerforge.interop.architectures.mtp_layers import mtp_depth_field
from kempnerforge.interop.architectures.tensor_names import (
    HFTensors,
    dense_ffn_pairs,
    outer_pairs,
)

HF_CLASS = "DeepseekV3ForCausalLM"

REQUIREMENTS = (
    Requirement(
        "mla_kv_rank",
        lambda cfg: cfg.is_mla,
        f"> 0 for {HF_CLASS}",
        "DeepSeek-V3's attention is multi-head latent attention; a model with standard "
        "attention is written as another class",
    ),
    moe_requirement(HF_CLASS),
    router_requirement("sigmoid", HF_CLASS, "DeepSeek-V3's router scores with a sigmoid"),
    dense_first_requirement("DeepSeek-V3"),
    Requirement(
        "num_experts",
        lambda cfg: cfg.num_experts >= 2,
        f">= 2 for {HF_CLASS}",
        "DeepSeek-V3's router ranks experts by their two best scores per group",
    ),
)
"""What a DeepseekV3ForCausalLM export needs of our config, broadest first."""

OWN_FIELDS = (
    *("mla_kv_rank", "mla_q_rank", "mla_nope_head_size", "mla_rope_head_size"),
    "mla_value_head_size",
    *("rope_scaling", "rope_scaling_factor", "rope_original_max_seq_len"),
    *("rope_yarn_beta_fast", "rope_yarn_beta_slow", "rope_yarn_truncate"),
    *("rope_yarn_mscale", "rope_yarn_mscale_all_dim"),
    *DEEPSEEK_ROUTER_FIELDS,
    "mtp_depth",
)
"""The ModelConfig fields beyond the shared ones that DeepSeek-V3 represents."""


def deepseek_v3_config_keys(cfg: ModelConfig) -> dict[str, Any]:
    """config.json keys of the DeepseekV3ForCausalLM equal to our ``cfg`` (its head_dim is
    the RoPE part's width, as its config class sets it)."""
    return {
        "head_dim": cfg.mla_rope_head_size,
        "num_key_value_heads": cfg.n_heads,
        "intermediate_size": cfg.hidden_dim,
        "moe_intermediate_size": cfg.expert_hidden_dim,
        "n_routed_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.moe_top_k,
        "n_shared_experts": cfg.moe_shared_experts,
        "norm_topk_prob": cfg.moe_top_k > 1,
        **group_routing_keys(cfg),
        "kv_lora_rank": cfg.mla_kv_rank,
        "q_lora_rank": cfg.mla_q_rank or None,
        "qk_nope_head_dim": cfg.mla_nope_head_size,
        "qk_rope_head_dim": cfg.mla_rope_head_size,
        "v_head_dim": cfg.mla_value_head_size,
        "rope_interleave": True,
        "attention_bias": False,
        "num_nextn_predict_layers": cfg.mtp_depth,
        "router_aux_loss_coef": cfg.moe_aux_loss_weight,
        "output_router_logits": False,
    }


def deepseek_v3_config_fields(hf: HFConfig) -> dict[str, Any]:
    """ModelConfig fields of a DeepseekV3ForCausalLM config.json; refuses what we cannot
    build. Its head_dim key (the RoPE part's width) is read as qk_rope_head_dim."""
    without_head_dim = {k: v for k, v in hf.data.items() if k != "head_dim"}
    shared = HFConfig(without_head_dim, hf.path.parent)
    fields = common_model_fields(
        shared, llama_defaults=False, rope_scalings=("yarn",), yarn_mscales=True
    )
    heads = fields["n_heads"]
    hf.require(
        "num_key_value_heads",
        heads,
        heads,
        "DeepSeek-V3's latent attention decompresses a key and a value per query head",
    )
    fields["n_kv_heads"] = None
    hf.require("attention_bias", False, False, "kempnerforge's latent attention has no biases")
    fields.update(
        mla_kv_rank=hf.get_int("kv_lora_rank"),
        mla_q_rank=hf.get_int("q_lora_rank", 0),
        mla_nope_head_size=hf.get_int("qk_nope_head_dim"),
        mla_rope_head_size=hf.get_int("qk_rope_head_dim"),
        mla_value_head_size=hf.get_int("v_head_dim"),
    )
    fields["moe_top_k"] = renormalised_top_k(hf)
    fields.update(dense_first_fields(hf, fields["n_layers"]))
    fields["ffn_hidden_dim"] = hf.get_int("intermediate_size")
    fields["moe_expert_hidden_dim"] = hf.get_int("moe_intermediate_size")
    fields.update(num_experts=hf.get_int("n_routed_experts"), moe_router="sigmoid")
    fields["moe_shared_experts"] = hf.get_int("n_shared_experts")
    fields.update(group_routing_fields(hf))
    fields["mtp_depth"] = mtp_depth_field(hf)
    return {**fields, **aux_loss_fields(hf)}


def _interleaved_order(rope: int) -> torch.Tensor:
    """The order taking DeepSeek's RoPE channels to ours: its evens, then its odds."""
    return torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])


def _permute_head_rows(weight: torch.Tensor, head_width: int, rope: int, order: torch.Tensor):
    """``weight`` (heads * head_width, in) with the last ``rope`` rows of every head taken
    in ``order``."""
    heads = weight.view(-1, head_width, weight.shape[-1])
    nope = head_width - rope
    rotated = heads[:, nope:][:, order]
    return torch.cat([heads[:, :nope], rotated], dim=1).reshape(weight.shape).contiguous()


def _query_name(cfg: ModelConfig) -> tuple[str, str]:
    """(our name, its name) of the projection into every head's query."""
    return ("wq_b", "q_b_proj") if cfg.mla_q_rank else ("wq", "q_proj")


def deepseek_v3_pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(our name, its name) of every tensor copied as it is: the embedding, norms and head,
    the attention's projections and latent norms without RoPE rows, the dense layers'
    feed-forwards."""
    pairs = outer_pairs(cfg.tie_embeddings)
    plain = [("wkv_b", "kv_b_proj"), ("kv_norm", "kv_a_layernorm"), ("wo", "o_proj")]
    if cfg.mla_q_rank:
        plain += [("wq_a", "q_a_proj"), ("q_norm", "q_a_layernorm")]
    for index in range(cfg.n_layers):
        ours, hf = f"layers.{index}.", f"model.layers.{index}."
        pairs += [(f"{ours}attention.{a}.weight", f"{hf}self_attn.{b}.weight") for a, b in plain]
        pairs += [
            (f"{ours}attention_norm.weight", f"{hf}input_layernorm.weight"),
            (f"{ours}ffn_norm.weight", f"{hf}post_attention_layernorm.weight"),
        ]
        if not cfg.is_moe_layer(index):
            pairs += dense_ffn_pairs(index)
    return pairs


def deepseek_v3_tensors_to_hf(state: State, cfg: ModelConfig) -> State:
    """Each layer's query and latent projections with their RoPE rows interleaved, and
    each MoE layer's router, router bias, experts and shared experts (zero width when
    there are none)."""
    out: State = {}
    rope = cfg.mla_rope_head_size
    back = torch.argsort(_interleaved_order(rope))
    ours_q, hf_q = _query_name(cfg)
    for index in range(cfg.n_layers):
        ours, hf = f"layers.{index}.attention.", f"model.layers.{index}.self_attn."
        query = state[f"{ours}{ours_q}.weight"]
        out[f"{hf}{hf_q}.weight"] = _permute_head_rows(query, cfg.qk_head_dim, rope, back)
        latent = state[f"{ours}wkv_a.weight"]
        out[f"{hf}kv_a_proj_with_mqa.weight"] = _permute_head_rows(
            latent, latent.shape[0], rope, back
        )
    out.update(glm4_moe_tensors_to_hf(state, cfg))  # GLM-4-MoE's MoE tensors
    return out


def deepseek_v3_tensors_from_hf(
    source: HFTensors, hf: HFConfig, cfg: ModelConfig, shapes: Shapes
) -> State:
    """Our query and latent projections (RoPE rows in our order when the folder's
    rope_interleave says its are interleaved), routers, router biases, expert stacks and
    shared experts from a DeepSeek-V3 folder's tensors; its multi-token-prediction layers
    are passed over."""
    state: State = {}
    rope = cfg.mla_rope_head_size
    interleaved = hf.get_bool("rope_interleave", True)
    order = _interleaved_order(rope) if interleaved else torch.arange(rope)
    ours_q, hf_q = _query_name(cfg)
    for index in range(cfg.n_layers):
        ours, theirs = f"layers.{index}.attention.", f"model.layers.{index}.self_attn."
        name = f"{ours}{ours_q}.weight"
        query = source.take(f"{theirs}{hf_q}.weight", shapes[name])
        state[name] = _permute_head_rows(query, cfg.qk_head_dim, rope, order)
        name = f"{ours}wkv_a.weight"
        latent = source.take(f"{theirs}kv_a_proj_with_mqa.weight", shapes[name])
        state[name] = _permute_head_rows(latent, latent.shape[0], rope, order)
    # GLM-4-MoE's MoE tensors, its multi-token-prediction layers passed over.
    state.update(glm4_moe_tensors_from_hf(source, hf, cfg, shapes))
    return state


DEEPSEEK_V3 = Architecture(
    model_type="deepseek_v3",
    hf_class=HF_CLASS,
    requires=REQUIREMENTS,
    config_fields=deepseek_v3_config_fields,
    config_keys=deepseek_v3_config_keys,
    own_fields=OWN_FIELDS,
    renamed=deepseek_v3_pairs,
    tensors_to_hf=deepseek_v3_tensors_to_hf,
    tensors_from_hf=deepseek_v3_tensors_from_hf,
)
