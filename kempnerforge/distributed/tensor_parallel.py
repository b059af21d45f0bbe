"""apply_tp: Megatron-style tensor parallelism of the decoder blocks, embedding and head,
with or without sequence parallelism."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from kempnerforge.distributed.adapter_styles import ColumnSplit, RowSplit
from kempnerforge.distributed.blocks import transformer_blocks
from kempnerforge.distributed.moe_tensor_parallel import MoETensorParallel
from kempnerforge.model.attention import Attention, LatentAttention
from kempnerforge.model.contract import DecoderStack, FamilyModel
from kempnerforge.model.moe import MoEFeedForward
from kempnerforge.model.norm import HeadRMSNorm, ProjectionRMSNorm


def apply_tp(
    model: FamilyModel, tp_mesh: DeviceMesh, *, sequence_parallel: bool | None = None
) -> None:
    """Shard every block's projections over ``tp_mesh`` (Megatron layout), in place.

    Attention wq/wk/wv and feed-forward w1/w3 split their output features (column-wise),
    wo and w2 their input features (row-wise), so each block needs one reduction after
    attention and one after the feed-forward; column-wise biases (model.attention_bias)
    split with their features, the row-wise wo's bias is whole and added once, after
    the reduction. Query and key norms (model.qk_norm) and attention sinks follow the
    heads they belong to (block_plan, shard_sinks). The embedding is split by vocabulary rows
    and the head by vocabulary columns (unevenly when tp does not divide the vocabulary);
    the head's own forward gathers whole logits, while the model's loss from labels is
    vocabulary-parallel (model/heads/vocab_parallel_loss.py). A tied embedding stays one
    parameter.

    With sequence parallelism (default for a whole model) the residual stream between
    blocks is a DTensor split along the sequence: the norms run on their sequence shard,
    and a block gathers the sequence only for the projections. The stream stays a
    DTensor (not its local shard) so any sequence length works, also one tp does not
    divide (a sample's prompt). A pipeline stage that lacks the embedding or the head
    passes plain tensors between stages, so it gets plain TP: replicated activations.
    """
    stages = model.decoder_stacks()
    if sequence_parallel is None:
        sequence_parallel = all(has_both_ends(stage) for stage in stages)
    for _, block in transformer_blocks(model):
        parallelize_module(block, tp_mesh, block_plan(block, sequence_parallel))
        shard_sinks(block, tp_mesh)
        for module in block.modules():
            if isinstance(module, LatentAttention):
                module.head_group = tp_mesh.get_group()
    for stage in stages:
        _apply_tp_to_ends(stage, tp_mesh, sequence_parallel)


def shard_sinks(block: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split a block's attention sinks (model.attention_sinks, one per query head) over
    ``tp_mesh`` as its query heads are: rank r holds the sinks of the heads its share of
    wq projects (Attention.local_sinks reads them)."""
    for module in block.modules():
        if not isinstance(module, Attention):
            continue
        sinks = module.sinks
        if isinstance(sinks, nn.Parameter) and not isinstance(sinks, DTensor):
            sharded = nn.Parameter(distribute_tensor(sinks.data, tp_mesh, [Shard(0)]))
            module.register_parameter("sinks", sharded)


def has_both_ends(stage: DecoderStack) -> bool:
    """Whether ``stage`` holds both the embedding and the head, so its stream may stay a
    sequence-sharded DTensor from end to end."""
    return stage.tok_embeddings is not None and stage.output is not None


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


BLOCK_NORMS = ("attention_norm", "attention_post_norm", "ffn_norm", "ffn_post_norm")
"""A block's own norms on the residual stream, those model.norm_placement gives it."""


def block_plan(block: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The plan of one block: the projections' (plain or sequence-parallel), a style for
    each norm the block has (model.norm_placement decides which exist) and for the query
    and key norms of its attention (model.qk_norm).

    A head-sized norm ('per_head') sees this rank's heads, split along the head axis
    (dim 2 of (batch, seq, heads, head_dim)): its gain stays whole and the gain's gradient
    is summed over the ranks' heads. A norm over the whole projection ('projection') must
    take its mean square over every rank's heads: ProjectionNormParallel splits its gain
    with the projection's columns and lets DTensor reduce the statistic.

    Latent attention (model.mla_kv_rank) gets latent_attention_plan; an MoE feed-forward
    one MoETensorParallel (distributed/moe_tensor_parallel.py) in place of the dense
    projections' styles.
    """
    plan = _sequence_parallel_block_plan() if sequence_parallel else _plain_block_plan()
    children = dict(block.named_children())
    attention, feed_forward = children.get("attention"), children.get("feed_forward")
    if isinstance(attention, LatentAttention):
        for name in ("attention.wq", "attention.wk", "attention.wv"):
            del plan[name]
        plan.update(latent_attention_plan(attention))
    if isinstance(feed_forward, MoEFeedForward):
        for name in ("feed_forward", "feed_forward.w1", "feed_forward.w3", "feed_forward.w2"):
            del plan[name]
        plan["feed_forward"] = MoETensorParallel(sequence_parallel=sequence_parallel)
    norm_style = SequenceParallel() if sequence_parallel else ReplicatedParallel()
    for name, child in block.named_children():
        if name in BLOCK_NORMS and child is not None:
            plan[name] = norm_style
    for name, module in block.named_modules():
        if isinstance(module, HeadRMSNorm):
            plan[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
        elif isinstance(module, ProjectionRMSNorm):
            plan[name] = ProjectionNormParallel()
    return plan


def latent_attention_plan(attention: LatentAttention) -> dict[str, ParallelStyle]:
    """Latent attention's projections but the output one: those into the heads (wq or
    wq_b, wkv_b) split by heads (column-wise), the latent projections (wq_a, wkv_a) and
    their norms whole on every rank (ReplicatedParallel).

    The latents are narrow (model.mla_q_rank, model.mla_kv_rank), so each rank computes
    them whole from the block's gathered input; a projection out of a latent then reduces
    its input gradient over the ranks in backward (one all-reduce of the latent's width),
    as ColwiseParallel does for a plain tensor input. The shared RoPE key part comes out
    of wkv_a, whole on every rank, and LatentAttention reads the head count from the
    projected shapes: its code is the one a rank's share of the heads runs.
    """
    whole = ReplicatedParallel()
    plan: dict[str, ParallelStyle] = {
        "attention.wkv_a": whole,
        "attention.kv_norm": whole,
        "attention.wkv_b": ColumnSplit(),
    }
    if attention.wq is not None:
        plan["attention.wq"] = ColumnSplit()
    else:
        plan["attention.wq_a"] = whole
        plan["attention.q_norm"] = whole
        plan["attention.wq_b"] = ColumnSplit()
    return plan


class ProjectionNormParallel(ParallelStyle):
    """A norm over a column-wise projection's whole output, on that output's shard: the
    gain is split as the projection's columns are, the input is taken as this rank's
    columns of the whole, and the norm (model/norm.py's ProjectionRMSNorm) reduces its
    mean square over the ranks through DTensor. Plain tensors in and out."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        input_fn: Any = _channels_inputs  # typed loosely, as in ReplicatedParallel
        return distribute_module(
            module, device_mesh, _shard_channels, input_fn=input_fn, output_fn=_local_output
        )


def _shard_channels(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for p_name, param in list(module.named_parameters(recurse=False)):
        sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]))
        module.register_parameter(p_name, sharded)


def _channels_inputs(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple:
    return tuple(
        DTensor.from_local(x, mesh, [Shard(x.ndim - 1)], run_check=False)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
        else x
        for x in inputs
    )


def _plain_block_plan() -> dict[str, ParallelStyle]:
    """Projections sharded, activations replicated in and out of each sublayer (the norms
    too, as replicated DTensors: block_plan adds them).

    Each sublayer turns its input into one Replicate DTensor that its column-wise
    projections share: their input gradients then add up as partial sums, and the
    backward reduces them once per sublayer (2 all-reduces per block). Left to the
    projections, each would wrap the plain input itself and reduce its own gradient
    (5 per block).
    """
    whole = Replicate()
    return {
        "attention": PrepareModuleInput(
            input_layouts=(whole, None, None, None),
            desired_input_layouts=(whole, None, None, None),
        ),
        "feed_forward": PrepareModuleInput(input_layouts=(whole,), desired_input_layouts=(whole,)),
        "attention.wq": ColumnSplit(),
        "attention.wk": ColumnSplit(),
        "attention.wv": ColumnSplit(),
        "attention.wo": RowSplit(),
        "feed_forward.w1": ColumnSplit(),
        "feed_forward.w3": ColumnSplit(),
        "feed_forward.w2": RowSplit(),
    }


def _sequence_parallel_block_plan() -> dict[str, ParallelStyle]:
    """The plain plan with the residual stream split along the sequence (the norms on
    their sequence shard: block_plan adds them).

    Attention is called as attention(x, cos, sin, mask): only x is gathered along the
    sequence; the RoPE tables and the mask are already whole on every rank. The row-wise
    projections reduce-scatter back onto the sequence shard and return a DTensor, so the
    residual add sees DTensors on both sides (a post-norm between them runs on the shard).
    """
    sequence = Shard(1)
    return {
        "attention": PrepareModuleInput(
            input_layouts=(sequence, None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
        ),
        "attention.wq": ColumnSplit(),
        "attention.wk": ColumnSplit(),
        "attention.wv": ColumnSplit(),
        "attention.wo": RowSplit(output_layouts=sequence, use_local_output=False),
        "feed_forward": PrepareModuleInput(
            input_layouts=(sequence,), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.w1": ColumnSplit(),
        "feed_forward.w3": ColumnSplit(),
        "feed_forward.w2": RowSplit(output_layouts=sequence, use_local_output=False),
    }


def _apply_tp_to_ends(stage: DecoderStack, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Embedding, final norm and head of one stage; the head's forward returns whole logits
    (a plain tensor), for callers that want logits; the loss from labels bypasses it and
    stays on each rank's vocabulary shard (model/heads/vocab_parallel_loss.py).

    The vocabulary is split even when tp does not divide it (DTensor shards unevenly):
    every parameter is then a DTensor, which the foreach optimizers and gradient
    clipping need (they cannot mix DTensors with plain tensors in one call).
    """
    embedding, head = stage.tok_embeddings, stage.output
    tied = embedding is not None and head is not None and head.weight is embedding.weight
    ends: list[tuple[nn.Module | None, ParallelStyle]] = [
        (embedding, _embedding_style(sequence_parallel)),
        (stage.norm, SequenceParallel() if sequence_parallel else ReplicatedParallel()),
        (head, _head_style(sequence_parallel)),
    ]
    for module, style in ends:
        if module is not None:
            parallelize_module(module, tp_mesh, style)
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
