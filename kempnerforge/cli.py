"""The `kempnerforge` command: one table of subcommands, each a module of
kempnerforge/commands/, and one mapping of the errors they raise to a line and an exit code.

User-caused problems print one line and exit with a documented code, never a traceback
(kempnerforge.resilience.exit_codes). Importing this module stays light (no torch), and so
does building the parser, so that `--help` answers at once.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from kempnerforge.resilience import exit_codes


@dataclass(frozen=True)
class Command:
    """A subcommand: its module, the functions there that add its arguments and run it
    (``run(args, overrides) -> exit code``), its help line, and whether it reads
    ``--section.field=value`` config overrides."""

    module: str
    add_arguments: str
    run: str
    help: str
    takes_overrides: bool = True
    preloads_allocator: bool = False
    """It trains or evaluates: train.allocator is put in place before torch is imported."""


COMMANDS: dict[str, Command] = {
    "train": Command(
        "kempnerforge.commands.train",
        "add_train_arguments",
        "run_train",
        "train a model from a TOML config",
        preloads_allocator=True,
    ),
    "eval": Command(
        "kempnerforge.commands.eval",
        "add_eval_arguments",
        "run_eval",
        "evaluate a checkpoint on the held-out sets or downstream tasks",
        preloads_allocator=True,
    ),
    "prepare-data": Command(
        "kempnerforge.commands.prepare_data",
        "add_prepare_data_arguments",
        "run_prepare_data",
        "tokenize text into a memory-mapped token file",
        takes_overrides=False,
    ),
    "convert-task": Command(
        "kempnerforge.commands.convert_task",
        "add_convert_task_arguments",
        "run_convert_task",
        "convert a public multiple-choice set's released files into an evaluation task file",
        takes_overrides=False,
    ),
    "generate": Command(
        "kempnerforge.commands.generate",
        "add_generate_arguments",
        "run_generate",
        "continue a prompt with a checkpoint's model (KV cache, temperature, top-k, top-p)",
    ),
    "capture": Command(
        "kempnerforge.commands.capture",
        "add_capture_arguments",
        "run_capture",
        "save chosen layers' outputs over a few batches to a safetensors file",
    ),
    "export": Command(
        "kempnerforge.commands.hf",
        "add_export_arguments",
        "run_export",
        "write a checkpoint as a Hugging Face model folder (Llama, or a matching MoE class)",
    ),
    "import-hf": Command(
        "kempnerforge.commands.hf",
        "add_import_arguments",
        "run_import",
        "turn a local Hugging Face model folder into a [model] table and a step_0 checkpoint",
    ),
    "plot": Command(
        "kempnerforge.commands.plot",
        "add_plot_arguments",
        "run_plot",
        "draw the training curves of one or more runs as PNG files",
        takes_overrides=False,
    ),
    "goodput": Command(
        "kempnerforge.commands.goodput",
        "add_goodput_arguments",
        "run_goodput",
        "say where a run's wall time went, cause by cause, and its goodput share",
        takes_overrides=False,
    ),
    "lighthouse": Command(
        "kempnerforge.commands.lighthouse",
        "add_lighthouse_arguments",
        "run_lighthouse",
        "serve the torchft lighthouse that coordinates a job's replica groups",
        takes_overrides=False,
    ),
}
"""Every subcommand but check-parallel, which parses its own arguments
(kempnerforge.commands.check_parallel.main). Each module imports its heavy dependencies
inside its run function."""

CHECK_PARALLEL_HELP = "train under several parallel layouts and compare with one process"


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kempnerforge",
        description="Fault-tolerant training of foundation models.",
        epilog="Run `kempnerforge COMMAND --help` for a command's options.",
    )
    subcommands = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        sub = subcommands.add_parser(
            name, help=command.help, description=command.help[:1].upper() + command.help[1:] + "."
        )
        getattr(importlib.import_module(command.module), command.add_arguments)(sub)
    # Listed for --help only: main hands its arguments to the command's own parser.
    subcommands.add_parser("check-parallel", help=CHECK_PARALLEL_HELP, add_help=False)
    return parser


def _is_override(argument: str) -> bool:
    return argument.startswith("--") and "." in argument.split("=")[0]


def main(argv: Sequence[str] | None = None) -> int:
    # torchdata's StatefulDataLoader calls an API this torch deprecates; nothing to act on.
    warnings.filterwarnings("ignore", message=".*set_vital.*", category=UserWarning)
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["check-parallel"]:
        from kempnerforge.commands.check_parallel import main as check_parallel

        return check_parallel(arguments[1:])
    parser = _build_parser()
    args, extra = parser.parse_known_args(argv)
    command = COMMANDS[args.command]
    unknown = [a for a in extra if not (command.takes_overrides and _is_override(a))]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    # Only a process started as the command may re-exec itself with an allocator preloaded,
    # not a caller of main() inside its own process.
    args.may_restart = argv is None and command.preloads_allocator
    if not command.preloads_allocator:
        warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        code = getattr(importlib.import_module(command.module), command.run)(args, extra)
    except BaseException as error:
        reported = exit_codes.print_report(error)
        if reported is None:
            raise
        code = reported
    if argv is None:  # this process is the command: it may end itself
        _exit_now_after_a_process_group(code)
    return code


def _exit_now_after_a_process_group(code: int) -> None:
    """End the process with ``code`` at once, without Python's finalisation, when it has
    left a process group (distributed/runtime.py left_a_process_group says why); the
    output streams and log handlers are flushed first. Nothing else needs finalising by
    then: the run has closed its metrics, checkpoints and exit-code file."""
    # Only a command that imported the runtime can have joined a group; importing it here
    # would load torch for every command.
    runtime = sys.modules.get("kempnerforge.distributed.runtime")
    if runtime is None or not runtime.left_a_process_group():
        return
    exit_codes.exit_now(code)


if __name__ == "__main__":
    sys.exit(main())
