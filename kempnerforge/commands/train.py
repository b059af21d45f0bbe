"""`kempnerforge train`: load config -> validate -> preflight -> runtime -> directories and
locks -> plan the resume -> build -> record the config -> resume -> loop -> exit code.

Importing this module stays light (no torch), so `--help` answers at once; the run imports
what it needs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import time
from typing import TYPE_CHECKING

from kempnerforge.config.job import JobConfig  # dataclasses only: no torch
from kempnerforge.core.errors import CollectiveFailure
from kempnerforge.launch.allocator import put_allocator_in_place
from kempnerforge.resilience import exit_codes

if TYPE_CHECKING:
    from kempnerforge.distributed.runtime import RuntimeContext
    from kempnerforge.launch.allocator import AllocatorPlan
    from kempnerforge.resilience.shutdown import ShutdownHandler
    from kempnerforge.training.resume_plan import ResumePlan
    from kempnerforge.training.session import TrainingSession


def train_epilog() -> str:
    """The help's closing paragraph: how overrides are written, every section of JobConfig
    (read from it, so a new section is listed without an edit here), the reference, and the
    exit codes (read from resilience/exit_codes.py, so a new code is listed too).
    """
    fields = dataclasses.fields(JobConfig)
    always = ", ".join(f"[{f.name}]" for f in fields if f.default is not None)
    optional = ", ".join(f"[{f.name}]" for f in fields if f.default is None)
    return (
        "Overrides: --section.field=value, the value read as TOML (--train.max_steps=100, "
        "--train.name=run1, --optimizer.betas='[0.9,0.95]': quote a value with brackets, "
        f"braces, quotes or spaces for the shell). Sections: {always}, and the optional "
        f"{optional}. Every field, its default and its meaning: docs/config.md "
        "(or python -m kempnerforge.config.reference). Exit codes: "
        + ", ".join(f"{code} {meaning}" for code, meaning in exit_codes.SUMMARY.items())
        + "."
    )


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `kempnerforge train` (overrides are the unknown --section.field=...)."""
    parser.epilog = train_epilog()
    parser.add_argument("config", help="path to a TOML config, e.g. configs/train/debug.toml")


EXIT_CODE_FILE_ENV = "KEMPNERFORGE_EXIT_CODE_FILE"
"""When set, rank 0 of `kempnerforge train` writes its exit code (one line) to this path.

A launcher whose own exit code hides the ranks' (torchrun answers a stop signal with 1
while every rank exits 75) reads it to decide whether to requeue; see scripts/slurm."""


def _record_exit_code(code: int) -> None:
    path = os.environ.get(EXIT_CODE_FILE_ENV)
    if not path or os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) != "0":
        return
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{code}\n")
    os.replace(tmp, path)


def run_train(args: argparse.Namespace, overrides: list[str]) -> int:
    """Train ``args.config`` with ``overrides``; the exit code (also written to the exit-code
    file). Errors propagate to the CLI, which reports them in one line."""
    # The launch's start, before torch is imported: its start-up is counted from here
    # (the `start` event's `started`, metrics/goodput.py).
    started = time.time()
    allocator = put_allocator_in_place(
        args.config, overrides, restart=getattr(args, "may_restart", False)
    )
    code = exit_codes.FAILED
    try:
        code = _train_stopping_on_signals(args, overrides, allocator, started)
        return code
    except BaseException as error:
        code = exit_codes.code_of(error)
        raise
    finally:
        _record_exit_code(code)


def _train_stopping_on_signals(
    args: argparse.Namespace,
    overrides: list[str],
    allocator: AllocatorPlan | None,
    started: float,
) -> int:
    from kempnerforge.resilience.shutdown import ShutdownHandler

    shutdown = ShutdownHandler()
    # Installed before anything slow, so a stop signal during the build (preparing data,
    # a long checkpoint load) still ends in a clean requeue exit. It stays installed until
    # the run is over; then a stopped run ignores further stop signals, so a late second
    # signal during teardown cannot turn the requeue exit code into a kill.
    with shutdown:
        code = _train_under(args, overrides, shutdown, allocator, started)
    if code == exit_codes.PREEMPTED:
        _ignore_stop_signals()
    return code


def _train_under(
    args: argparse.Namespace,
    overrides: list[str],
    shutdown: ShutdownHandler,
    allocator: AllocatorPlan | None,
    started: float,
) -> int:
    # Heavy imports here, so `kempnerforge --help` and config errors stay fast.
    from kempnerforge.config.context_parallel import cp_ring
    from kempnerforge.config.loader import load_config
    from kempnerforge.core.logging import configure_logging
    from kempnerforge.distributed.failure import describe_collective_failure, is_collective_failure
    from kempnerforge.distributed.runtime import (
        init_runtime,
        rank_from_env,
        teardown_runtime,
        world_size_from_env,
    )
    from kempnerforge.training.inference import print_sample
    from kempnerforge.training.preflight import preflight
    from kempnerforge.training.workspace import rank0_workspace

    configure_logging(rank_from_env())  # before validate, which may warn
    config = load_config(args.config, overrides)
    config.validate(world_size_from_env())
    preflight(config)
    runtime = init_runtime(config.distributed, config.train.device, cp_ring(config))
    ended_together = False  # every rank got to a return: leave the group in step
    try:
        with rank0_workspace(config, runtime):
            trained = _build_and_train(config, runtime, shutdown, allocator, started)
            ended_together = True
            if isinstance(trained, int):  # ended before the first step
                return trained
            session, step, tokens_seen = trained
            # The loader's workers stop now: the process may end without finalisation
            # (cli.main), which would leave them to notice their parent is gone.
            session.batches.reset()
            if shutdown.requested:
                return exit_codes.PREEMPTED
            if runtime.is_main:
                print(f"finished at step {step} ({tokens_seen:,} tokens); run: {config.run_dir}")
            print_sample(session)
            return exit_codes.FINISHED
    except Exception as e:
        if runtime.is_distributed and is_collective_failure(e):
            timeout_s = config.distributed.timeout_s
            raise CollectiveFailure(describe_collective_failure(e, runtime, timeout_s)) from e
        raise
    finally:
        teardown_runtime(runtime, together=ended_together)


def _build_and_train(
    config: JobConfig,
    runtime: RuntimeContext,
    shutdown: ShutdownHandler,
    allocator: AllocatorPlan | None,
    started: float,
) -> int | tuple[TrainingSession, int, int]:
    """Plan the resume, build the session and train it to its end: (the session, the last
    step, the tokens seen); or the exit code of a run that ends before its first step
    (nothing left to train, a stop signal during the build). Every rank returns alike."""
    from kempnerforge.core.logging import get_logger
    from kempnerforge.launch.allocator import describe_allocator
    from kempnerforge.metrics.goodput import START_EVENT
    from kempnerforge.resilience.agreement import agreed_stop
    from kempnerforge.resilience.hang import HangWatchdog
    from kempnerforge.training.build import build_checkpointer, build_session
    from kempnerforge.training.replicas import checkpointer_kind
    from kempnerforge.training.resume_plan import WEIGHTS, plan_resume
    from kempnerforge.training.store_checks import store_save_limits
    from kempnerforge.training.workspace import record_config

    logger = get_logger("kempnerforge.cli")
    checkpointer = build_checkpointer(config, runtime, checkpointer_kind(config.fault_tolerance))
    plan = plan_resume(config, checkpointer)
    if plan is not None and plan.step == config.train.max_steps:
        if runtime.is_main:
            print(
                f"nothing to train: {plan.where} is already at train.max_steps = "
                f"{plan.step}; raise --train.max_steps to continue this run, or use "
                "another --train.name to start a new one"
            )
        return exit_codes.FINISHED
    session = build_session(config, runtime, checkpointer=checkpointer, shutdown_handler=shutdown)
    # The process's first row, at the step it trains from: its start time, from which
    # goodput counts its start-up (metrics/goodput.py); written once the run directory is
    # this launch's (the run lock).
    first_step = plan.step if plan is not None and plan.mode != WEIGHTS else 0
    session.tracker.log_event(first_step, START_EVENT, started=round(started, 3))
    if allocator is not None:  # once the data and model are known to be fine
        logger.info(describe_allocator(allocator))
    if agreed_stop(shutdown, runtime):  # a signal during the build
        logger.warning(
            "stop requested by %s while the run was being built: exiting before the "
            "first step, nothing new to save",
            shutdown.reason,
        )
        session.tracker.close()
        return exit_codes.PREEMPTED
    if runtime.is_main:
        record_config(config, started)
    watchdog = HangWatchdog(
        config.train.hang_timeout_s,
        config.run_dir,
        runtime.rank,
        on_exit=_record_exit_code,
        at_least=store_save_limits(config.checkpoint),
    )
    with watchdog, session.tracker:
        step, tokens_seen = _resume_and_train(session, plan)
    return session, step, tokens_seen


def _resume_and_train(session: TrainingSession, plan: ResumePlan | None) -> tuple[int, int]:
    """Resume the built session from ``plan`` and train it to its end: (step, tokens_seen).

    With [fault_tolerance] this launch is one of the job's replica groups
    (training/replicas/groups.py): its group is installed into the session first, the one
    change a session gets after its build, then it joins the groups' first quorum, which
    stands in for the resume, and trains with them.
    """
    from kempnerforge.training.loop import run_training_loop
    from kempnerforge.training.replicas import ReplicaGroup
    from kempnerforge.training.resume_plan import apply_resume

    if not session.config.fault_tolerance.enabled:
        step, tokens_seen = apply_resume(session, plan)
        return run_training_loop(session, step=step, tokens_seen=tokens_seen)
    group = ReplicaGroup(session)
    group.install()
    step, tokens_seen = group.join(plan)
    return group.train(step, tokens_seen)


def _ignore_stop_signals() -> None:
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)
