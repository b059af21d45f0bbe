"""Expert parallelism: each MoE layer's routed experts split over the ``ep`` ranks.

The expert weights become DTensors sharded on the expert dimension over the ``ep`` mesh,
so each rank stores and computes E / ep experts, and the layer sends every token copy to
the rank of its expert and back (model/moe/token_exchange.py). Under context parallelism the
``ep`` ranks are taken from dp_shard x cp: a cp rank routes its own slice's tokens.
FSDP then shards the expert weights further over ``efsdp``, the ranks that hold the
same experts; the router, the shared experts and the rest of the block are sharded over
every data-parallel rank as in a dense model. Checkpoints hold the full expert tensors,
so they load in any layout.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.model.moe import MoEFeedForward, moe_layers


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard every MoE layer's expert weights on their expert dimension over ``ep_mesh``.

    Meant for the model still on the meta device (nothing is allocated or sent). FSDP
    averages the expert gradients over the ``efsdp`` ranks only, while every other
    gradient is averaged over all data-parallel (and context-parallel) ranks, ``ep``
    times as many; each expert's gradient already sums the tokens of its ``ep`` peers,
    so the layer scales it by 1 / ep and both end up as the same token mean.
    """
    ep = ep_mesh.size()
    for layer in moe_layers(model):
        experts = layer.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        experts.grad_scale = 1.0 / ep


def expert_fsdp_mesh(runtime: RuntimeContext) -> DeviceMesh | None:
    """The mesh FSDP shards expert weights over under expert parallelism: ``efsdp``, or
    (``dp_replicate``, ``efsdp``) for HSDP; None without expert parallelism."""
    mesh = runtime.expert_mesh
    if mesh is None:
        return None
    if runtime.mesh_size("dp_replicate") > 1:
        return mesh["dp_replicate", "efsdp"]
    return mesh["efsdp"]


def set_router_groups(model: nn.Module, runtime: RuntimeContext) -> None:
    """Give every MoE layer its process groups: ``ep`` for the token exchange (None: this
    rank holds every expert) and the data-parallel ranks, over which the token-level
    balancing loss counts the load."""
    for layer in moe_layers(model):
        assert isinstance(layer, MoEFeedForward)
        layer.ep_group = runtime.group("ep")
        # Context-parallel peers route their own tokens: their loads count like dp ranks'.
        layer.balance_group = runtime.group("dp_cp")
