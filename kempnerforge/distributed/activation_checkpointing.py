"""apply_ac: activation checkpointing of decoder blocks by changing their class, so
parameter names stay the same."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from kempnerforge.distributed.blocks import transformer_blocks
from kempnerforge.model.contract import FamilyModel


class _Checkpointed(nn.Module):
    """Mixin placed before a block's own class: its forward recomputes in backward.

    Changing the class instead of wrapping the block keeps every parameter name (a
    wrapper would insert a level, ``_checkpoint_wrapped_module``, into the state dict).
    """

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Non-reentrant: takes keyword arguments and DTensor inputs, and runs under FSDP's
        # hooks, which gather the parameters again before the recomputation.
        return checkpoint(super().forward, *args, use_reentrant=False, **kwargs)


_CHECKPOINTED_CLASSES: dict[type, type] = {}


def _checkpointed_class(cls: type) -> type:
    """The (cached) subclass of ``cls`` whose forward runs under activation checkpointing."""
    if cls not in _CHECKPOINTED_CLASSES:
        name = f"Checkpointed{cls.__name__}"
        _CHECKPOINTED_CLASSES[cls] = type(name, (_Checkpointed, cls), {})
    return _CHECKPOINTED_CLASSES[cls]


def apply_ac(model: FamilyModel, mode: str, every: int) -> None:
    """Recompute block activations in backward instead of storing them, in place.

    'none' does nothing, 'full' checkpoints every block, 'selective' the blocks whose
    layer index is a multiple of ``every``. Only a block's input is kept; its forward runs
    again during backward, so gradients are exactly those without checkpointing.
    """
    if mode == "none":
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing: 'none', 'full' or 'selective', not {mode!r}")
    for index, block in transformer_blocks(model):
        if isinstance(block, _Checkpointed) or (mode == "selective" and index % every):
            continue
        block.__class__ = _checkpointed_class(type(block))
