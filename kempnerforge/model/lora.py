"""Low-rank adapters (LoRA): a frozen projection plus a trained low-rank update.

A projection y = x W^T + b becomes y = x W^T + b + scale * (dropout(x) A^T) B^T, with A of
shape (rank, in) and B of shape (out, rank), scale = alpha / rank, as in Hu et al. (2021)
and the peft library. B starts at zero, so an adapted model starts as the model it adapts;
A is drawn normal(0, 1 / rank) (peft's "gaussian" initialisation) from the model's seed,
like every other weight (Transformer.init_parameters), so every layout starts alike.

The adapter is part of the projection module (``lora_a``, ``lora_b`` beside ``weight``), so
the base weight keeps its name: a checkpoint or Hugging Face folder without adapters loads
into the adapted model unchanged, and tensor parallelism splits the adapter with its base
(distributed/tensor_parallel.py). Only decoder blocks' attention projections and dense
feed-forward projections are adapted: the ones a Hugging Face class names one to one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kempnerforge.config.lora import LoRAConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.model.mlp import SwiGLU

ADAPTED_PARENTS = ("attention", "feed_forward")
"""The block submodules whose projections may be adapted (a dense feed-forward only)."""


class LoRALinear(nn.Linear):
    """nn.Linear with a low-rank update of its output (see the module docstring).

    Subclassing nn.Linear keeps every tool that looks for linear layers (parallel plans,
    FSDP, the state dict's ``weight``/``bias`` names) working on the base projection.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        *,
        rank: int,
        alpha: float,
        dropout: float,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device)
        self.rank = rank
        self.scale = alpha / rank
        """alpha / rank, peft's ``scaling``."""
        self.dropout = dropout
        self.lora_a = nn.Parameter(torch.zeros(rank, in_features, device=device))
        """A (rank, in): projects the input down to the adapter's rank."""
        self.lora_b = nn.Parameter(torch.zeros(out_features, rank, device=device))
        """B (out, rank): projects back up; zero at the start."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dropped = F.dropout(x, self.dropout, self.training) if self.dropout else x
        # The scale is applied on the rank-sized activation, and the update added into the
        # base's output in place (a linear's backward does not read its output): one
        # output-sized temporary per projection instead of three.
        low = F.linear(dropped, self.lora_a) * self.scale
        return F.linear(x, self.weight, self.bias).add_(F.linear(low, self.lora_b))

    def adapter_init_stds(self) -> dict[str, float]:
        """The normal std each adapter parameter is drawn with (0: zeros)."""
        return {"lora_a": 1.0 / self.rank, "lora_b": 0.0}

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """W + scale * B A in float32: the weight of the plain projection that computes
        what this one computes in eval mode (no dropout)."""
        delta = self.lora_b.float() @ self.lora_a.float()
        return self.weight.float() + self.scale * delta

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scale={self.scale:g}"


def adaptable_linears(model: nn.Module) -> dict[str, tuple[nn.Module, str, nn.Linear]]:
    """Every projection an adapter may go on, by its module path: (parent, attribute,
    module) of each nn.Linear directly under a block's attention or dense feed-forward."""
    found: dict[str, tuple[nn.Module, str, nn.Linear]] = {}
    for path, module in model.named_modules():
        parent_name = path.rsplit(".", 1)[-1]
        if parent_name not in ADAPTED_PARENTS:
            continue
        if parent_name == "feed_forward" and not isinstance(module, SwiGLU):
            continue  # an MoE layer: its experts are not linear modules
        for name, child in module.named_children():
            if isinstance(child, nn.Linear):
                found[f"{path}.{name}"] = (module, name, child)
    return found


def apply_lora(
    model: nn.Module, targets: tuple[str, ...], *, rank: int, alpha: float, dropout: float
) -> list[str]:
    """Replace each projection named by ``targets`` (its attribute name, e.g. 'wq') with a
    LoRALinear sharing its weight and bias, in place; return the adapted module paths.

    Call it before the model is parallelised or materialised (on the meta device): the
    adapters are then sharded, checkpointed and initialised like every other parameter.
    """
    adapted = []
    for path, (parent, name, linear) in adaptable_linears(model).items():
        if name not in targets:
            continue
        lora = LoRALinear(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            rank=rank,
            alpha=alpha,
            dropout=dropout,
            device=linear.weight.device,
        )
        lora.weight = linear.weight
        if linear.bias is not None:
            lora.bias = linear.bias
        setattr(parent, name, lora)
        adapted.append(path)
    return adapted


def add_adapters(model: nn.Module, lora: LoRAConfig) -> list[str]:
    """Put ``lora``'s adapters on ``model`` (on the meta device, before parallelisation),
    in place; return the adapted module paths ([] when lora.rank = 0).

    A target no block of this model (or of this pipeline rank's stages) has is a
    ConfigError naming it: an adapter that silently trains nothing would be a lost run.
    """
    if not lora.enabled:
        return []
    present = {path.rsplit(".", 1)[-1] for path in adaptable_linears(model)}
    missing = [name for name in lora.projections if name not in present]
    if missing:
        raise ConfigError(
            "lora.target_modules",
            lora.target_modules,
            f"projections this model's blocks have: {', '.join(sorted(present)) or 'none'}",
            f"{', '.join(missing)} is in no decoder block's attention or dense feed-forward "
            "(an MoE layer's experts and latent attention's low-rank projections are not "
            "adapted)",
        )
    return apply_lora(
        model, lora.projections, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout
    )


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """The adapted projections of ``model``, by module path."""
    return {path: m for path, m in model.named_modules() if isinstance(m, LoRALinear)}


def is_adapter_parameter(name: str) -> bool:
    """Whether state-dict entry ``name`` is an adapter's (A or B), not a base weight."""
    return name.endswith((".lora_a", ".lora_b"))


def freeze_base(model: nn.Module) -> tuple[int, int]:
    """Freeze every parameter but the adapters'; (trainable, frozen) element counts.

    A frozen parameter gets no gradient, so the optimizer never holds state for it.
    """
    trainable = frozen = 0
    for name, param in model.named_parameters():
        train = is_adapter_parameter(name)
        param.requires_grad_(train)
        if train:
            trainable += param.numel()
        else:
            frozen += param.numel()
    return trainable, frozen


@torch.no_grad()
def merge_lora(model: nn.Module) -> int:
    """Replace every LoRALinear of ``model`` (unsharded) with a plain nn.Linear holding
    W + scale * B A, in place, in the base weight's dtype; return how many were merged.

    The merged model computes what the adapted one computes in eval mode; it is what
    inference and `export --format hf` use.
    """
    merged = 0
    for path, module in lora_modules(model).items():
        parent = model.get_submodule(path.rsplit(".", 1)[0]) if "." in path else model
        plain = nn.Linear(
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            device=module.weight.device,
            dtype=module.weight.dtype,
        )
        plain.weight.copy_(module.merged_weight().to(module.weight.dtype))
        if module.bias is not None:
            plain.bias.copy_(module.bias)
        setattr(parent, path.rsplit(".", 1)[-1], plain)
        merged += 1
    return merged
