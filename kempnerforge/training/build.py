"""The build phase: config + runtime -> a TrainingSession."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random

import numpy as np
import torch

from kempnerforge.checkpoint.manager import CheckpointManager
from kempnerforge.config.job import JobConfig
from kempnerforge.config.loader import dump_config
from kempnerforge.core.logging import get_logger
from kempnerforge.data.pipeline import DataPipeline, build_data_pipeline, build_image_text_pipeline
from kempnerforge.distributed.parallelize import ParallelPlan, parallelize_model
from kempnerforge.distributed.pipeline import (
    PipelineBundle,
    build_pipeline,
    build_stage_model,
    stage_layer_ranges,
    stages_of_rank,
)
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.metrics.backends import build_backends
from kempnerforge.metrics.mfu import peak_flops_per_sec
from kempnerforge.metrics.tracker import MetricsTracker
from kempnerforge.model import build_model
from kempnerforge.model.transformer import Transformer
from kempnerforge.model.transformer import flops_per_token as model_flops_per_token
from kempnerforge.model.vlm import VisionLanguageModel, build_vlm
from kempnerforge.optim.optimizer import build_optimizer
from kempnerforge.optim.scheduler import build_scheduler
from kempnerforge.resilience.nan import NaNDetector
from kempnerforge.resilience.shutdown import ShutdownHandler
from kempnerforge.training.freeze import describe, freeze_for_step
from kempnerforge.training.grad import PIPELINE_GROUP_ATTR
from kempnerforge.training.hooks import HookRunner, load_hooks
from kempnerforge.training.loop import TrainingSession, select_step_fn
from kempnerforge.training.loss import LossFn, build_loss_fn
from kempnerforge.training.phases import PhaseState, TrainingPhase
from kempnerforge.training.preflight import check_model_fits
from kempnerforge.training.profiling import build_profiler

logger = get_logger(__name__)


def seed_everything(seed: int, deterministic: bool) -> None:
    """Seed python, numpy and torch; optionally force deterministic kernels."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; harmless on CPU.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def config_sha256(config: JobConfig) -> str:
    return hashlib.sha256(dump_config(config).encode()).hexdigest()


def build_checkpointer(config: JobConfig, runtime: RuntimeContext) -> CheckpointManager:
    """The run's CheckpointManager: its agreements on the default group, its background
    writes on the runtime's side group; it creates no process group."""
    return CheckpointManager(
        config.checkpoint,
        config.checkpoint_dir,
        rank=runtime.rank,
        world_size=runtime.world_size,
        side_group=runtime.side_group,
        config_sha256=config_sha256(config),
    )


def build_sharded_on_meta(
    config: JobConfig, runtime: RuntimeContext
) -> tuple[Transformer | VisionLanguageModel, list[int], list[torch.nn.Module]]:
    """This rank's model on the meta device, parallelised: its shards' shapes, no memory.

    Returns the model, and with pipeline parallelism the ids and modules of this rank's
    stages (empty lists otherwise). A pipeline rank keeps only the layers of its stages.
    """
    dc = config.distributed
    stage_ids: list[int] = []
    stage_modules: list[torch.nn.Module] = []
    model: Transformer | VisionLanguageModel
    with torch.device("meta"):
        if dc.pp > 1:
            stage_ids = stages_of_rank(runtime.pp_rank, dc.pp, dc.stages_per_rank)
            ranges = stage_layer_ranges(config.model.n_layers, dc.num_stages, dc.pp_split_points)
            model, stages = build_stage_model(config.model, stage_ids, ranges)
            stage_modules.extend(stages)
        elif config.is_vlm:
            model = build_vlm(
                config.model,
                config.vision_encoder,
                config.adapter,
                config.vlm,
                config.vision_spec(),
            )
        else:
            model = build_model(config.model)
    plan = ParallelPlan.of(config.distributed, config.train, runtime.device.type)
    parallelize_model(model, runtime, plan, roots=stage_modules or None)
    return model, stage_ids, stage_modules


def build_model_on_mesh(
    config: JobConfig, runtime: RuntimeContext, loss_fn: LossFn
) -> tuple[torch.nn.Module, PipelineBundle | None]:
    """This rank's model, parallelised and initialised, and its pipeline (None without PP).

    The model is built on the meta device and parallelised there (tensor parallel,
    activation checkpointing, compile, FSDP: build_sharded_on_meta), and only then
    materialised on this rank's device, so no rank ever holds more than its shard.
    Weights are drawn per parameter from the seed (Transformer.init_weights), identical in
    every layout. A vision-language model (a [vlm] job) is built the same way, its
    pretrained tower read from its directory by init_weights, and starts in the freeze
    state of step 0 (vlm.freeze).
    """
    model, stage_ids, stage_modules = build_sharded_on_meta(config, runtime)
    model.to_empty(device=runtime.device)
    torch.manual_seed(config.train.seed)  # the weights depend on the seed, not on what ran before
    model.init_weights()
    frozen = freeze_for_step(model, config, 0)
    if frozen:
        logger.info("freeze state at step 0 (vlm.freeze): %s", describe(frozen))
    if config.distributed.pp == 1:
        return model, None
    setattr(model, PIPELINE_GROUP_ATTR, runtime.group("pp"))
    return model, build_pipeline(
        stage_modules,
        stage_ids,
        runtime,
        config.distributed,
        loss_fn,
        num_microbatches=config.train.grad_accum_steps,
    )


def build_job_data(
    config: JobConfig, runtime: RuntimeContext, *, with_train: bool = True
) -> DataPipeline:
    """This rank's data: image-text pairs for a [vlm] job, token windows otherwise."""
    tc = config.train
    if config.is_vlm:
        assert config.vlm is not None
        return build_image_text_pipeline(
            config.data,
            config.vlm,
            config.vision_spec(),
            batch_size=tc.batch_size,
            seed=tc.seed,
            dp_rank=runtime.dp_rank,
            dp_size=runtime.dp_size,
            model_vocab_size=config.model.vocab_size,
            with_train=with_train,
        )
    return build_data_pipeline(
        config.data,
        seq_len=tc.seq_len,
        batch_size=tc.batch_size,
        seed=tc.seed,
        dp_rank=runtime.dp_rank,
        dp_size=runtime.dp_size,
        model_vocab_size=config.model.vocab_size,
        with_train=with_train,
        eval_sets=config.eval.sets,
    )


def build_session(
    config: JobConfig,
    runtime: RuntimeContext,
    *,
    checkpointer: CheckpointManager | None = None,
    shutdown_handler: ShutdownHandler | None = None,
) -> TrainingSession:
    """Everything the loop needs, built in dependency order from a validated config.

    Writes nothing into the run directory but metrics.jsonl (the tracker opens it) and the
    files of the metrics.backends; the CLI records config.toml once the build has
    succeeded. ``checkpointer`` and
    ``shutdown_handler`` are the CLI's when it made them before the build (to plan the
    resume, and to catch a stop signal during the build); fresh ones otherwise.
    """
    tc = config.train
    if tc.num_threads:
        torch.set_num_threads(tc.num_threads)
    shards = runtime.mesh_size("dp_shard") * runtime.tp_size * runtime.pp_size
    check_model_fits(config.model, runtime.device, shards)  # before the slow data preparation
    seed_everything(tc.seed, tc.deterministic)
    data = build_job_data(config, runtime)
    loss_fn = build_loss_fn(tc)
    model, pipeline = build_model_on_mesh(config, runtime, loss_fn)
    if isinstance(model, VisionLanguageModel):
        assert config.vlm is not None
        flops_per_token = model.flops_per_text_token(config.vlm.max_text_len)
        logger.info(
            "vision-language model (%s): %s; FLOPs per text token approximate "
            "(VisionLanguageModel.flops_per_text_token)",
            config.vlm.arch,
            ", ".join(f"{group} {n / 1e6:.2f}M" for group, n in model.group_sizes().items()),
        )
    else:
        flops_per_token = model_flops_per_token(config.model, tc.seq_len)
    if runtime.device.type == "cpu":
        logger.info(
            "CPU threads: %d for torch's kernels (train.num_threads), %d dataloader workers "
            "(data.num_workers, one thread each)",
            torch.get_num_threads(),
            config.data.num_workers,
        )
    is_vlm = isinstance(model, VisionLanguageModel)
    logger.info(
        "model: %.2fM parameters, %.3g FLOPs/%stoken",
        (model.num_params() if is_vlm else config.model.num_params()) / 1e6,
        flops_per_token,
        "text " if is_vlm else "",
    )
    optimizer = build_optimizer(model, config.optimizer)  # after sharding: it sees DTensors
    scheduler = build_scheduler(optimizer, config.scheduler, tc.max_steps)
    peak = peak_flops_per_sec(runtime.device, tc.precision_on(runtime.device.type))
    tracker = MetricsTracker(
        config.metrics,
        config.run_dir,
        max_steps=tc.max_steps,
        rank=runtime.rank,
        flops_per_token=flops_per_token,
        # Tokens are counted over all ranks, so the peak must cover all their devices.
        peak_flops_per_sec=peak * runtime.world_size if peak else None,
        device=runtime.device,
        num_devices=runtime.world_size,
        backends=build_backends(
            config.metrics, config.run_dir, name=tc.name, config=dataclasses.asdict(config)
        )
        if runtime.rank == 0
        else None,
    )
    return TrainingSession(
        config=config,
        runtime=runtime,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        loss_fn=loss_fn,
        step_fn=select_step_fn(config),
        data=data,
        phases=PhaseState(
            [TrainingPhase(p.start_step, dict(p.dataset_weights), p.lr_scale) for p in tc.phases],
            freeze_stages=config.vlm.freeze_schedule if config.vlm is not None else None,
        ),
        checkpointer=checkpointer or build_checkpointer(config, runtime),
        tracker=tracker,
        hooks=HookRunner(load_hooks(tc.hooks)),
        nan_detector=NaNDetector(tc.nan_consecutive_max),
        shutdown_handler=shutdown_handler or ShutdownHandler(),
        pipeline=pipeline,
        profiler=build_profiler(config.profiling, config.run_dir, first_step=0, rank=runtime.rank),
    )
