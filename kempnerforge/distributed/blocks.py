"""Where a model's decoder blocks are: the stacks its family's model names
(FamilyModel.decoder_stacks) and their blocks in layer order, for every apply_* step."""

from __future__ import annotations

from torch import nn

from kempnerforge.model.contract import FamilyModel


def transformer_blocks(model: FamilyModel) -> list[tuple[int, nn.Module]]:
    """(layer index, block) for every block under ``model``, in index order.

    The index is the ModuleDict key, i.e. the layer's place in the whole model, so a
    pipeline stage checkpoints the same layers as the whole model would; a training head's
    blocks (multi-token prediction) follow with their own indices, last.
    """
    blocks: dict[int, tuple[int, nn.Module]] = {}
    for stage in model.decoder_stacks():
        for key, block in stage.layers.items():
            blocks[id(block)] = (int(key), block)
    for index, block in model.training_head_blocks():
        blocks[id(block)] = (index, block)
    return sorted(blocks.values(), key=lambda item: item[0])
