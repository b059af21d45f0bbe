"""Where a model's decoder blocks are: the modules holding a ``layers`` ModuleDict (the
model or its pipeline stages) and their blocks in layer order, for every apply_* step."""

from __future__ import annotations

from torch import nn


def model_stages(model: nn.Module) -> list[nn.Module]:
    """The modules under ``model`` (itself included) that hold a ``layers`` ModuleDict of
    blocks: the model itself, or each pipeline stage of a rank that holds several."""
    stages: list[nn.Module] = []
    for module in model.modules():
        if isinstance(getattr(module, "layers", None), nn.ModuleDict):
            stages.append(module)
    return stages


def transformer_blocks(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(layer index, block) for every block under ``model``, in index order.

    The index is the ModuleDict key, i.e. the layer's place in the whole model, so a
    pipeline stage checkpoints the same layers as the whole model would.
    """
    blocks: dict[int, tuple[int, nn.Module]] = {}
    for stage in model_stages(model):
        layers = stage.layers
        assert isinstance(layers, nn.ModuleDict)
        for key, block in layers.items():
            blocks[id(block)] = (int(key), block)
    return sorted(blocks.values(), key=lambda item: item[0])
