"""A built model's tensors for a Hugging Face folder: its state gathered whole for export,
and an imported state copied back into its (possibly sharded) tensors."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from kempnerforge.interop.hf_files import HFFolderError
from kempnerforge.model.transformer import copy_full_tensor


def plain_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as whole fp32 CPU tensors (a DTensor is gathered: collective)."""
    state = {}
    for name, value in model.state_dict().items():
        tensor = value.full_tensor() if isinstance(value, DTensor) else value
        state[name] = tensor.detach().to(device="cpu", dtype=torch.float32)
    return state


def copy_into(model: nn.Module, state: dict[str, torch.Tensor], folder: str) -> None:
    """Copy ``state`` into every tensor of ``model``'s state dict (a DTensor keeps its shard).

    A pipeline stage takes the layers it holds; a tensor the model has but ``state``
    lacks, or with another shape, is an HFFolderError naming it.
    """
    targets = model.state_dict(keep_vars=True)
    for name, target in targets.items():
        if name not in state:
            raise HFFolderError(folder, f"gives no value for the model's tensor {name}")
        if tuple(state[name].shape) != tuple(target.shape):
            raise HFFolderError(
                folder,
                f"gives {name} the shape {tuple(state[name].shape)}, the model has "
                f"{tuple(target.shape)}",
            )
    with torch.no_grad():
        for name, target in targets.items():
            copy_full_tensor(target, state[name])
