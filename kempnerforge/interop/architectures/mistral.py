"""Mistral (``MistralForCausalLM``): Llama with a sliding window on every layer when its
config.json sets ``sliding_window`` (model.sliding_window; null attends to the whole past),
and a head size of its own where config.json gives one (model.head_size). Its tensors are
Llama's names, so only its config.json keys are its own. Export prefers Llama for a model
without a window (registered first); asked for by name, Mistral writes it with null."""

from __future__ import annotations

from typing import Any

from kempnerforge.config.model import ModelConfig
from kempnerforge.interop.architectures.architecture import Architecture, Requirement
from kempnerforge.interop.architectures.config_keys import HFConfig, common_model_fields

DEFAULT_WINDOW = 4096
"""MistralConfig's sliding_window when config.json leaves the key out (null turns it off)."""

DENSE = Requirement(
    "num_experts",
    lambda cfg: not cfg.is_moe,
    "0 for a MistralForCausalLM export",
    "Mistral has one dense feed-forward per layer; Mixtral is its MoE",
)


def mistral_config_keys(cfg: ModelConfig) -> dict[str, Any]:
    """config.json keys of the MistralForCausalLM equal to our ``cfg``."""
    return {
        "intermediate_size": cfg.hidden_dim,
        "sliding_window": cfg.sliding_window or None,
    }


def mistral_config_fields(hf: HFConfig) -> dict[str, Any]:
    """ModelConfig fields of a MistralForCausalLM config.json; refuses what we cannot build.

    An absent sliding_window is the class's 4096, null no window. MistralModel ignores a
    layer_types key (every layer uses the one window), so a folder carrying one is
    refused rather than read two ways."""
    if hf.data.get("layer_types") is not None:
        raise hf.error(
            "layer_types",
            "expected no per-layer attention types: MistralForCausalLM applies "
            "sliding_window to every layer and ignores them",
        )
    fields = common_model_fields(hf, llama_defaults=False, explicit_head_dim=True)
    fields["ffn_hidden_dim"] = hf.get_int("intermediate_size")
    fields["sliding_window"] = sliding_window(hf)
    return fields


def sliding_window(hf: HFConfig) -> int:
    """model.sliding_window of config.json: absent is the class's 4096, null is 0."""
    if "sliding_window" not in hf.data:
        return DEFAULT_WINDOW
    if hf.data["sliding_window"] is None:
        return 0
    window = hf.get_int("sliding_window")
    if window < 1:
        raise hf.error("sliding_window", "expected a window of at least 1 token, or null")
    return window


MISTRAL = Architecture(
    model_type="mistral",
    hf_class="MistralForCausalLM",
    requires=(DENSE,),
    config_fields=mistral_config_fields,
    config_keys=mistral_config_keys,
    own_fields=("head_size", "sliding_window"),
)
