"""Column- and row-wise tensor-parallel styles that also split a projection's low-rank
adapter (model/lora.py's LoRALinear) consistently with its base weight.

torch's ColwiseParallel shards every parameter of the module along dim 0 and
RowwiseParallel leaves all but weight and bias to be replicated; for an adapter
y = x W^T + s (x A^T) B^T that would split A along its rank (column-wise) or gather the
sharded input for A (row-wise). Instead:

- column-wise (W split by output rows): B is split by the same rows and A stays whole,
  so each rank computes its own output columns from the whole input, with no
  communication beyond the base's;
- row-wise (W split by input columns): A is split by the same columns and B stays whole;
  the adapter's (rank-sized) partial sums are reduced together with the base's partial
  output, by the same reduction.

For a plain nn.Linear both behave exactly as torch's styles.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.placement_types import Placement

COLUMN_PLACEMENTS: dict[str, Placement] = {
    "weight": Shard(0),
    "bias": Shard(0),
    "lora_a": Replicate(),
    "lora_b": Shard(0),
}
ROW_PLACEMENTS: dict[str, Placement] = {
    "weight": Shard(1),
    "bias": Replicate(),
    "lora_a": Shard(1),
    "lora_b": Replicate(),
}


def _distribute(
    module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement], src_rank: int | None
) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        sharded = distribute_tensor(param, mesh, [placements[name]], src_data_rank=src_rank)
        module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


class ColumnSplit(ColwiseParallel):
    """ColwiseParallel that splits an adapter's B with the weight and keeps A whole."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _distribute(module, device_mesh, COLUMN_PLACEMENTS, self.src_data_rank)


class RowSplit(RowwiseParallel):
    """RowwiseParallel that splits an adapter's A with the weight and keeps B whole."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _distribute(module, device_mesh, ROW_PLACEMENTS, self.src_data_rank)
