"""apply_fsdp: FSDP2 sharding of blocks, experts and roots over the data-parallel mesh,
and re-settling FSDP's gradient dtypes after a freeze transition."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from kempnerforge.distributed.blocks import transformer_blocks
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.model.contract import FamilyModel
from kempnerforge.model.moe import moe_layers


def data_parallel_mesh(runtime: RuntimeContext) -> DeviceMesh:
    """The mesh FSDP shards over: ``dp_shard``, or (``dp_replicate``, ``dp_shard``) for
    HSDP, where FSDP replicates across the first dimension and shards across the second.
    Under context parallelism ``dp_shard_cp`` takes the place of ``dp_shard``: cp peers
    hold the same weights, so they shard them and average their gradients too."""
    mesh = runtime.device_mesh
    shard = "dp_shard_cp" if runtime.cp_size > 1 else "dp_shard"
    if runtime.mesh_size("dp_replicate") > 1:
        return mesh["dp_replicate", shard]
    flat = runtime.sub_mesh(shard)
    assert flat is not None, "data_parallel_mesh needs a distributed runtime"
    return flat


def apply_fsdp(
    model: FamilyModel,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    reshard_after_forward: bool,
    roots: Sequence[nn.Module] | None = None,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """Shard parameters over ``dp_mesh`` with FSDP2: each block is one unit, then each root.

    A 2-D mesh (replicate, shard) gives HSDP. A block's parameters are gathered just
    before its forward and backward; the roots' remaining parameters (embedding, final
    norm, head; a tied embedding with its head, as one parameter) form the root units.
    ``reshard_after_forward`` frees a block's gathered parameters after its forward; the
    last block always keeps them, since backward needs them first, and FSDP itself keeps
    a root's. ``param_dtype`` (e.g. bf16) is the compute dtype of the gathered
    parameters, ``reduce_dtype`` that of the gradient reduction; the sharded parameters
    and the optimizer stay in their own dtype. Blocks do not cast their inputs to
    ``param_dtype``: the stream already has it, and the RoPE tables stay fp32 (the roots
    and the other units do cast theirs). Under expert parallelism each MoE layer's
    experts are a unit of their own over ``expert_mesh`` (see expert_parallel.py).
    """
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # A block's floating inputs are the residual stream, already in param_dtype (the
    # embedding and every earlier unit compute in it; a stage root casts what it
    # receives), and the RoPE tables, which must reach attention in fp32 as in one
    # process: so blocks do not cast their inputs.
    block_policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
    )
    blocks = transformer_blocks(model)
    for position, (_, block) in enumerate(blocks):
        keep = position == len(blocks) - 1
        if expert_mesh is not None:
            for layer in moe_layers(block):
                fully_shard(
                    layer.experts,
                    mesh=expert_mesh,
                    mp_policy=policy,
                    reshard_after_forward=reshard_after_forward and not keep,
                )
        fully_shard(
            block,
            mesh=dp_mesh,
            mp_policy=block_policy,
            reshard_after_forward=reshard_after_forward and not keep,
        )
    for unit in model.fsdp_units():
        fully_shard(unit, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=False)
    own_dtype = model.own_dtype_fsdp_units()
    for unit in own_dtype:
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    # A root's float inputs are the pixels of a vision-language model: they go to an
    # encoder that keeps its own dtype, so the root must not round them to param_dtype
    # first (the units inside still cast their own inputs).
    root_policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=not own_dtype
    )
    for root in roots or [model]:
        fully_shard(
            root, mesh=dp_mesh, mp_policy=root_policy, reshard_after_forward=reshard_after_forward
        )


def refresh_sharded_trainable(model: nn.Module) -> None:
    """Tell FSDP which parameters train after requires_grad changed mid-run (a freeze
    schedule's transition).

    FSDP2 settles each unit's gradient dtypes from its trainable parameters once, at the
    first forward; a unit whose parameters were all frozen then has none, and would fail
    to reduce their gradients once they are unfrozen. Settling them again from the
    current requires_grad fixes that; units not yet initialised settle at their first
    forward anyway. A model without FSDP is left alone.
    """
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()  # noqa: SLF001 - no public way to re-settle dtypes
        for group in getattr(state, "_fsdp_param_groups", []):
            if getattr(group, "_reset_sharded_params", False):  # lazily initialised already
                group._init_mp_dtypes()
