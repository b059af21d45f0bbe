"""parallelize_model: tensor parallelism, activation checkpointing, compile and FSDP2, in place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint

from kempnerforge.config.distributed import DistributedConfig
from kempnerforge.config.train import TrainConfig
from kempnerforge.core.logging import get_logger
from kempnerforge.distributed.context_parallel import apply_cp
from kempnerforge.distributed.expert_parallel import apply_ep, expert_fsdp_mesh, set_router_groups
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.model.moe import moe_layers

logger = get_logger(__name__)


@dataclass(frozen=True)
class ParallelPlan:
    """What parallelize_model applies besides the mesh: the [distributed] fields it reads
    and the two train fields that change the model, compile and mixed precision."""

    activation_checkpointing: str = "none"
    """'none', 'full' or 'selective' (distributed.activation_checkpointing)."""
    ac_every: int = 2
    """With 'selective', checkpoint the blocks whose index is a multiple of this."""
    reshard_after_forward: bool = True
    """FSDP frees a block's gathered parameters after its forward."""
    compile: bool = False
    """torch.compile each block (train.compile); ignored under tensor parallelism."""
    bf16: bool = False
    """FSDP gathers parameters in bf16 and reduces gradients in fp32 (train.mixed_precision
    resolved for the device); False keeps both in the parameters' dtype."""

    @classmethod
    def of(
        cls, distributed: DistributedConfig, train: TrainConfig, device_type: str
    ) -> ParallelPlan:
        """The plan of a job's [distributed] and [train] sections on a ``device_type``
        ('cuda', 'cpu') device."""
        return cls(
            activation_checkpointing=distributed.activation_checkpointing,
            ac_every=distributed.ac_every,
            reshard_after_forward=distributed.reshard_after_forward,
            compile=train.compile,
            bf16=train.precision_on(device_type) == "bf16",
        )


def parallelize_model(
    model: nn.Module,
    runtime: RuntimeContext,
    plan: ParallelPlan,
    roots: list[nn.Module] | None = None,
) -> None:
    """Apply, in place and in this order: tensor parallel, expert parallel, context
    parallel, activation checkpointing, torch.compile per block, FSDP2.

    Meant for a model still on the meta device: nothing here allocates or reads a weight,
    so the caller then runs ``to_empty(device=...)`` and ``init_weights(seed)``, which fill
    every shard with its slice of the single-process weights. ``roots`` are the modules
    FSDP shards last (default ``[model]``); a pipeline rank passes its stage modules.
    Parameter names never change, so checkpoints read the same in every layout. With
    tensor parallelism ``plan.compile`` is ignored, with a warning: a compiled
    tensor-parallel block fails in backward in this PyTorch version.
    """
    if runtime.tp_size > 1:
        # Pipeline stages pass plain tensors, also on a rank that holds both the embedding
        # and the head (a V-shaped schedule's rank 0): judge by the stages, not the model.
        sequence_parallel = None if roots is None else all(_has_both_ends(r) for r in roots)
        apply_tp(model, runtime.device_mesh["tp"], sequence_parallel=sequence_parallel)
    if runtime.mesh_size("ep") > 1:
        apply_ep(model, runtime.expert_mesh["ep"])
    set_router_groups(model, runtime)
    apply_cp(model, runtime)
    apply_ac(model, plan.activation_checkpointing, plan.ac_every)
    compiled = plan.compile and _compile_allowed(runtime)
    if compiled:
        apply_compile(model)
        if moe_layers(model):
            logger.info(
                "MoE blocks compile in pieces: the routing's host reads and the grouped "
                "expert matmuls run eagerly between compiled graphs"
            )
    if runtime.mesh_size("dp_cp") > 1:
        apply_fsdp(
            model,
            data_parallel_mesh(runtime),
            param_dtype=torch.bfloat16 if plan.bf16 else None,
            reduce_dtype=torch.float32 if plan.bf16 else None,
            reshard_after_forward=plan.reshard_after_forward,
            roots=roots,
            expert_mesh=expert_fsdp_mesh(runtime),
        )
    logger.info(
        "parallelized: tp %d, cp %d, dp %d (replicate %d x shard %d), ep %d, activation "
        "checkpointing %s, compile %s",
        runtime.tp_size,
        runtime.cp_size,
        runtime.dp_size,
        runtime.mesh_size("dp_replicate"),
        runtime.mesh_size("dp_shard"),
        runtime.mesh_size("ep"),
        plan.activation_checkpointing,
        compiled,
    )


def _compile_allowed(runtime: RuntimeContext) -> bool:
    """False, with a warning, where train.compile cannot work: with tensor parallelism."""
    if runtime.tp_size == 1:
        return True
    # TODO(torch): compiled tensor-parallel blocks fail in backward (a DTensor
    # redistribution receives a plain gradient) with both inductor and aot_eager.
    logger.warning(
        "train.compile is ignored with distributed.tp = %d: compiling tensor-parallel "
        "blocks fails in backward in this PyTorch version; the blocks run eagerly",
        runtime.tp_size,
    )
    return False


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


# --- tensor parallelism --------------------------------------------------------------


def apply_tp(
    model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool | None = None
) -> None:
    """Shard every block's projections over ``tp_mesh`` (Megatron layout), in place.

    Attention wq/wk/wv and feed-forward w1/w3 split their output features (column-wise),
    wo and w2 their input features (row-wise), so each block needs one reduction after
    attention and one after the feed-forward. The embedding is split by vocabulary rows
    and the head by vocabulary columns (unevenly when tp does not divide the vocabulary);
    the head's own forward gathers whole logits, while the model's loss from labels is
    vocabulary-parallel (model/vocab_parallel_loss.py). A tied embedding stays one
    parameter.

    With sequence parallelism (default for a whole model) the residual stream between
    blocks is a DTensor split along the sequence: the norms run on their sequence shard,
    and a block gathers the sequence only for the projections. The stream stays a
    DTensor (not its local shard) so any sequence length works, also one tp does not
    divide (a sample's prompt). A pipeline stage that lacks the embedding or the head
    passes plain tensors between stages, so it gets plain TP: replicated activations.
    """
    stages = model_stages(model)
    if sequence_parallel is None:
        sequence_parallel = all(_has_both_ends(stage) for stage in stages)
    block_plan = _sequence_parallel_block_plan() if sequence_parallel else _plain_block_plan()
    for _, block in transformer_blocks(model):
        parallelize_module(block, tp_mesh, block_plan)
    for stage in stages:
        _apply_tp_to_ends(stage, tp_mesh, sequence_parallel)


def _has_both_ends(stage: nn.Module) -> bool:
    return getattr(stage, "tok_embeddings", None) is not None and (
        getattr(stage, "output", None) is not None
    )


class ReplicatedParallel(ParallelStyle):
    """A module whose parameters stay whole on every tensor-parallel rank, as Replicate
    DTensors: plain (replicated) tensors in and out, computed identically on every rank.

    Every parameter must be a DTensor once tensor parallelism is on: the foreach optimizers
    and gradient clipping cannot mix DTensors and plain tensors in one call. The gradient
    of a replicated weight needs no reduction, since every rank computes all of it.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # Typed loosely: torch annotates input_fn as returning None, yet uses its result.
        input_fn: Any = _replicate_inputs
        return distribute_module(module, device_mesh, input_fn=input_fn, output_fn=_local_output)


def _replicate_inputs(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple:
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
        else x
        for x in inputs
    )


def _local_output(module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
    return output.to_local() if isinstance(output, DTensor) else output


def _plain_block_plan() -> dict[str, ParallelStyle]:
    """Projections sharded, activations replicated in and out of each sublayer (the norms
    too, as replicated DTensors).

    Each sublayer turns its input into one Replicate DTensor that its column-wise
    projections share: their input gradients then add up as partial sums, and the
    backward reduces them once per sublayer (2 all-reduces per block). Left to the
    projections, each would wrap the plain input itself and reduce its own gradient
    (5 per block).
    """
    whole = Replicate()
    return {
        "attention_norm": ReplicatedParallel(),
        "ffn_norm": ReplicatedParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(whole, None, None, None),
            desired_input_layouts=(whole, None, None, None),
        ),
        "feed_forward": PrepareModuleInput(input_layouts=(whole,), desired_input_layouts=(whole,)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }


def _sequence_parallel_block_plan() -> dict[str, ParallelStyle]:
    """The plain plan plus sequence-sharded norms and residual stream.

    Attention is called as attention(x, cos, sin, mask): only x is gathered along the
    sequence; the RoPE tables and the mask are already whole on every rank. The row-wise
    projections reduce-scatter back onto the sequence shard and return a DTensor, so the
    residual add sees DTensors on both sides.
    """
    sequence = Shard(1)
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(sequence, None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=sequence, use_local_output=False),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(
            input_layouts=(sequence,), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=sequence, use_local_output=False),
    }


def _apply_tp_to_ends(stage: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Embedding, final norm and head of one stage; the head's forward returns whole logits
    (a plain tensor), for callers that want logits; the loss from labels bypasses it and
    stays on each rank's vocabulary shard (model/vocab_parallel_loss.py).

    The vocabulary is split even when tp does not divide it (DTensor shards unevenly):
    every parameter is then a DTensor, which the foreach optimizers and gradient
    clipping need (they cannot mix DTensors with plain tensors in one call).
    """
    embedding: Any = getattr(stage, "tok_embeddings", None)
    head: Any = getattr(stage, "output", None)
    tied = embedding is not None and head is not None and head.weight is embedding.weight
    styles = {
        "tok_embeddings": _embedding_style(sequence_parallel),
        "norm": SequenceParallel() if sequence_parallel else ReplicatedParallel(),
        "output": _head_style(sequence_parallel),
    }
    plan: dict[str, ParallelStyle] = {
        name: style
        for name, style in styles.items()
        if style is not None and getattr(stage, name, None) is not None
    }
    if plan:
        parallelize_module(stage, tp_mesh, plan)
    if tied and head is not None and embedding is not None:
        # parallelize_module replaced each module's weight with its own DTensor; both are
        # Shard(0) over the vocabulary, so one of them serves both.
        head.weight = embedding.weight


def _embedding_style(sequence_parallel: bool) -> ParallelStyle:
    """Token ids are whole on every rank; the output goes to the residual stream's layout."""
    if sequence_parallel:
        return RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        )
    return RowwiseParallel(input_layouts=Replicate())


def _head_style(sequence_parallel: bool) -> ParallelStyle:
    """Whole logits on every rank from a head split over the vocabulary."""
    input_layout = Shard(1) if sequence_parallel else Replicate()
    return ColwiseParallel(input_layouts=input_layout, output_layouts=Replicate())


# --- activation checkpointing and compile ------------------------------------------------


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


def apply_ac(model: nn.Module, mode: str, every: int) -> None:
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


def apply_compile(model: nn.Module, *, backend: str = "inductor") -> None:
    """Compile each block in place (``Module.compile``), keeping parameter names.

    Per block rather than the whole model: identical blocks reuse one compiled graph, and
    FSDP's per-block hooks stay outside it. ``backend`` exists for tests ('aot_eager').
    """
    for _, block in transformer_blocks(model):
        block.compile(backend=backend)


# --- FSDP2 -------------------------------------------------------------------------------


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    reshard_after_forward: bool,
    roots: list[nn.Module] | None = None,
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
    for unit in extra_units(model):
        fully_shard(unit, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=False)
    own_dtype = own_dtype_units(model)
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


def extra_units(model: nn.Module) -> list[nn.Module]:
    """Modules besides the decoder blocks that are FSDP units of their own, in the
    parameter dtype: a vision-language model's adapter and cross-attention blocks (its
    ``fsdp_units()``); none for a text model."""
    units = getattr(model, "fsdp_units", None)
    return list(units()) if callable(units) else []  # type: ignore[arg-type]


def own_dtype_units(model: nn.Module) -> list[nn.Module]:
    """FSDP units that keep their parameters' own dtype in compute, whatever the mixed
    precision: a vision-language model's encoder layers (its ``own_dtype_fsdp_units()``)."""
    units = getattr(model, "own_dtype_fsdp_units", None)
    return list(units()) if callable(units) else []  # type: ignore[arg-type]


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
