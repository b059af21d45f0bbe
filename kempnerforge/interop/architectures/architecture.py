"""The record one Hugging Face architecture fills in: its names, when it represents our model
exactly, its config.json both ways and its tensors both ways."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.interop.architectures.config_keys import (
    HFConfig,
    build_model_config,
    check_model_type,
    common_config_json,
)
from kempnerforge.interop.architectures.mtp_layers import (
    flat_config,
    flat_state,
    mtp_tensors_from_hf,
    mtp_tensors_to_hf,
    nested_state,
)
from kempnerforge.interop.architectures.tensor_names import (
    HFTensors,
    expected_shapes,
    shared_pairs,
    take_pairs,
    tie_head,
)
from kempnerforge.interop.hf_model_checks import first_unknown_field

State = dict[str, torch.Tensor]
"""Tensors by name: our state dict, or a folder's tensors under its architecture's names."""
Shapes = dict[str, torch.Size]
"""Our state dict's tensor shapes, by our names (tensor_names.expected_shapes)."""

SHARED_FIELDS = frozenset(
    {
        *("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len"),
        *("rope_theta", "norm_eps", "tie_embeddings", "init_std"),
        *("ffn_hidden_dim", "ffn_multiplier", "multiple_of"),
        *("num_experts", "moe_top_k", "moe_frequency", "moe_router", "moe_shared_experts"),
        *("moe_expert_hidden_dim", "moe_capacity_factor", "moe_aux_loss_weight"),
        *("moe_aux_loss_level", "moe_router_z_loss_weight", "moe_bias_update_rate"),
        "moe_bias_schedule",
        "mtp_loss_weight",
    }
)
"""The ModelConfig fields every architecture here represents or refuses through its
requirements: the Llama decoder, the MoE feed-forward and the training-only settings. A
field added to ModelConfig later is refused (away from its default) by every architecture
that does not list it in ``own_fields``, so no class silently drops it."""


@dataclass(frozen=True)
class Requirement:
    """One thing an architecture needs of our ModelConfig to compute the same function: the
    ModelConfig attribute it reads, the test, and what a refusal says (expected, and why)."""

    field: str
    """The ModelConfig attribute the refusal names (as model.<field>)."""
    holds: Callable[[ModelConfig], bool]
    """True when the config meets the requirement."""
    allowed: str | Callable[[ModelConfig], str]
    """What the field may be, for the ConfigError; a callable when it depends on the config."""
    why: str
    """Why the class needs it: the ConfigError's hint."""

    def refusal(self, cfg: ModelConfig) -> ConfigError | None:
        """None when ``cfg`` meets this requirement, else the ConfigError naming the field."""
        if self.holds(cfg):
            return None
        allowed = self.allowed(cfg) if callable(self.allowed) else self.allowed
        return ConfigError(f"model.{self.field}", getattr(cfg, self.field), allowed, self.why)


def no_tensors_to_hf(state: State, cfg: ModelConfig) -> State:
    """An architecture whose every tensor is in ``renamed``: nothing else to write."""
    del state, cfg
    return {}


def no_tensors_from_hf(source: HFTensors, hf: HFConfig, cfg: ModelConfig, shapes: Shapes) -> State:
    """An architecture whose every tensor is in ``renamed``: nothing else to read."""
    del source, hf, cfg, shapes
    return {}


@dataclass(frozen=True)
class Architecture:
    """One Hugging Face causal-LM architecture that computes what our Transformer computes.

    An architecture module fills one in; the face of this wing registers it. What several
    share (config_keys, tensor_names) is the default or a function its fields call, so a
    field holds only what this architecture says differently.
    """

    model_type: str
    """config.json's ``model_type`` ("llama"): the registry's key."""
    hf_class: str
    """The transformers class config.json names in ``architectures`` ("LlamaForCausalLM")."""
    requires: tuple[Requirement, ...]
    """What our ModelConfig must be for this class to compute it exactly, broadest first (the
    kind of feed-forward, the router, then the finer points): export takes the first
    registered architecture meeting them all, and when none does, refuses with the first
    unmet requirement of the one that met the most."""
    config_fields: Callable[[HFConfig], dict[str, Any]]
    """ModelConfig fields from a folder's config.json (config_keys.common_model_fields plus
    its own keys), refusing every key whose value our model cannot compute."""
    config_keys: Callable[[ModelConfig], dict[str, Any]]
    """config.json keys beyond config_keys.common_config_json's (overriding them where the
    class reads a key differently), for a ModelConfig the requirements accept."""
    own_fields: tuple[str, ...] = ()
    """ModelConfig fields beyond SHARED_FIELDS this class computes (its requirements say
    which values); any other field away from its default is refused."""
    renamed: Callable[[ModelConfig], list[tuple[str, str]]] = shared_pairs
    """(our name, its name) of every tensor copied as it is; default Llama's names."""
    tensors_to_hf: Callable[[State, ModelConfig], State] = no_tensors_to_hf
    """Its tensors that are not a plain copy of one of ours (per-expert splits, transposes,
    zeros it expects), from our whole fp32 state dict."""
    tensors_from_hf: Callable[[HFTensors, HFConfig, ModelConfig, Shapes], State] = (
        no_tensors_from_hf
    )
    """Our tensors not in ``renamed``, taken from the folder's (shapes checked); it also
    takes or ignores every other tensor the folder holds for this class, so none is left
    unused (HFTensors.check_all_used)."""

    def matched(self, cfg: ModelConfig) -> tuple[int, ConfigError | None]:
        """(requirements met before the first unmet one, its refusal); (all, None) when this
        architecture represents ``cfg`` exactly. A field it does not know, set, is unmet
        before any requirement."""
        unknown = first_unknown_field(cfg, SHARED_FIELDS | set(self.own_fields))
        if unknown is not None:
            name, value, default = unknown
            return 0, ConfigError(
                f"model.{name}",
                value,
                f"its default {default!r} for {self.hf_class}",
                f"{self.hf_class} has no counterpart for this setting",
            )
        for met, requirement in enumerate(self.requires):
            refusal = requirement.refusal(cfg)
            if refusal is not None:
                return met, refusal
        return len(self.requires), None

    def check_represents(self, cfg: ModelConfig) -> None:
        """Refuse ``cfg`` with a ConfigError naming the first field this class cannot express."""
        _, refusal = self.matched(cfg)
        if refusal is not None:
            raise refusal

    def write_config(self, cfg: ModelConfig, special_ids: dict[str, int]) -> dict[str, Any]:
        """The config.json of this class equal to our ``cfg``."""
        return {
            "architectures": [self.hf_class],
            "model_type": self.model_type,
            **common_config_json(cfg, special_ids),
            **self.config_keys(cfg),
        }

    def read_config(self, hf: HFConfig) -> ModelConfig:
        """The ModelConfig of a folder of this class; an HFFolderError names the key that
        another class or a feature our model lacks."""
        check_model_type(hf, self.model_type, self.hf_class)
        return build_model_config(self.config_fields(hf), hf)

    def to_hf(self, state: State, cfg: ModelConfig) -> State:
        """The folder's tensors, under this class's names, from our whole state dict.

        Multi-token-prediction blocks (model.mtp_depth, only for a class that owns the
        field) go through the per-layer maps as the layers after the decoder's, then
        their own tensors are added (mtp_layers.py)."""
        flat_cfg, flat = flat_config(cfg), flat_state(state, cfg)
        tensors = {theirs: flat[ours] for ours, theirs in self.renamed(flat_cfg)}
        tensors.update(self.tensors_to_hf(flat, flat_cfg))
        tensors.update(mtp_tensors_to_hf(state, cfg))
        return tensors

    def from_hf(self, source: HFTensors, hf: HFConfig, cfg: ModelConfig) -> State:
        """Our state dict (fp32) from the folder's tensors; an HFFolderError names a tensor
        missing, mis-shaped or left unused."""
        flat_cfg = flat_config(cfg)  # MTP blocks as the layers after the decoder's
        shapes = expected_shapes(flat_cfg)
        state: State = {}
        take_pairs(source, self.renamed(flat_cfg), shapes, state)
        state.update(self.tensors_from_hf(source, hf, flat_cfg, shapes))
        tie_head(cfg, state, source)
        state = nested_state(state, cfg)
        state.update(mtp_tensors_from_hf(source, state, cfg))
        source.check_all_used()
        return state
