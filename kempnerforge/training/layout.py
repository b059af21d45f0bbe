"""ModelLayout: whether a rank runs every layer of the model (WHOLE_MODEL) or only those of
its pipeline stages (PIPELINE_STAGES, distributed.pp > 1), picked once per job by layout_of.

The build, select_step_fn, in-loop eval and the end-of-run sample ask the layout instead
of testing distributed.pp themselves. The model family (training/families/) is the other
seam; a pipelined job is always a text model (JobConfig.validate refuses the rest).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from kempnerforge.config.distributed import DistributedConfig
from kempnerforge.config.job import JobConfig
from kempnerforge.config.model import ModelConfig
from kempnerforge.config.train import TrainConfig
from kempnerforge.data.pipeline import DataPipeline
from kempnerforge.distributed.pipeline_parallel import (
    PipelineBundle,
    StageModule,
    build_pipeline,
    build_stage_model,
    stage_layer_ranges,
    stages_of_rank,
)
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.evaluation.scoring import TokenLosses, pipeline_losses, whole_model_losses
from kempnerforge.model.heads import HeadLoss, HeadLossSpec, logits_head_loss
from kempnerforge.model.moe import attach_stage_router_hooks
from kempnerforge.training.families import FamilyModel, StepFn, family_of
from kempnerforge.training.loss import LossFn, TokenCrossEntropy
from kempnerforge.training.steps import pipeline_step


@dataclass
class RankModel:
    """This rank's model, and with pipeline parallelism the ids and modules of its stages."""

    model: FamilyModel
    stage_ids: list[int] = field(default_factory=list)
    stage_modules: list[StageModule] = field(default_factory=list)


@dataclass(frozen=True)
class TaskScoring:
    """How this layout scores eval-task windows (evaluation/scoring.py's slot_sums)."""

    token_losses: TokenLosses
    rows_per_forward: int
    whole_forwards: bool
    """Every forward takes exactly rows_per_forward rows (a pipeline's micro-batches)."""
    groups: tuple[Any, ...]
    """The process groups the slot sums are reduced over, in order."""


TaskScorer = Callable[
    [nn.Module, PipelineBundle | None, DataPipeline, TrainConfig, RuntimeContext], TaskScoring
]


def whole_model_scoring(
    model: nn.Module,
    pipeline: PipelineBundle | None,
    data: DataPipeline,
    tc: TrainConfig,
    runtime: RuntimeContext,
) -> TaskScoring:
    """The whole model's forward, train.batch_size rows at a time, with the rows' document
    ids; each rank's slice of a row under context parallelism; sums over dp_cp."""
    del pipeline
    losses = whole_model_losses(model, runtime.device, tc.loss_chunk_tokens, data.batch_slice)
    return TaskScoring(losses, tc.batch_size, False, (runtime.group("dp_cp"),))


def pipeline_scoring(
    model: nn.Module,
    pipeline: PipelineBundle | None,
    data: DataPipeline,
    tc: TrainConfig,
    runtime: RuntimeContext,
) -> TaskScoring:
    """The stages' schedule, forward only, in its micro-batches of train.batch_size rows;
    the last stage's sums go to every stage over pp, then over dp_cp."""
    del model, data
    assert pipeline is not None, "a pipelined job has its schedule"
    rows = pipeline.num_microbatches * tc.batch_size
    groups = (runtime.group("pp"), runtime.group("dp_cp"))
    return TaskScoring(pipeline_losses(pipeline, runtime.device), rows, True, groups)


@dataclass(frozen=True)
class ModelLayout:
    """One way of holding the model along the pipeline axis; two instances."""

    name: str
    build_on_meta: Callable[[JobConfig, RuntimeContext], RankModel]
    """This rank's layers, under the caller's default device (meta), not yet parallelised."""
    build_schedule: Callable[[RankModel, RuntimeContext, JobConfig, LossFn], PipelineBundle | None]
    """The schedule that runs the materialised stages; None for the whole model."""
    step: StepFn | None = None
    """A step body of the layout's own, which wins over the family's (select_step_fn)."""
    forward_refusal: str | None = None
    """Why no rank can run the whole model's forward (in-loop eval, the end-of-run
    sample); None when every rank can."""
    task_scoring: TaskScorer = whole_model_scoring
    """How eval tasks are scored (evaluation/scoring.py)."""


def build_whole_model(config: JobConfig, runtime: RuntimeContext) -> RankModel:
    """The model family's whole model (every rank holds every layer, or its FSDP shard)."""
    del runtime
    return RankModel(family_of(config).build_model(config))


def build_stages(
    model_cfg: ModelConfig, dc: DistributedConfig, runtime: RuntimeContext
) -> RankModel:
    """The layers of the stages this pipeline rank holds (distributed.stages_per_rank),
    split at distributed.pp_split_points or evenly."""
    stage_ids = stages_of_rank(runtime.pp_rank, dc.pp, dc.stages_per_rank, v_shaped=dc.v_shaped)
    ranges = stage_layer_ranges(model_cfg.n_layers, dc.num_stages, dc.pp_split_points)
    model, stages = build_stage_model(model_cfg, stage_ids, ranges)
    return RankModel(model, stage_ids, list(stages))


def build_stage_schedule(
    rank_model: RankModel,
    runtime: RuntimeContext,
    model_cfg: ModelConfig,
    tc: TrainConfig,
    dc: DistributedConfig,
    loss_fn: LossFn,
) -> PipelineBundle:
    """The distributed.pp_schedule over this rank's stages (build_pipeline).

    The built-in loss is computed by the last stage itself with train.loss_chunk_tokens > 0
    (no whole logits, as text_step's model does); with 0 it comes from the whole logits,
    per token, so mixture steps get their per-dataset losses either way. Any other loss
    function gets the logits. An MoE stage's forward records its routers' loads and
    carries their losses into its backward (model/moe/router_stage.py).
    """
    # The gradient norm sums every stage's squares over the pipeline group (total_grad_norm).
    rank_model.model.pipeline_group = runtime.group("pp")
    attach_stage_router_hooks(rank_model.stage_modules, model_cfg, tc.grad_accum_steps)
    spec: HeadLossSpec | None = None
    stage_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | HeadLoss] = loss_fn
    if isinstance(loss_fn, TokenCrossEntropy):
        stage_loss = partial(logits_head_loss, z_loss_weight=tc.z_loss_weight)
        if tc.loss_chunk_tokens > 0:
            spec = HeadLossSpec(tc.loss_chunk_tokens, tc.z_loss_weight)
    return build_pipeline(
        rank_model.stage_modules,
        rank_model.stage_ids,
        runtime,
        dc,
        stage_loss,
        num_microbatches=tc.grad_accum_steps,
        loss_spec=spec,
    )


WHOLE_MODEL = ModelLayout(
    "whole model",
    build_whole_model,
    # The whole model needs no pipeline schedule.
    lambda rank_model, runtime, config, loss_fn: None,
)

PIPELINE_STAGES = ModelLayout(
    "pipeline stages",
    lambda config, runtime: build_stages(config.model, config.distributed, runtime),
    lambda rank_model, runtime, config, loss_fn: build_stage_schedule(
        rank_model, runtime, config.model, config.train, config.distributed, loss_fn
    ),
    step=pipeline_step,
    forward_refusal="pipeline stages (distributed.pp > 1) have no whole-model forward",
    task_scoring=pipeline_scoring,
)


def layout_of(dc: DistributedConfig) -> ModelLayout:
    """The layout of a job with [distributed] ``dc``: pipeline stages when distributed.pp > 1."""
    return PIPELINE_STAGES if dc.pp > 1 else WHOLE_MODEL
