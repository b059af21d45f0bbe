"""The DCP load planner every load here uses: pickled items are read weights-only.

DCP stores non-tensor values (optimizer param_groups entries, ...) as pickled byte items,
and its DefaultLoadPlanner unpickles them with ``torch.load(weights_only=False)``: a
planted item would run code on resume or on an eval. Tensor items are already read
weights-only by DCP's filesystem reader.
"""

from __future__ import annotations

import io
from pathlib import Path

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from kempnerforge.core.errors import CheckpointError


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose byte items load with ``weights_only=True``.

    A byte item that a weights-only load refuses, or one saved where the state being
    loaded holds a tensor (DCP plans a byte read for whatever the checkpoint says is
    there), raises CheckpointError naming `checkpoint` and the item's key.
    """

    def __init__(self, checkpoint: Path) -> None:
        super().__init__()
        self.checkpoint = checkpoint

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        if isinstance(self.state_dict.get(key), torch.Tensor):
            raise CheckpointError(
                self.checkpoint,
                f"DCP item {key!r} must be a tensor but was saved as a pickled object; "
                "not loading it (a tampered or foreign checkpoint?)",
            )
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(
                self.checkpoint,
                f"DCP item {key!r} is refused by a weights-only load ({refusal(e)}); "
                "not loading it (a tampered or foreign checkpoint?)",
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[key], obj)
        else:
            self.state_dict[key] = obj


def refusal(error: BaseException) -> str:
    """Why ``torch.load(weights_only=True)`` refused a file, in one line.

    torch's message is a paragraph of advice (including to load with weights_only=False,
    which a planted file must never get); only its ``WeightsUnpickler error:`` reason is
    kept, e.g. "Unsupported global: GLOBAL posix.system".
    """
    text = str(error)
    marker = "WeightsUnpickler error:"
    if marker in text:
        reason = text.split(marker, 1)[1].strip().splitlines()[0]
        return reason.split(" was not an allowed global")[0].split(". Please")[0].strip()
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(error).__name__}: {first[:200]}" if first else type(error).__name__
