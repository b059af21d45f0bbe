"""MoETensorParallel: the tensor-parallel style of an MoE layer, with whole tokens and
router on every rank and each expert's hidden features split."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from kempnerforge.model.moe import MoEFeedForward

EXPERT_PLACEMENTS = {
    "w1": Shard(2),
    "w3": Shard(2),
    "w2": Shard(1),
    "b1": Shard(1),
    "b3": Shard(1),
    "b2": Replicate(),
}
"""GroupedExperts' parameters over the tensor-parallel ranks: the gate and up projections
(experts, dim, hidden) and their biases split on the hidden features, the down projection
(experts, hidden, dim) on its input; the down bias whole (one rank adds it)."""

SHARED_PLACEMENTS = {"w1": Shard(0), "w3": Shard(0), "w2": Shard(1)}
"""The shared experts' nn.Linear weights (out, in): gate and up split on their output
features, down on its input features, as a dense feed-forward's."""


class MoETensorParallel(ParallelStyle):
    """An MoEFeedForward under tensor parallelism (model/moe/tensor_split.py).

    The layer's input is gathered whole on every rank (all-gathered along the sequence
    under sequence parallelism), every rank routes every token with the replicated router,
    computes its slice of each chosen expert's hidden features and returns a partial sum:
    all-reduced into a whole output, or reduce-scattered back onto the sequence shard (a
    DTensor, for the residual add) under sequence parallelism. In backward the input's
    gradient, a partial sum per rank, is reduced the same way. Router statistics, losses
    and the balancing bias come from the whole tokens, equal on every rank.
    """

    def __init__(self, *, sequence_parallel: bool) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, MoEFeedForward), type(module).__name__
        _place(module.experts, EXPERT_PLACEMENTS, device_mesh)
        if module.shared is not None:
            for name, placement in SHARED_PLACEMENTS.items():
                _place(module.shared.get_submodule(name), {"weight": placement}, device_mesh)
        _place(module.router.gate, {"weight": Replicate(), "bias": Replicate()}, device_mesh)
        module.tp_group = device_mesh.get_group()
        module.experts.adds_down_bias = device_mesh.get_local_rank() == 0
        sequence_parallel = self.sequence_parallel

        def gather_input(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            return _whole_input(args, device_mesh)

        def reduce_output(_: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> Any:
            return _reduced_output(out, device_mesh, sequence_parallel)

        module.register_forward_pre_hook(gather_input)
        module.register_forward_hook(reduce_output)
        return module


def _place(module: nn.Module, placements: dict[str, Any], mesh: DeviceMesh) -> None:
    """Replace ``module``'s parameters named in ``placements`` by DTensors laid out so."""
    for name, placement in placements.items():
        param = dict(module.named_parameters(recurse=False)).get(name)
        if param is None:
            continue
        sharded = distribute_tensor(param.data, mesh, [placement])
        module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def _whole_input(args: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    """The layer's input (a sequence shard DTensor or a whole plain tensor) whole on this
    rank, as a plain tensor whose gradient is taken as this rank's partial sum."""
    x, *rest = args
    if isinstance(x, DTensor):
        whole = x.redistribute(placements=[Replicate()])
    else:
        whole = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return (whole.to_local(grad_placements=[Partial()]), *rest)


def _reduced_output(out: torch.Tensor, mesh: DeviceMesh, sequence_parallel: bool) -> Any:
    """This rank's partial output summed over the ranks: the sequence shard as a DTensor
    under sequence parallelism, else the whole output as a plain tensor."""
    partial = DTensor.from_local(out, mesh, [Partial()], run_check=False)
    if sequence_parallel:
        return partial.redistribute(placements=[Shard(1)])
    return partial.redistribute(placements=[Replicate()]).to_local()
