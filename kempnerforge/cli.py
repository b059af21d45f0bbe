"""The `kempnerforge` command: train, eval, prepare-data and check-parallel.

train: load config -> validate -> preflight -> runtime -> directories and locks -> plan
the resume -> build -> record the config -> resume -> loop -> exit code. User-caused
problems print one line and exit with a documented code, never a traceback. Importing
this module stays light (no torch) so that `--help` answers at once.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import signal
import sys
import time
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kempnerforge.checkpoint.errors import CheckpointError
from kempnerforge.config.errors import ConfigError
from kempnerforge.data.errors import DataError
from kempnerforge.resilience import exit_codes
from kempnerforge.resilience.nan import NaNAbortError
from kempnerforge.resilience.peers import CollectiveFailure, PeerSetupError
from kempnerforge.resilience.run_lock import RunLockError

if TYPE_CHECKING:
    from kempnerforge.allocator import AllocatorPlan
    from kempnerforge.resilience.shutdown import ShutdownHandler

SECTIONS = (
    "model",
    "train",
    "optimizer",
    "scheduler",
    "data",
    "eval",
    "distributed",
    "checkpoint",
    "metrics",
    "profiling",
)
TRAIN_EPILOG = (
    "Overrides: --section.field=value, the value read as TOML (--train.max_steps=100, "
    "--optimizer.betas=[0.9,0.95], --train.name=run1). Sections: "
    + ", ".join(f"[{s}]" for s in SECTIONS)
    + ". Every field, its default and its meaning: docs/config.md "
    "(or python -m kempnerforge.config.reference). Exit codes: 0 finished, 1 failed, "
    "2 bad config or data, 3 stopped by non-finite losses, 75 preempted (requeue)."
)

# OS errors that say something about the machine (a full disk, a missing permission),
# reported in one line with the path; other OS errors are bugs and keep their traceback.
MACHINE_ERRNOS = {
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
    errno.EIO,
    errno.ENOMEM,
    errno.EMFILE,
    errno.ENFILE,
}


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


def _prepare_allocator(
    args: argparse.Namespace, overrides: list[str], *, restart: bool
) -> AllocatorPlan | None:
    """Put train.allocator in place before torch is imported: this may restart the command
    with the allocator preloaded (see kempnerforge.allocator), which only a command may
    do (``restart``), not a caller of main() inside its own process. None when the config
    does not load: the run reports that itself, in its own words."""
    from kempnerforge.allocator import plan_allocator, prepare_allocator
    from kempnerforge.config.loader import load_config

    try:
        configured = load_config(args.config, overrides).train.allocator
    except (ConfigError, OSError):
        return None
    if restart:
        return prepare_allocator(configured)
    return plan_allocator(configured)


def _train(
    args: argparse.Namespace, overrides: list[str], allocator: AllocatorPlan | None = None
) -> int:
    code = exit_codes.FAILED
    try:
        code = _train_stopping_on_signals(args, overrides, allocator)
        return code
    except BaseException as error:
        code = _code_of(error)
        raise
    finally:
        _record_exit_code(code)


def _code_of(error: BaseException) -> int:
    """The exit code main() gives a run that raised ``error`` (for the exit-code file)."""
    if isinstance(error, (ConfigError, DataError, RunLockError, PeerSetupError)):
        return exit_codes.CONFIG_ERROR
    if isinstance(error, NaNAbortError):
        return exit_codes.NAN_ABORT
    if isinstance(error, KeyboardInterrupt):
        return exit_codes.INTERRUPTED
    if isinstance(error, SystemExit) and isinstance(error.code, int):
        return error.code
    return exit_codes.FAILED


def _train_stopping_on_signals(
    args: argparse.Namespace, overrides: list[str], allocator: AllocatorPlan | None
) -> int:
    from kempnerforge.resilience.shutdown import ShutdownHandler

    shutdown = ShutdownHandler()
    # Installed before anything slow, so a stop signal during the build (preparing data,
    # a long checkpoint load) still ends in a clean requeue exit. It stays installed until
    # the run is over; then a stopped run ignores further stop signals, so a late second
    # signal during teardown cannot turn the requeue exit code into a kill.
    with shutdown:
        code = _train_under(args, overrides, shutdown, allocator)
    if code == exit_codes.PREEMPTED:
        _ignore_stop_signals()
    return code


def _train_under(
    args: argparse.Namespace,
    overrides: list[str],
    shutdown: ShutdownHandler,
    allocator: AllocatorPlan | None,
) -> int:
    # Heavy imports here, so `kempnerforge --help` and config errors stay fast.
    from kempnerforge.allocator import describe_allocator
    from kempnerforge.config.loader import load_config
    from kempnerforge.distributed.failure import describe_collective_failure, is_collective_failure
    from kempnerforge.distributed.runtime import (
        init_runtime,
        rank_from_env,
        teardown_runtime,
        world_size_from_env,
    )
    from kempnerforge.metrics.logging import configure_logging, get_logger
    from kempnerforge.resilience.agreement import agreed_stop
    from kempnerforge.training.build import build_checkpointer, build_session
    from kempnerforge.training.loop import run_training_loop
    from kempnerforge.training.preflight import preflight
    from kempnerforge.training.resume import apply_resume, plan_resume
    from kempnerforge.training.sample import print_sample
    from kempnerforge.training.workspace import rank0_workspace, record_config

    started = time.time()
    configure_logging(rank_from_env())  # before validate, which may warn
    config = load_config(args.config, overrides)
    config.validate(world_size_from_env())
    preflight(config)
    runtime = init_runtime(config.distributed, config.train.device)
    logger = get_logger("kempnerforge.cli")
    ended_together = False  # every rank got to a return: leave the group in step
    try:
        with rank0_workspace(config, runtime):
            checkpointer = build_checkpointer(config, runtime)
            plan = plan_resume(config, checkpointer)
            if plan is not None and plan.step == config.train.max_steps:
                if runtime.is_main:
                    print(
                        f"nothing to train: {plan.path} is already at train.max_steps = "
                        f"{plan.step}; raise --train.max_steps to continue this run, or use "
                        "another --train.name to start a new one"
                    )
                ended_together = True
                return exit_codes.FINISHED
            session = build_session(
                config, runtime, checkpointer=checkpointer, shutdown_handler=shutdown
            )
            if allocator is not None:  # once the data and model are known to be fine
                logger.info(describe_allocator(allocator))
            if agreed_stop(shutdown, runtime):  # a signal during the build
                logger.warning(
                    "stop requested by %s while the run was being built: exiting before the "
                    "first step, nothing new to save",
                    shutdown.reason,
                )
                session.tracker.close()
                ended_together = True
                return exit_codes.PREEMPTED
            if runtime.is_main:
                record_config(config, started)
            with session.tracker:
                step, tokens_seen = apply_resume(session, plan)
                step, tokens_seen = run_training_loop(session, step=step, tokens_seen=tokens_seen)
            ended_together = True
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


def _eval(args: argparse.Namespace, overrides: list[str]) -> int:
    from kempnerforge.training.eval_cli import run_eval

    return run_eval(args, overrides)


def _prepare_data(args: argparse.Namespace) -> int:
    from kempnerforge.data.prepare import run_prepare_data

    return run_prepare_data(args)


def _ignore_stop_signals() -> None:
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)


TOOL_COMMANDS: dict[str, tuple[str, str, str, str, bool]] = {
    "capture": (
        "kempnerforge.training.capture_cli",
        "add_capture_arguments",
        "run_capture",
        "save chosen layers' outputs over a few batches to a safetensors file",
        True,
    ),
    "generate": (
        "kempnerforge.training.generate_cli",
        "add_generate_arguments",
        "run_generate",
        "continue a prompt with a checkpoint's model (KV cache, temperature, top-k, top-p)",
        True,
    ),
    "export": (
        "kempnerforge.interop.cli",
        "add_export_arguments",
        "run_export",
        "write a checkpoint as a Hugging Face model folder (Llama, or a matching MoE class)",
        True,
    ),
    "import-hf": (
        "kempnerforge.interop.cli",
        "add_import_arguments",
        "run_import",
        "turn a local Hugging Face model folder into a [model] table and a step_0 checkpoint",
        True,
    ),
    "plot": (
        "kempnerforge.metrics.plot",
        "add_plot_arguments",
        "run_plot",
        "draw the training curves of one or more runs as PNG files",
        False,
    ),
}
"""Commands beside train, eval and prepare-data: name -> (module, its add-arguments and
run functions, help, whether --section.field=value config overrides are accepted). Each
module imports its heavy dependencies inside the run function, so --help stays fast."""


def _build_parser() -> argparse.ArgumentParser:
    from kempnerforge.data.prepare_args import add_prepare_data_arguments
    from kempnerforge.training.eval_cli import add_eval_arguments

    parser = argparse.ArgumentParser(
        prog="kempnerforge",
        description="Fault-tolerant training of foundation models.",
        epilog="Run `kempnerforge COMMAND --help` for a command's options.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train",
        help="train a model from a TOML config",
        description="Train from CONFIG; any --section.field=value argument overrides the file.",
        epilog=TRAIN_EPILOG,
    )
    train.add_argument("config", help="path to a TOML config, e.g. configs/train/debug.toml")
    evaluate = commands.add_parser(
        "eval",
        help="evaluate a checkpoint on the held-out sets",
        description="Held-out loss and perplexity of a checkpoint's weights, per eval set; "
        "any --section.field=value argument overrides CONFIG.",
    )
    add_eval_arguments(evaluate)
    prepare = commands.add_parser(
        "prepare-data", help="tokenize text into a memory-mapped token file"
    )
    add_prepare_data_arguments(prepare)
    for name, (module, add, _, help_text, _) in TOOL_COMMANDS.items():
        sub = commands.add_parser(
            name, help=help_text, description=help_text[:1].upper() + help_text[1:] + "."
        )
        getattr(importlib.import_module(module), add)(sub)
    # Listed here for --help only: main hands its arguments to parallel_check's own parser.
    commands.add_parser(
        "check-parallel",
        help="train under several parallel layouts and compare with one process",
        add_help=False,
    )
    return parser


def _describe_os_error(error: OSError) -> str:
    where = error.filename if error.filename is not None else "the run"
    return f"{where}: {error.strerror or error}"


def _is_out_of_memory(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, MemoryError) or (
        isinstance(error, RuntimeError)
        and ("out of memory" in text.lower() or "can't allocate memory" in text)
    )


def main(argv: Sequence[str] | None = None) -> int:
    # torchdata's StatefulDataLoader calls an API this torch deprecates; nothing to act on.
    warnings.filterwarnings("ignore", message=".*set_vital.*", category=UserWarning)
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["check-parallel"]:
        from kempnerforge.parallel_check import main as check_parallel

        return check_parallel(arguments[1:])
    parser = _build_parser()
    args, extra = parser.parse_known_args(argv)
    try:
        if args.command in ("train", "eval"):
            unknown = [a for a in extra if not a.startswith("--") or "." not in a.split("=")[0]]
            if unknown:
                parser.error(f"unrecognized arguments: {' '.join(unknown)}")
            allocator = _prepare_allocator(args, extra, restart=argv is None)
            if args.command == "eval":
                return _eval(args, extra)
            return _train(args, extra, allocator)
        if args.command in TOOL_COMMANDS:
            module, _, run, _, takes_overrides = TOOL_COMMANDS[args.command]
            unknown = [a for a in extra if not a.startswith("--") or "." not in a.split("=")[0]]
            if unknown or (extra and not takes_overrides):
                parser.error(f"unrecognized arguments: {' '.join(unknown or extra)}")
            warnings.filterwarnings("ignore", category=FutureWarning)
            return getattr(importlib.import_module(module), run)(args, extra)
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return _prepare_data(args)
    except (ConfigError, DataError, RunLockError, PeerSetupError) as e:
        print(f"kempnerforge: error: {e}", file=sys.stderr)
        return exit_codes.CONFIG_ERROR
    except CheckpointError as e:
        print(f"kempnerforge: checkpoint error: {e}", file=sys.stderr)
        return exit_codes.FAILED
    except CollectiveFailure as e:
        print(f"kempnerforge: error: {e}", file=sys.stderr)
        return exit_codes.FAILED
    except NaNAbortError as e:
        print(f"kempnerforge: stopped: {e}", file=sys.stderr)
        return exit_codes.NAN_ABORT
    except OSError as e:
        if e.errno not in MACHINE_ERRNOS:
            raise
        print(f"kempnerforge: error: {_describe_os_error(e)}", file=sys.stderr)
        return exit_codes.FAILED
    except (MemoryError, RuntimeError) as e:
        if not _is_out_of_memory(e):
            raise
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(
            f"kempnerforge: error: out of memory ({first_line}); lower train.batch_size or "
            "train.seq_len, or use a smaller model",
            file=sys.stderr,
        )
        return exit_codes.FAILED
    except KeyboardInterrupt:
        print("kempnerforge: interrupted", file=sys.stderr)
        return exit_codes.INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
