"""What the MoE architectures here share: their first requirements, our stacked experts as
one nn.Linear matrix per expert both ways, a zero-width SwiGLU, and the config.json keys
they read alike.

Our experts are (experts, in, out) stacks; published checkpoints hold one nn.Linear (out,
in) matrix per expert (transformers 5 fuses them on load), so each expert's slice is
written transposed, which is exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kempnerforge.config.model import ModelConfig
from kempnerforge.interop.architectures.architecture import Requirement, Shapes, State
from kempnerforge.interop.architectures.config_keys import HFConfig
from kempnerforge.interop.architectures.tensor_names import HFTensors

OUR_SWIGLU = ("w1", "w3", "w2")
"""Our names of an expert's gate, up and down projections."""

NO_SHARED_EXPERTS = Requirement(
    "moe_shared_experts",
    lambda cfg: cfg.moe_shared_experts == 0,
    "0 for a softmax-router export",
    "Mixtral and Qwen3-MoE have no shared experts and Qwen2-MoE scales its shared expert "
    "by a learned "
    "sigmoid gate; no Hugging Face class with standard attention adds ungated shared "
    "experts to a softmax router",
)
"""A softmax-router class here sums no ungated shared experts."""


def moe_requirement(hf_class: str) -> Requirement:
    """The first requirement of an MoE class: our model has MoE layers."""
    return Requirement(
        "num_experts",
        lambda cfg: cfg.is_moe,
        f"> 0 for a {hf_class} export",
        "a dense model is written by export_hf as a dense class",
    )


def router_requirement(router: str, hf_class: str, why: str) -> Requirement:
    """Our model.moe_router must be ``router``, the one ``hf_class`` computes."""
    return Requirement(
        "moe_router", lambda cfg: cfg.moe_router == router, f"{router!r} for {hf_class}", why
    )


def moe_layers(cfg: ModelConfig) -> list[int]:
    """The indices of our MoE layers."""
    return [index for index in range(cfg.n_layers) if cfg.is_moe_layer(index)]


def moe_prefixes(index: int, block: str) -> tuple[str, str]:
    """(our prefix, its prefix) of MoE layer ``index``, whose MoE block it names ``block``."""
    return f"layers.{index}.feed_forward", f"model.layers.{index}.{block}"


def experts_to_hf(
    state: State, cfg: ModelConfig, index: int, block: str, names: tuple[str, str, str]
) -> State:
    """Router and experts of MoE layer ``index`` under its names: ``names`` are its gate, up
    and down projections (our w1, w3, w2), one transposed matrix per expert."""
    ours, hf = moe_prefixes(index, block)
    out = {f"{hf}.gate.weight": state[f"{ours}.router.gate.weight"]}
    for mine, theirs in zip(OUR_SWIGLU, names, strict=True):
        stacked = state[f"{ours}.experts.{mine}"]
        for expert in range(cfg.num_experts):
            out[f"{hf}.experts.{expert}.{theirs}.weight"] = stacked[expert].T
    return out


def experts_from_hf(
    source: HFTensors,
    cfg: ModelConfig,
    index: int,
    block: str,
    names: tuple[str, str, str],
    shapes: Shapes,
) -> State:
    """Our router and expert stacks of MoE layer ``index`` from the folder's (experts_to_hf
    reversed), shapes checked by name."""
    ours, hf = moe_prefixes(index, block)
    gate = f"{ours}.router.gate.weight"
    out = {gate: source.take(f"{hf}.gate.weight", shapes[gate])}
    for mine, theirs in zip(OUR_SWIGLU, names, strict=True):
        stacked = shapes[f"{ours}.experts.{mine}"]
        per_expert = (stacked[2], stacked[1])
        slices = [
            source.take(f"{hf}.experts.{e}.{theirs}.weight", per_expert).T
            for e in range(cfg.num_experts)
        ]
        out[f"{ours}.experts.{mine}"] = torch.stack(slices).contiguous()
    return out


def every_moe_layer_maps(
    block: str, names: tuple[str, str, str], family: str
) -> tuple[Callable[[State, ModelConfig], State], Callable[..., State]]:
    """(tensors_to_hf, tensors_from_hf) of an architecture whose only own tensors are
    each MoE layer's router and experts under ``block`` with the SwiGLU ``names`` (gate,
    up, down): one transposed matrix per expert (experts_to_hf / experts_from_hf). The
    rest of the layer is Llama's shared names. ``family`` names the class in docstrings."""

    def tensors_to_hf(state: State, cfg: ModelConfig) -> State:
        out: State = {}
        for index in moe_layers(cfg):
            out.update(experts_to_hf(state, cfg, index, block, names))
        return out

    def tensors_from_hf(source: HFTensors, hf: HFConfig, cfg: ModelConfig, shapes: Shapes) -> State:
        del hf
        state: State = {}
        for index in moe_layers(cfg):
            state.update(experts_from_hf(source, cfg, index, block, names, shapes))
        return state

    tensors_to_hf.__doc__ = f"Router and experts of each MoE layer of a {family}."
    tensors_from_hf.__doc__ = f"Our routers and expert stacks from a {family} folder's tensors."
    return tensors_to_hf, tensors_from_hf


def empty_swiglu(dim: int, name: str) -> torch.Tensor:
    """A zero-width SwiGLU projection: (0, dim) for w1 / w3, (dim, 0) for w2."""
    return torch.zeros(dim, 0) if ".w2." in name else torch.zeros(0, dim)


def renormalised_top_k(hf: HFConfig) -> int:
    """num_experts_per_tok of a class that renormalises the gates when ``norm_topk_prob``:
    ours renormalises over the k chosen when k > 1 and keeps the raw value for k = 1, so
    the folder must say the same."""
    k = hf.get_int("num_experts_per_tok")
    hf.require(
        "norm_topk_prob",
        k > 1,
        None,
        f"kempnerforge renormalises the gates exactly when top-k > 1 (here {k})",
    )
    return k


def aux_loss_fields(hf: HFConfig) -> dict[str, Any]:
    """moe_aux_loss_weight from router_aux_loss_coef when it is a sane weight; a training
    setting, so an odd value is left at our default rather than refused."""
    coef = hf.data.get("router_aux_loss_coef")
    if isinstance(coef, int | float) and not isinstance(coef, bool) and 0 <= coef <= 1000:
        return {"moe_aux_loss_weight": float(coef)}
    return {}


def first_moe_layer(cfg: ModelConfig) -> int:
    """The index of the first MoE layer (n_layers when there is none)."""
    return next((index for index in range(cfg.n_layers) if cfg.is_moe_layer(index)), cfg.n_layers)


def dense_first_requirement(hf_class: str) -> Requirement:
    """The MoE layers must be the last ones (a class whose dense layers come first:
    ``first_k_dense_replace``), named after model.moe_frequency, which interleaves them."""
    return Requirement(
        "moe_frequency",
        lambda cfg: moe_layers(cfg) == list(range(first_moe_layer(cfg), cfg.n_layers)),
        lambda cfg: (
            "1 (the first model.moe_first_dense_layers dense) or model.n_layers = "
            f"{cfg.n_layers} for a sigmoid-router export"
        ),
        f"{hf_class}, the Hugging Face class with this router, has its dense layers first "
        "and MoE layers after them (first_k_dense_replace)",
    )


def dense_first_fields(hf: HFConfig, n_layers: int) -> dict[str, Any]:
    """model.moe_frequency and model.moe_first_dense_layers of first_k_dense_replace = k:
    all MoE for 0, the last layer alone as moe_frequency = n_layers, else the first k
    dense. A k leaving no MoE layer is refused (the model would be dense)."""
    first_dense = hf.get_int("first_k_dense_replace")
    if not 0 <= first_dense < n_layers:
        raise hf.error(
            "first_k_dense_replace",
            f"expected 0 to num_hidden_layers - 1 = {n_layers - 1}: kempnerforge imports "
            "this class as an MoE model, with at least one MoE layer",
        )
    if first_dense == n_layers - 1 and n_layers > 1:
        return {"moe_frequency": n_layers}
    return {"moe_frequency": 1, "moe_first_dense_layers": first_dense}


def group_routing_fields(hf: HFConfig) -> dict[str, Any]:
    """model.moe_num_groups, moe_top_groups and moe_routed_scaling of n_group, topk_group
    and routed_scaling_factor (absent or null: 1, 1, 1.0)."""
    return {
        "moe_num_groups": hf.get_int("n_group", 1),
        "moe_top_groups": hf.get_int("topk_group", 1),
        "moe_routed_scaling": hf.get_float("routed_scaling_factor", 1.0),
    }


def group_routing_keys(cfg: ModelConfig) -> dict[str, Any]:
    """config.json's n_group, topk_group, routed_scaling_factor and first_k_dense_replace
    of our group-limited sigmoid router and dense-first layers (group_routing_fields and
    dense_first_fields reversed)."""
    return {
        "n_group": cfg.moe_num_groups,
        "topk_group": cfg.moe_top_groups,
        "routed_scaling_factor": cfg.moe_routed_scaling,
        "first_k_dense_replace": first_moe_layer(cfg),
    }


DEEPSEEK_ROUTER_FIELDS = (
    "moe_num_groups",
    "moe_top_groups",
    "moe_routed_scaling",
    "moe_first_dense_layers",
)
"""The ModelConfig fields of DeepSeek-V3's routing that its classes (DeepSeek-V3,
GLM-4-MoE) represent."""
