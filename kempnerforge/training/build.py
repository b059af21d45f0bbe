"""The build phase: config + runtime -> a TrainingSession."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import random
import tempfile

import numpy as np
import torch

from kempnerforge.checkpoint.manager import CheckpointManager
from kempnerforge.checkpoint.memory_peer import build_peer_link, ranks_per_node
from kempnerforge.checkpoint.memory_tier import MemoryTier, run_key
from kempnerforge.config.checkpoint import CheckpointConfig
from kempnerforge.config.context_parallel import cp_ring
from kempnerforge.config.data import DataConfig
from kempnerforge.config.eval import EvalConfig
from kempnerforge.config.grpo import GRPOConfig
from kempnerforge.config.job import JobConfig
from kempnerforge.config.loader import dump_config
from kempnerforge.config.train import TrainConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.core.logging import get_logger
from kempnerforge.data.bad_windows import read_bad_data
from kempnerforge.data.chat import end_of_turn_ids, load_chat_template
from kempnerforge.data.dataloader import build_train_loader
from kempnerforge.data.dataset import MemoryMappedDataset
from kempnerforge.data.pipeline import DataPipeline
from kempnerforge.data.pipeline_build import is_prompts
from kempnerforge.distributed.fsdp import refresh_sharded_trainable
from kempnerforge.distributed.parallelize import ParallelPlan, parallelize_model
from kempnerforge.distributed.pipeline_parallel import PipelineBundle
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.metrics.backends import build_backends
from kempnerforge.metrics.mfu import peak_flops_per_sec
from kempnerforge.metrics.profiling import build_profiler
from kempnerforge.metrics.tracker import MetricsTracker
from kempnerforge.model.lora import add_adapters, freeze_base
from kempnerforge.model.meta import on_meta
from kempnerforge.optim.optimizer import build_optimizer
from kempnerforge.optim.scheduler import build_scheduler
from kempnerforge.resilience.nan import NaNDetector
from kempnerforge.resilience.shutdown import ShutdownHandler
from kempnerforge.resilience.spikes import LossSpikeRule
from kempnerforge.training.eval import load_job_tasks
from kempnerforge.training.families import ModelSummary, family_of
from kempnerforge.training.float8 import apply_float8
from kempnerforge.training.forward import training_autocast
from kempnerforge.training.freeze import FreezeSchedule, describe, freeze_for_step
from kempnerforge.training.hooks import HookRunner, load_hooks
from kempnerforge.training.layout import ModelLayout, RankModel, layout_of
from kempnerforge.training.loop import TrainingSession, select_step_fn
from kempnerforge.training.loss import LossFn, build_loss_fn
from kempnerforge.training.objectives import (
    OLD_LOGPS,
    Decoding,
    Rollouts,
    freeze_reference,
    load_reference_weights,
    load_reward,
    objective_of,
    preference_reference,
)
from kempnerforge.training.phases import PhaseState, TrainingPhase
from kempnerforge.training.preflight import check_model_fits
from kempnerforge.training.session import BatchStream

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


def build_checkpointer(
    config: JobConfig,
    runtime: RuntimeContext,
    kind: type[CheckpointManager] = CheckpointManager,
) -> CheckpointManager:
    """The run's checkpoint manager, of class ``kind``: its agreements on the default
    group, its background writes on the runtime's side group; it creates no process group.
    Replica groups pass theirs (replicas.groups.checkpointer_kind), which lets one group
    write each of the job's checkpoints."""
    return kind(
        config.checkpoint,
        config.checkpoint_dir,
        rank=runtime.rank,
        world_size=runtime.world_size,
        side_group=runtime.side_group,
        config_sha256=config_sha256(config),
        staging_dir=config.checkpoint.staging_dir
        or os.path.join(config.job_dir, "checkpoint_staging"),
    )


def build_rank_on_meta(config: JobConfig, runtime: RuntimeContext) -> RankModel:
    """This rank's model on the meta device, parallelised: its shards' shapes, no memory.

    With pipeline parallelism the RankModel also holds the ids and modules of this rank's
    stages: a pipeline rank keeps only the layers of its stages (the job's ModelLayout
    decides).
    """
    with on_meta():
        rank_model = layout_of(config.distributed).build_on_meta(config, runtime)
        add_adapters(rank_model.model, config.lora)  # before parallelisation shards them
    if config.train.float8:
        # Before parallelize_model: checkpointing, compile and FSDP wrap the FP8 modules.
        apply_float8(rank_model.model, runtime.device, compiled=config.train.compile)
    roots = rank_model.stage_modules or None
    plan = ParallelPlan.of(config.distributed, config.train, runtime.device.type)
    parallelize_model(rank_model.model, runtime, plan, roots=roots)
    return rank_model


def build_model_on_mesh(
    config: JobConfig, runtime: RuntimeContext, loss_fn: LossFn
) -> tuple[torch.nn.Module, PipelineBundle | None]:
    """This rank's model, parallelised and initialised, and its pipeline (None without PP).

    The model is built on the meta device and parallelised there (tensor parallel,
    activation checkpointing, compile, FSDP: build_rank_on_meta), and only then
    materialised on this rank's device, so no rank ever holds more than its shard.
    Weights are drawn per parameter from the seed (Transformer.init_weights), identical in
    every layout. A vision-language model (a [vlm] job) is built the same way, its
    pretrained tower read from its directory by init_weights, and starts in the freeze
    state of step 0 (vlm.freeze).
    """
    rank_model = build_rank_on_meta(config, runtime)
    model = rank_model.model
    model.to_empty(device=runtime.device)
    torch.manual_seed(config.train.seed)  # the weights depend on the seed, not on what ran before
    model.init_weights()
    frozen = freeze_for_step(model, family_of(config).freeze_schedule(config), 0)
    if config.lora.enabled:  # after materialising: parallelising re-creates parameters
        trainable, frozen_base = freeze_base(model)
        refresh_sharded_trainable(model)
        logger.info(
            "lora: rank %d on %s: %s trainable parameters, %s frozen (this rank)",
            config.lora.rank,
            ", ".join(config.lora.projections),
            f"{trainable:,}",
            f"{frozen_base:,}",
        )
    if frozen:
        logger.info("freeze state at step 0 (vlm.freeze): %s", describe(frozen))
    return model, layout_of(config.distributed).build_schedule(rank_model, runtime, config, loss_fn)


def _log_model(summary: ModelSummary) -> None:
    groups = ", ".join(f"{group} {n / 1e6:.2f}M" for group, n in summary.groups.items())
    logger.info(
        "model: %.2fM parameters%s, %.3g FLOPs/%s",
        summary.num_params / 1e6,
        f" ({groups})" if groups else "",
        summary.flops_per_token,
        summary.token,
    )


def _warn_what_the_layout_skips(layout: ModelLayout, ec: EvalConfig, tc: TrainConfig) -> None:
    """Say once, at the build, that in-loop eval and the end-of-run sample cannot run in
    this layout, when they are on."""
    reason = layout.forward_refusal
    skipped = []
    if ec.enabled:
        skipped.append(f"in-loop eval (eval.interval = {ec.interval})")
    if tc.sample_tokens:
        skipped.append(f"the end-of-run sample (train.sample_tokens = {tc.sample_tokens})")
    if reason is not None and skipped:
        logger.warning(
            "skipping %s: %s; evaluate or sample a checkpoint with `kempnerforge eval` or "
            "`kempnerforge generate`",
            " and ".join(skipped),
            reason,
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
    succeeded. ``checkpointer`` and ``shutdown_handler`` are the CLI's when it made them
    before the build (to plan the resume, and to catch a stop signal during the build);
    fresh ones otherwise.
    """
    tc = config.train
    # Our own invariant: the runtime's ring is the one the job's heads resolve to.
    assert runtime.cp_ring == cp_ring(config), "init_runtime(..., cp_ring(config)) for this job"
    if tc.num_threads:
        torch.set_num_threads(tc.num_threads)
    shards = runtime.mesh_size("dp_shard_cp") * runtime.tp_size * runtime.pp_size
    check_model_fits(config.model, runtime.device, shards)  # before the slow data preparation
    seed_everything(tc.seed, tc.deterministic)
    data = family_of(config).build_data(config, runtime, True)
    data.eval_tasks = load_job_tasks(config, data)
    loss_fn = build_loss_fn(tc)
    model, pipeline = build_model_on_mesh(config, runtime, loss_fn)
    summary = family_of(config).summarize(config, model)
    _log_model(summary)
    _warn_what_the_layout_skips(layout_of(config.distributed), config.eval, tc)
    _log_cpu_threads(config.data.num_workers, runtime.device)
    optimizer = build_optimizer(model, config.optimizer)  # after sharding: it sees DTensors
    scheduler = build_scheduler(optimizer, config.scheduler, tc.max_steps)
    tracker = build_tracker(config, runtime, summary)
    if checkpointer is None:
        # Replica groups' checkpointer lives in their wing, which the train command builds.
        assert not config.fault_tolerance.enabled, "pass replicas' checkpointer_kind manager"
        checkpointer = build_checkpointer(config, runtime)
    # Data traced to a fault in an earlier launch of this run stays skipped (bad_windows.py).
    data.add_bad_windows(read_bad_data(checkpointer.directory))
    session = TrainingSession(
        config=config,
        runtime=runtime,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        loss_fn=loss_fn,
        step_fn=select_step_fn(config),
        data=data,
        phases=build_phases(tc, family_of(config).freeze_schedule(config)),
        checkpointer=checkpointer,
        tracker=tracker,
        hooks=HookRunner(load_hooks(tc.hooks)),
        nan_detector=build_nan_detector(tc),
        shutdown_handler=shutdown_handler or ShutdownHandler(),
        pipeline=pipeline,
        profiler=build_profiler(config.profiling, config.run_dir, first_step=0, rank=runtime.rank),
    )

    def frozen_reference() -> torch.nn.Module:
        """The objective's reference: built as the policy, its weights loaded, frozen."""
        reference = build_model_on_mesh(config, runtime, loss_fn)[0]
        load_reference_weights(reference, checkpointer, config.checkpoint)
        return freeze_reference(reference)

    if tc.loss_fn == "dpo":  # a preference objective: pairs, and a reference or none
        autocast = functools.partial(training_autocast, tc, runtime.device)
        add_logps = preference_reference(
            data, config.dpo, tc, config.model, config.data.path, runtime, frozen_reference,
            checkpointer, config.checkpoint.resume_from, autocast,
        )  # fmt: skip
        session.use_batches(BatchStream(data, add_keys=add_logps))
    if (tier := build_memory_tier(config.checkpoint, config.checkpoint_dir, runtime)) is not None:
        session.use_memory_tier(tier)
    if OLD_LOGPS in objective_of(config).batch_keys:
        reference = frozen_reference() if config.grpo.kl_beta > 0 else None
        rollouts = build_rollouts(tc, config.grpo, config.data, runtime, data, model, reference)
        session.use_batches(BatchStream(data, source=rollouts))
    return session


def build_nan_detector(tc: TrainConfig) -> NaNDetector:
    """The run's NaNDetector: train.nan_consecutive_max and the loss-spike rule."""
    return NaNDetector(
        tc.nan_consecutive_max,
        LossSpikeRule(tc.spike_window, tc.spike_sigmas, tc.spike_min_history),
    )


def build_memory_tier(
    cfg: CheckpointConfig, checkpoint_dir: str, runtime: RuntimeContext
) -> MemoryTier | None:
    """This rank's memory tier (None with checkpoint.memory_interval = 0): under
    checkpoint.memory_dir (/dev/shm/kempnerforge by default, the temporary directory
    without /dev/shm), in the run's own folder."""
    if not cfg.memory_interval:
        return None
    base = cfg.memory_dir or (
        "/dev/shm/kempnerforge"
        if os.path.isdir("/dev/shm")
        else os.path.join(tempfile.gettempdir(), "kempnerforge-memory")
    )
    root = os.path.join(base, run_key(checkpoint_dir, runtime.world_size))
    world = runtime.world_size
    link = build_peer_link(runtime.rank, world, ranks_per_node(world)) if cfg.memory_peer else None
    return MemoryTier(root, runtime.rank, peer=link)


def build_rollouts(
    train: TrainConfig,
    grpo: GRPOConfig,
    data_cfg: DataConfig,
    runtime: RuntimeContext,
    data: DataPipeline,
    model: torch.nn.Module,
    reference: torch.nn.Module | None,
) -> Rollouts:
    """GRPO's batch source (training/objectives/rollouts.py): the reward, the prompt
    corpus's loader resized to one rollout's prompts per rank, and the decoding settings
    (stops at the chat template's end of turn and EOS). The policy samples with the
    session's own ``model``; ``reference`` is the frozen one of grpo.kl_beta > 0."""
    reward = load_reward(grpo.reward, grpo.reward_pattern)  # a bad name fails first
    _check_prompts(data, data_cfg.path)
    rows = train.batch_size * train.grad_accum_steps
    prompts = rows // grpo.group_size
    assert isinstance(data.dataset, MemoryMappedDataset) and data.sampler is not None
    if data.sampler.samples_per_rank < prompts:
        raise ConfigError(
            "train.batch_size",
            train.batch_size,
            f"a rollout of {prompts} prompts per rank within the "
            f"{data.sampler.samples_per_rank} prompts each rank reads of {data_cfg.path}",
            "prepare more prompts, or lower train.batch_size or train.grad_accum_steps",
        )
    data.dataloader = build_train_loader(
        data.dataset, data.sampler, prompts, data_cfg.num_workers, train.seed
    )
    tokenizer = data.tokenizer
    stops = end_of_turn_ids(tokenizer, load_chat_template(data_cfg.tokenizer))
    decoding = Decoding(
        max_new_tokens=grpo.max_new_tokens,
        temperature=grpo.temperature,
        top_k=grpo.top_k,
        top_p=grpo.top_p,
        stop_ids=frozenset({*stops, tokenizer.eos_id}),
        pad_id=tokenizer.pad_id,
        width=train.seq_len,
        rows_per_forward=train.batch_size,
        length_multiple=runtime.tp_size,
    )
    return Rollouts(
        model=model,
        reference=reference,
        cfg=grpo,
        reward=reward,
        tokenizer=tokenizer,
        decoding=decoding,
        seed=train.seed,
        layout=(data.dp_rank, data.dp_size, rows),
        device=runtime.device,
        group=runtime.group("world"),
        autocast=functools.partial(training_autocast, train, runtime.device),
    )


def _check_prompts(data: DataPipeline, path: str) -> None:
    """GRPO samples completions of prepared prompts: refuse training data that is not a
    prompt corpus, before anything is built for it."""
    if not is_prompts(getattr(data.dataset, "meta", None) or {}):
        raise ConfigError(
            "data.path",
            path,
            "a prompt corpus with train.loss_fn = 'grpo'",
            "prepare prompts and answers with `kempnerforge prepare-data --format prompts "
            "--seq-len N` and set data.path to its directory (data.datasets mixtures are not "
            "read as prompts)",
        )


def build_tracker(
    config: JobConfig, runtime: RuntimeContext, summary: ModelSummary
) -> MetricsTracker:
    """The run's MetricsTracker: MFU from the family's FLOPs per token against every
    device's peak, and the metrics backends on rank 0 only."""
    tc = config.train
    peak = peak_flops_per_sec(runtime.device, tc.precision_on(runtime.device.type))
    return MetricsTracker(
        config.metrics,
        config.run_dir,
        max_steps=tc.max_steps,
        rank=runtime.rank,
        flops_per_token=summary.flops_per_token,
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


def build_phases(tc: TrainConfig, freeze: FreezeSchedule) -> PhaseState:
    """The step-keyed schedules: [[train.phases]] and the family's freeze stages."""
    phases = [TrainingPhase(p.start_step, dict(p.dataset_weights), p.lr_scale) for p in tc.phases]
    return PhaseState(phases, freeze_stages=list(freeze.stages))


def _log_cpu_threads(num_workers: int, device: torch.device) -> None:
    if device.type == "cpu":
        logger.info(
            "CPU threads: %d for torch's kernels (train.num_threads), %d dataloader workers "
            "(data.num_workers, one thread each)",
            torch.get_num_threads(),
            num_workers,
        )
