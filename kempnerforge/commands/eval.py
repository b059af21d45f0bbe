"""`kempnerforge eval`: a checkpoint's held-out loss and perplexity, without training.

config -> the checkpoint (training/inference/loading.py) -> eval data -> the model with the
checkpoint's weights -> evaluate -> a table on stdout and a JSON file. Nothing is written
to the run directory except that JSON (by default beside the checkpoint's own files).
"""

from __future__ import annotations

import argparse

from kempnerforge.commands.arguments import add_checkpoint_argument

EVAL_JSON = "eval.json"
"""The file `kempnerforge eval` writes inside the checkpoint directory unless --output."""


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `kempnerforge eval` (overrides are the unknown --section.field=...)."""
    parser.add_argument("config", help="the TOML config the checkpoint was trained with")
    add_checkpoint_argument(parser)
    parser.add_argument(
        "--output", default="", help=f"JSON file to write (default: <checkpoint>/{EVAL_JSON})"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="batches per eval set (default: eval.steps)"
    )
    parser.add_argument(
        "--tasks",
        nargs="*",
        default=None,
        metavar="NAME",
        help="score the downstream tasks of [[eval.tasks]] instead of the held-out sets: the "
        "named ones, or all of them when no name follows",
    )


def run_eval(args: argparse.Namespace, overrides: list[str]) -> int:
    """Evaluate the weights of ``args.checkpoint``; print the table, write the JSON; 0."""
    from kempnerforge.launch.allocator import put_allocator_in_place

    put_allocator_in_place(args.config, overrides, restart=getattr(args, "may_restart", False))
    # Heavy imports here, so `kempnerforge --help` stays fast.
    from kempnerforge.core.logging import configure_logging
    from kempnerforge.training.inference import (
        build_eval_data,
        evaluate_checkpoint,
        format_table,
        load_for_inference,
        open_for_inference,
        output_path,
        write_report,
    )

    if args.steps is not None:
        overrides = [*overrides, f"--eval.steps={args.steps}"]
    configure_logging(0)
    job = open_for_inference("eval", args.checkpoint, config_path=args.config, overrides=overrides)
    if args.tasks is not None:
        return _run_tasks(job, args)
    data = build_eval_data(job.config, job.runtime)  # before the model: a data mistake is cheap
    report = evaluate_checkpoint(job, load_for_inference(job), data)
    named = bool(job.config.eval.sets)
    print(format_table(report["metrics"], list(data.eval_datasets), named=named))
    output = output_path(job, args.output, EVAL_JSON)
    write_report(report, output)
    print(f"step {job.step}; wrote {output}")
    return 0


def _run_tasks(job, args: argparse.Namespace) -> int:
    """the `eval` command's `--tasks`: the tasks' table on stdout and the JSON report."""
    from kempnerforge.training.families import family_of
    from kempnerforge.training.inference import (
        evaluate_checkpoint_tasks,
        format_task_table,
        load_checkpoint_tasks,
        load_for_inference,
        output_path,
        write_report,
    )

    data = family_of(job.config).build_data(job.config, job.runtime, False)
    tasks = load_checkpoint_tasks(job, data, args.tasks)  # before the model: mistakes are cheap
    report = evaluate_checkpoint_tasks(job, load_for_inference(job), data, tasks)
    print(format_task_table(report["metrics"], report["tasks"]))
    output = output_path(job, args.output, EVAL_JSON)
    write_report(report, output)
    print(f"step {job.step}; wrote {output}")
    return 0
