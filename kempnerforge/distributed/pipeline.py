"""Pipeline parallelism: which layers each stage holds, the stage modules, and the schedule.

A pipeline rank builds one Transformer that keeps only the layers of its stages (so every
parameter keeps the whole model's name) plus one module per stage that runs that stage's
slice of it; ``build_pipeline`` wraps those in torch.distributed.pipelining stages and a
schedule, and ``PipelineBundle.run`` drives one optimizer step's micro-batches through it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from kempnerforge.config.distributed import DistributedConfig
from kempnerforge.config.model import ModelConfig
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.model.norm import RMSNorm
from kempnerforge.model.transformer import Transformer

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def stage_layer_ranges(
    n_layers: int, num_stages: int, split_points: list[int]
) -> list[tuple[int, int]]:
    """The layers of every pipeline stage, as ``(first, last)`` with ``last`` excluded.

    ``split_points`` are the layers where stages 1, 2, ... begin; empty splits evenly, the
    first ``n_layers % num_stages`` stages taking one layer more. The last stage is never
    among them: it also runs the final norm, the output head and the loss.
    """
    if not 1 <= num_stages <= n_layers:
        raise ValueError(f"{num_stages} pipeline stages need 1 to {n_layers} (n_layers) stages")
    if split_points:
        bounds = [0, *split_points, n_layers]
        if len(split_points) != num_stages - 1 or any(
            b <= a for a, b in zip(bounds, bounds[1:], strict=False)
        ):
            raise ValueError(
                f"split points {split_points} must be {num_stages - 1} increasing layer "
                f"indices in [1, {n_layers - 1}]"
            )
    else:
        base, extra = divmod(n_layers, num_stages)
        bounds = [0]
        for stage in range(num_stages):
            bounds.append(bounds[-1] + base + (1 if stage < extra else 0))
    return list(zip(bounds, bounds[1:], strict=False))


def stages_of_rank(pp_rank: int, pp_size: int, stages_per_rank: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` holds, in loop order: pp_rank, pp_rank + pp_size,
    ... (the stage-to-rank mapping torch's interleaved schedules assume). Stage 0 is always
    on pipeline rank 0 and the last stage on rank pp_size - 1."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pipeline rank {pp_rank} outside [0, {pp_size})")
    return [pp_rank + k * pp_size for k in range(stages_per_rank)]


class _RopeTables:
    """The rank model's RoPE buffers, read when called: to_empty() and init_weights()
    replace and fill them after the stage modules exist. Not a Module, so a stage module
    holding one does not adopt the whole rank model as a child."""

    def __init__(self, model: Transformer) -> None:
        self._model = model

    def __call__(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._model.rope(seq_len)  # under context parallelism, the slice's rows


class StageModule(nn.Module):
    """One pipeline stage of a rank's Transformer: the embedding if it is the first stage,
    its layers in order, and the final norm and output head if it is the last.

    The submodules are the rank model's own (shared, not copied), registered under the
    same names (``layers.3.attention.wq.weight``), so sharding or materializing the rank
    model changes the stages too. A code path that replaces a block object (rather than
    changing it in place) must replace it in both ``model.layers`` and ``stage.layers``.
    """

    def __init__(
        self, model: Transformer, stage_id: int, num_stages: int, layers: tuple[int, int]
    ) -> None:
        super().__init__()
        self.stage_id = stage_id
        """Index of this stage in the whole pipeline."""
        self.tok_embeddings: nn.Embedding | None = model.tok_embeddings if stage_id == 0 else None
        """The token embedding (stage 0 only): token ids in, hidden states out."""
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in range(*layers)})
        """This stage's blocks, keyed by their index in the whole model."""
        is_last = stage_id == num_stages - 1
        self.norm: RMSNorm | None = model.norm if is_last else None
        """Final normalization (last stage only)."""
        self.output: nn.Linear | None = model.output if is_last else None
        """Output head (last stage only): returns logits instead of hidden states."""
        self.rope = _RopeTables(model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, seq) on the first stage, hidden states (batch, seq, dim) on the
        others; returns logits on the last stage and hidden states on the others."""
        cos, sin = self.rope(x.shape[1])
        h = x if self.tok_embeddings is None else self.tok_embeddings(x)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is None or self.output is None:
            return h
        return self.output(self.norm(h))


def build_stage_model(
    model_cfg: ModelConfig, stage_ids: list[int], ranges: list[tuple[int, int]]
) -> tuple[Transformer, list[StageModule]]:
    """This pipeline rank's model and one module per stage it holds.

    The model is built on the current default device (the meta device in the build) and
    keeps exactly the layers of ``stage_ids`` (``ranges`` from stage_layer_ranges, one per
    stage of the whole pipeline), the embedding only with stage 0 and the final norm and
    head only with the last stage; its parameter names are the whole model's. The stage
    modules share its submodules: parallelize, materialize and initialize the rank model
    (init_weights(seed) gives each kept parameter the whole model's value), then pass the
    stage modules to build_pipeline. The rank model's own forward is not a pipeline stage
    and is not meant to be called.
    """
    num_stages = len(ranges)
    kept = {i for stage in stage_ids for i in range(*ranges[stage])}
    model = Transformer(model_cfg)
    for index in list(model.layers):
        if int(index) not in kept:
            del model.layers[index]
    if 0 not in stage_ids:
        model.tok_embeddings = None
    if num_stages - 1 not in stage_ids:
        model.norm = None
        model.output = None
    stages = [StageModule(model, s, num_stages, ranges[s]) for s in stage_ids]
    return model, stages


class _ScaledLoss:
    """The schedule's loss: ``loss_fn(logits, labels) * scale``, keeping each unscaled value.

    The scale is set per step (the step's token normalisation); the unscaled values are
    what the step reports. The first step also calls it once for torch's shape inference,
    so a step's values are the last num_microbatches calls.
    """

    def __init__(self, loss_fn: LossFn) -> None:
        self.loss_fn = loss_fn
        self.scale: torch.Tensor | float | None = None
        self.values: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(logits, labels)
        self.values.append(loss.detach())
        return loss if self.scale is None else loss * self.scale


@dataclass
class PipelineBundle:
    """One rank's pipeline stages and the schedule that drives them.

    ``schedule`` is a torch.distributed.pipelining schedule built over ``stages`` (``stage``
    is the first of them); ``group`` is the pipeline process group. Call ``run`` once per
    optimizer step on every pipeline rank.
    """

    stage: Any
    """The first of ``stages`` (the only one without interleaving)."""
    schedule: Any
    """The torch.distributed.pipelining schedule over ``stages``."""
    pp_rank: int
    """This rank's index in the pipeline group."""
    pp_size: int
    """Ranks in the pipeline group (distributed.pp)."""
    group: Any = None
    """The pipeline process group the stages send activations and gradients over."""
    stages: list[Any] = field(default_factory=list)
    """Every stage this rank holds (several with an interleaved schedule), in stage order."""
    stage_ids: list[int] = field(default_factory=list)
    """The pipeline indices of ``stages``."""
    num_stages: int = 0
    """Stages in the whole pipeline (pp * stages per rank)."""
    num_microbatches: int = 1
    """Micro-batches per step: the whole-step batch is split into this many along dim 0."""
    loss: _ScaledLoss | None = None
    """The schedule's loss function (set by build_pipeline)."""

    @property
    def is_first(self) -> bool:
        """Whether this rank holds stage 0 (takes the token ids)."""
        return 0 in self.stage_ids if self.stage_ids else self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage (takes the labels, computes the loss)."""
        if self.stage_ids:
            return self.num_stages - 1 in self.stage_ids
        return self.pp_rank == self.pp_size - 1

    def run(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        loss_scale: torch.Tensor | float | None = None,
    ) -> list[torch.Tensor]:
        """Forward and backward one step's micro-batches through the pipeline.

        ``inputs`` and ``labels`` are the step's micro-batches concatenated along dim 0
        (num_microbatches * batch_size rows, in micro-batch order); every pipeline rank
        passes them, each stage uses what it needs. Gradients accumulate into the stage
        parameters as ``sum_i loss_fn(logits_i, labels_i) * loss_scale`` would give them
        (no extra division by the micro-batch count). Returns the unscaled per-micro-batch
        losses, detached, on the rank holding the last stage; [] on the others.
        Collective over the pipeline group.
        """
        assert self.loss is not None, "PipelineBundle.run needs build_pipeline's loss"
        self.loss.scale = loss_scale
        self.loss.values.clear()
        # Outputs are not kept: the losses are all the step needs.
        if self.is_first and self.is_last:
            self.schedule.step(inputs, target=labels, return_outputs=False)
        elif self.is_first:
            self.schedule.step(inputs, return_outputs=False)
        elif self.is_last:
            self.schedule.step(target=labels, return_outputs=False)
        else:
            self.schedule.step(return_outputs=False)
        values = self.loss.values[-self.num_microbatches :] if self.is_last else []
        self.loss.values = []
        return values


def build_pipeline(
    stage_modules: Sequence[nn.Module],
    stage_ids: list[int],
    runtime: RuntimeContext,
    distributed: DistributedConfig,
    loss_fn: LossFn,
    *,
    num_microbatches: int,
) -> PipelineBundle:
    """Wrap this rank's stage modules in pipeline stages and build the configured schedule.

    The modules must be materialized and initialized (and, with FSDP, each a
    ``fully_shard`` root: the stage then runs the data-parallel gradient reduction once,
    after the step's last backward). The schedule is ``distributed.pp_schedule`` over
    ``num_microbatches`` micro-batches (the trainer's train.grad_accum_steps) with
    ``scale_grads=False``: ``loss_fn`` (summed loss of one micro-batch, as build_loss_fn
    gives) is scaled by ``run``'s loss_scale.
    """
    num_stages = distributed.num_stages
    group = runtime.group("pp")
    # Typed loosely: the schedules take a list of torch's private stage base class.
    stages: list[Any] = [
        PipelineStage(module, stage_id, num_stages, runtime.device, group=group)
        for module, stage_id in zip(stage_modules, stage_ids, strict=True)
    ]
    loss = _ScaledLoss(loss_fn)
    if distributed.pp_schedule == "interleaved_1f1b":
        schedule = ScheduleInterleaved1F1B(
            stages, num_microbatches, loss_fn=loss, scale_grads=False
        )
    else:
        single = ScheduleGPipe if distributed.pp_schedule == "gpipe" else Schedule1F1B
        if len(stages) != 1:
            raise ValueError(f"pp_schedule {distributed.pp_schedule!r} runs one stage per rank")
        schedule = single(stages[0], num_microbatches, loss_fn=loss, scale_grads=False)
    return PipelineBundle(
        stage=stages[0],
        schedule=schedule,
        pp_rank=runtime.pp_rank,
        pp_size=runtime.pp_size,
        group=group,
        stages=stages,
        stage_ids=list(stage_ids),
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        loss=loss,
    )
