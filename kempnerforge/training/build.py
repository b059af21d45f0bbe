"""The build phase: config + runtime -> a TrainingSession, and resuming it from a checkpoint."""

from __future__ import annotations

import hashlib
import os
import random
from typing import Any

import numpy as np
import torch

from kempnerforge.checkpoint.manager import CheckpointManager
from kempnerforge.config.job import JobConfig
from kempnerforge.config.loader import dump_config, save_config
from kempnerforge.config.profiling import ProfilingConfig
from kempnerforge.data.phases import PhaseState, TrainingPhase
from kempnerforge.data.pipeline import build_data_pipeline
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.metrics.logging import get_logger
from kempnerforge.metrics.mfu import peak_flops_per_sec
from kempnerforge.metrics.tracker import MetricsTracker
from kempnerforge.model import build_model
from kempnerforge.resilience.nan import NaNDetector
from kempnerforge.resilience.shutdown import ShutdownHandler
from kempnerforge.training.hooks import HookRunner, load_hooks
from kempnerforge.training.loop import TrainingSession, select_step_fn
from kempnerforge.training.loss import build_loss_fn
from kempnerforge.training.optimizer import build_optimizer, set_optimizer_mode
from kempnerforge.training.scheduler import build_scheduler
from kempnerforge.training.state import check_resume_compatible, restore_train_state

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


def build_profiler(cfg: ProfilingConfig, run_dir: str, first_step: int) -> Any | None:
    """A torch.profiler over optimizer steps start_step..end_step, or None.

    The loop calls profiler.step() after each optimizer step, counting from first_step
    (the step the loop starts at), so the window is shifted for a resumed run.
    """
    if not cfg.enable or cfg.end_step <= first_step:
        return None
    wait = max(cfg.start_step - 1 - first_step, 0)
    active = cfg.end_step - max(cfg.start_step - 1, first_step)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    trace_dir = cfg.trace_dir or os.path.join(run_dir, "profiler")
    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=wait, warmup=0, active=active, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(trace_dir),
        record_shapes=True,
        with_flops=True,
    )


def build_session(config: JobConfig, runtime: RuntimeContext) -> TrainingSession:
    """Everything the loop needs, built in dependency order from a validated config."""
    tc = config.train
    if tc.num_threads:
        torch.set_num_threads(tc.num_threads)
    seed_everything(tc.seed, tc.deterministic)
    run_dir = config.run_dir
    if runtime.is_main:
        os.makedirs(run_dir, exist_ok=True)
        save_config(config, os.path.join(run_dir, "config.toml"))
    data = build_data_pipeline(
        config.data,
        seq_len=tc.seq_len,
        batch_size=tc.batch_size,
        seed=tc.seed,
        dp_rank=runtime.dp_rank,
        dp_size=runtime.dp_size,
        model_vocab_size=config.model.vocab_size,
        eval_sets=config.eval.sets,
    )
    # Seed again right before init so the weights don't depend on what data setup drew.
    torch.manual_seed(tc.seed)
    model: torch.nn.Module = build_model(config.model).to(runtime.device)
    flops_per_token = model.flops_per_token(tc.seq_len)
    logger.info(
        "model: %.2fM parameters, %.3g FLOPs/token", model.num_params() / 1e6, flops_per_token
    )
    optimizer = build_optimizer(model, config.optimizer)
    if tc.compile:
        # In place, so parameter names (and so checkpoints) are the same compiled or not.
        model.compile()
    scheduler = build_scheduler(optimizer, config.scheduler, tc.max_steps)
    peak = peak_flops_per_sec(runtime.device)
    tracker = MetricsTracker(
        config.metrics,
        run_dir,
        max_steps=tc.max_steps,
        rank=runtime.rank,
        flops_per_token=flops_per_token,
        # Tokens are counted over all ranks, so the peak must cover all their devices.
        peak_flops_per_sec=peak * runtime.world_size if peak else None,
    )
    return TrainingSession(
        config=config,
        runtime=runtime,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        loss_fn=build_loss_fn(tc),
        step_fn=select_step_fn(config),
        data=data,
        phases=PhaseState(
            [TrainingPhase(p.start_step, dict(p.dataset_weights), p.lr_scale) for p in tc.phases]
        ),
        checkpointer=CheckpointManager(
            config.checkpoint,
            config.checkpoint_dir,
            rank=runtime.rank,
            world_size=runtime.world_size,
            config_sha256=config_sha256(config),
        ),
        tracker=tracker,
        hooks=HookRunner(load_hooks(tc.hooks)),
        nan_detector=NaNDetector(tc.nan_consecutive_max),
        shutdown_handler=ShutdownHandler(),
        profiler=build_profiler(config.profiling, run_dir, first_step=0),
    )


def resume_session(session: TrainingSession) -> tuple[int, int]:
    """Load the checkpoint checkpoint.resume_from points at, if any; return (step, tokens_seen).

    A config change that alters the math is refused before anything is loaded (see
    check_resume_compatible). With checkpoint.load_weights_only only the model weights
    are taken and the run starts at step 0 with a fresh optimizer and data order.
    """
    cfg = session.config
    path = session.checkpointer.find_resume_path()
    if path is None:
        return 0, 0
    if cfg.checkpoint.load_weights_only:
        session.checkpointer.load_weights(path, model=session.model)
        session.tracker.log_event(0, "load_weights", path=path)
        logger.info("initialised the model from %s (weights only); starting at step 0", path)
        return 0, 0
    check_resume_compatible(cfg, session.checkpointer.read_extra(path), path)
    state = session.checkpointer.load(
        path, model=session.model, optimizer=session.optimizer, scheduler=session.scheduler
    )
    set_optimizer_mode(session.optimizer, True)  # checkpoints hold a schedule-free eval point
    step, tokens_seen = restore_train_state(session, state)
    session.profiler = build_profiler(cfg.profiling, cfg.run_dir, first_step=step)
    session.tracker.log_event(step, "resume", path=path, tokens_seen=tokens_seen)
    logger.info("resumed from %s at step %d (%d tokens seen)", path, step, tokens_seen)
    return step, tokens_seen
