"""The `kempnerforge` command: train, eval and prepare-data.

train: load config -> validate -> runtime -> build -> resume -> loop -> exit code.
User-caused problems print one line and exit with a documented code, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import warnings
from collections.abc import Sequence

from kempnerforge.checkpoint.manager import CheckpointError
from kempnerforge.config.errors import ConfigError
from kempnerforge.data.errors import DataError
from kempnerforge.resilience import exit_codes
from kempnerforge.resilience.nan import NaNAbortError
from kempnerforge.resilience.run_lock import RunLockError


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    # Heavy imports here, so `kempnerforge --help` and config errors stay fast.
    from kempnerforge.config.loader import load_config
    from kempnerforge.distributed.runtime import init_runtime, teardown_runtime, world_size_from_env
    from kempnerforge.metrics.logging import configure_logging
    from kempnerforge.resilience.run_lock import RunLock
    from kempnerforge.training.build import build_session, resume_session
    from kempnerforge.training.loop import run_training_loop
    from kempnerforge.training.sample import print_sample

    config = load_config(args.config, overrides)
    config.validate(world_size_from_env())
    runtime = init_runtime(config.distributed, config.train.device)
    configure_logging(runtime.rank)
    lock = RunLock(config.run_dir) if runtime.is_main else contextlib.nullcontext()
    try:
        with lock:
            session = build_session(config, runtime)
            # The handler stays installed until the run is over; then a stopped run ignores
            # further stop signals, so a late second signal during teardown cannot turn
            # the requeue exit code into a kill.
            with session.shutdown_handler:
                with session.tracker:
                    step, tokens_seen = resume_session(session)
                    step, tokens_seen = run_training_loop(
                        session, step=step, tokens_seen=tokens_seen
                    )
                preempted = session.shutdown_handler.requested
                if not preempted and runtime.is_main:
                    print(
                        f"finished at step {step} ({tokens_seen:,} tokens); run: {config.run_dir}"
                    )
                    print_sample(session)
            if preempted:
                _ignore_stop_signals()
                return exit_codes.PREEMPTED
            return exit_codes.FINISHED
    finally:
        teardown_runtime(runtime)


def _eval(args: argparse.Namespace, overrides: list[str]) -> int:
    from kempnerforge.training.eval_cli import run_eval

    return run_eval(args, overrides)


def _ignore_stop_signals() -> None:
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)


def _build_parser() -> argparse.ArgumentParser:
    from kempnerforge.data.prepare import add_prepare_data_arguments
    from kempnerforge.training.eval_cli import add_eval_arguments

    parser = argparse.ArgumentParser(
        prog="kempnerforge", description="Fault-tolerant training of foundation models."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train",
        help="train a model from a TOML config",
        description="Train from CONFIG; any --section.field=value argument overrides the file.",
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # torchdata's StatefulDataLoader calls an API this torch deprecates; nothing to act on.
    warnings.filterwarnings("ignore", message=".*set_vital.*", category=UserWarning)
    parser = _build_parser()
    args, extra = parser.parse_known_args(argv)
    try:
        if args.command == "train":
            unknown = [a for a in extra if not a.startswith("--") or "." not in a.split("=")[0]]
            if unknown:
                parser.error(f"unrecognized arguments: {' '.join(unknown)}")
            return _train(args, extra)
        if args.command == "eval":
            unknown = [a for a in extra if not a.startswith("--") or "." not in a.split("=")[0]]
            if unknown:
                parser.error(f"unrecognized arguments: {' '.join(unknown)}")
            return _eval(args, extra)
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        from kempnerforge.data.prepare import run_prepare_data

        return run_prepare_data(args)
    except (ConfigError, DataError, RunLockError) as e:
        print(f"kempnerforge: error: {e}", file=sys.stderr)
        return exit_codes.CONFIG_ERROR
    except CheckpointError as e:
        print(f"kempnerforge: checkpoint error: {e}", file=sys.stderr)
        return exit_codes.FAILED
    except NaNAbortError as e:
        print(f"kempnerforge: stopped: {e}", file=sys.stderr)
        return exit_codes.NAN_ABORT


if __name__ == "__main__":
    sys.exit(main())
