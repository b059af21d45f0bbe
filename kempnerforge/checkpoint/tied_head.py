"""The optimizer state of a pipeline rank's copy of a tied embedding, under the embedding's
name in checkpoints (model/contract.py's tied_head_copy; distributed/tied_head.py keeps the
two copies equal).

The whole tied model has one parameter, whose state a checkpoint holds under
``tok_embeddings.weight``; on a pipeline rank holding only the head, the same weight is
``output.weight``. Saving renames the copy's state to the embedding's name, so every
layout writes the checkpoint the whole model writes (the two ranks' identical entries
are written once), and loading reads it back from there, so a run resumes on any layout.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from kempnerforge.distributed.tied_head import tied_head_copy

HEAD, EMBEDDING = "output.weight", "tok_embeddings.weight"


def saved_name(model: nn.Module, fqn: str) -> str:
    """The name parameter ``fqn``'s optimizer state has in a checkpoint."""
    return EMBEDDING if fqn == HEAD and tied_head_copy(model) else fqn


def rename_head_copy(model: nn.Module, optim_sd: dict[str, Any], *, to_saved: bool) -> None:
    """Rename the head copy's entries of ``optim_sd`` (get_state_dict's FQN-keyed form) to
    the embedding's name (``to_saved``) or back, in place; nothing on other ranks."""
    if not tied_head_copy(model):
        return
    old, new = (HEAD, EMBEDDING) if to_saved else (EMBEDDING, HEAD)
    state = optim_sd.get("state", {})
    if old in state:
        state[new] = state.pop(old)
    for group in optim_sd.get("param_groups", []):
        group["params"] = [new if fqn == old else fqn for fqn in group["params"]]
