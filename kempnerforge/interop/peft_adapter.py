"""A run's low-rank adapters as a peft adapter folder: adapter_config.json and
adapter_model.safetensors, which peft's ``PeftModel.from_pretrained`` loads onto the
Hugging Face model `export --format hf` writes of the base (or onto the published model
the run started from).

peft names each adapter by the Hugging Face module it adapts
(``base_model.model.<module>.lora_A.weight``, (rank, in); ``lora_B.weight``, (out,
rank)): the same matrices as ours, under the architecture's tensor names. The config lists
the adapted modules by their full paths, so peft adapts exactly those and no other module
whose name ends alike (an MoE layer's shared expert, say).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from kempnerforge.config.lora import LoRAConfig
from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.interop.architectures import ARCHITECTURES, shared_pairs
from kempnerforge.interop.hf_state import plain_state
from kempnerforge.model.lora import is_adapter_parameter, lora_modules

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def hf_module_names(model: nn.Module, model_cfg: ModelConfig) -> dict[str, str]:
    """The Hugging Face module path of each adapted projection of ``model``, by ours.

    The names every architecture shares with ours (tensor_names.shared_pairs), confirmed
    on the export itself: the merged model is converted by the architecture export_hf
    uses, and each projection's weight must come out whole and unchanged under that name.
    A projection that does not is a ConfigError naming it. One conversion, whatever the
    number of adapters; the caller's model is left as it is.
    """
    architecture = ARCHITECTURES.for_config(model_cfg)
    pairs = dict(shared_pairs(model_cfg))
    state = {k: v for k, v in plain_state(model).items() if not is_adapter_parameter(k)}
    exported = architecture.to_hf(state, model_cfg)
    names: dict[str, str] = {}
    for path in lora_modules(model):
        ours = f"{path}.weight"
        theirs = pairs.get(ours, "")
        whole = theirs in exported and torch.equal(exported[theirs], state[ours])
        if not whole:
            raise ConfigError(
                "lora.target_modules",
                [path.rsplit(".", 1)[-1]],
                f"projections that {architecture.hf_class} holds as whole modules",
                f"{path} is not one module of {architecture.hf_class}; export the merged "
                "model with --format hf instead",
            )
        names[path] = theirs.removesuffix(".weight")
    return names


def export_peft(
    model: nn.Module,
    model_cfg: ModelConfig,
    lora: LoRAConfig,
    out_dir: str | os.PathLike[str],
    base_model: str | None = None,
) -> Path:
    """Write the adapters of ``model`` (built with [lora] ``lora``, not merged) as a peft
    adapter folder in ``out_dir``; ``base_model`` is recorded as base_model_name_or_path."""
    from safetensors.torch import save_file

    adapters = lora_modules(model)
    if not adapters:
        raise ConfigError(
            "lora.rank",
            lora.rank,
            "> 0: the run must have trained adapters to export them",
            "export the whole model with --format hf",
        )
    names = hf_module_names(model, model_cfg)
    tensors: dict[str, torch.Tensor] = {}
    for path, module in adapters.items():
        prefix = f"base_model.model.{names[path]}"
        tensors[f"{prefix}.lora_A.weight"] = _whole(module.lora_a)
        tensors[f"{prefix}.lora_B.weight"] = _whole(module.lora_b)
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = adapter_config(lora, sorted(names.values()), base_model)
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return folder


def _whole(param: torch.Tensor) -> torch.Tensor:
    tensor = param.full_tensor() if isinstance(param, DTensor) else param
    return tensor.detach().to(device="cpu", dtype=torch.float32).contiguous().clone()


def adapter_config(lora: LoRAConfig, modules: list[str], base_model: str | None) -> dict[str, Any]:
    """peft's LoraConfig for these adapters: plain LoRA (no DoRA, no rsLoRA scaling: the
    update is scaled by alpha / rank), no bias, no other trained module."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
