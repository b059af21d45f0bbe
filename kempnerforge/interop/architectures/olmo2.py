"""OLMo 2 (``Olmo2ForCausalLM``): our dense Transformer with the block's norms on the
sublayers' outputs (model.norm_placement = 'post': h = x + norm(attention(x))) and an RMSNorm
over the whole query and key projections before RoPE (model.qk_norm = 'projection'). Its
tensors are Llama's names with its norms' (tensor_names.BLOCK_NORMS), so only its
config.json keys are its own."""

from __future__ import annotations

from typing import Any

from kempnerforge.config.model import ModelConfig
from kempnerforge.interop.architectures.architecture import Architecture, Requirement
from kempnerforge.interop.architectures.config_keys import HFConfig, common_model_fields

DENSE = Requirement(
    "num_experts",
    lambda cfg: not cfg.is_moe,
    "0 for an Olmo2ForCausalLM export",
    "OLMo 2 has one dense feed-forward per layer",
)
POST_NORMS = Requirement(
    "norm_placement",
    lambda cfg: cfg.norm_placement == "post",
    "'post' for an Olmo2ForCausalLM export",
    "OLMo 2 normalises each sublayer's output, not its input",
)
PROJECTION_QK_NORM = Requirement(
    "qk_norm",
    lambda cfg: cfg.qk_norm == "projection",
    "'projection' for an Olmo2ForCausalLM export",
    "OLMo 2 normalises the whole query and key projections",
)


def olmo2_config_keys(cfg: ModelConfig) -> dict[str, Any]:
    """config.json keys of the Olmo2ForCausalLM equal to our ``cfg``."""
    return {"intermediate_size": cfg.hidden_dim, "attention_bias": False}


def olmo2_config_fields(hf: HFConfig) -> dict[str, Any]:
    """ModelConfig fields of an Olmo2ForCausalLM config.json; refuses what we cannot build
    (a head_dim apart from the width's share included: Olmo2Config has no such key)."""
    hf.require("attention_bias", False, False, "kempnerforge's projections have no biases")
    fields = common_model_fields(hf, llama_defaults=False)
    fields["ffn_hidden_dim"] = hf.get_int("intermediate_size")
    fields.update(qk_norm="projection", norm_placement="post")
    return fields


OLMO2 = Architecture(
    model_type="olmo2",
    hf_class="Olmo2ForCausalLM",
    requires=(DENSE, POST_NORMS, PROJECTION_QK_NORM),
    config_fields=olmo2_config_fields,
    config_keys=olmo2_config_keys,
    own_fields=("qk_norm", "norm_placement"),
)
