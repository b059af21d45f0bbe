"""`kempnerforge eval`: a checkpoint's held-out loss and perplexity, without training.

config -> validate -> runtime -> model, tokenizer and eval data -> the checkpoint's weights
-> evaluate -> a table on stdout and a JSON file. Nothing is written to the run directory
except that JSON (by default beside the checkpoint's own files).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kempnerforge.config.eval import DEFAULT_EVAL_SET
from kempnerforge.core.errors import ConfigError

if TYPE_CHECKING:
    from kempnerforge.config.job import JobConfig
    from kempnerforge.data.pipeline import DataPipeline
    from kempnerforge.distributed.runtime import RuntimeContext

EVAL_JSON = "eval.json"
"""The file `kempnerforge eval` writes inside the checkpoint directory unless --output."""


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `kempnerforge eval` (overrides are the unknown --section.field=...)."""
    parser.add_argument("config", help="the TOML config the checkpoint was trained with")
    parser.add_argument("--checkpoint", required=True, help="a checkpoint directory (step_<N>)")
    parser.add_argument(
        "--output", default="", help=f"JSON file to write (default: <checkpoint>/{EVAL_JSON})"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="batches per eval set (default: eval.steps)"
    )


def run_eval(args: argparse.Namespace, overrides: list[str]) -> int:
    """Evaluate the weights of ``args.checkpoint``; print the table, write the JSON; 0."""
    from kempnerforge.launch.allocator import put_allocator_in_place

    put_allocator_in_place(args.config, overrides, restart=getattr(args, "may_restart", False))
    # Heavy imports here, so `kempnerforge --help` stays fast.
    import torch

    from kempnerforge.checkpoint.manager import CheckpointManager
    from kempnerforge.config.loader import load_config
    from kempnerforge.core.logging import configure_logging
    from kempnerforge.distributed.runtime import init_runtime, teardown_runtime, world_size_from_env
    from kempnerforge.model import build_model
    from kempnerforge.model.vlm import build_vlm
    from kempnerforge.training.eval import evaluate_model

    if args.steps is not None:
        overrides = [*overrides, f"--eval.steps={args.steps}"]
    config = load_config(args.config, overrides)
    world_size = world_size_from_env()
    config.validate(world_size)
    if world_size > 1:
        raise ConfigError("WORLD_SIZE", world_size, "1: kempnerforge eval runs in one process")
    runtime = init_runtime(config.distributed, config.train.device)
    configure_logging(runtime.rank)
    try:
        if config.train.num_threads:
            torch.set_num_threads(config.train.num_threads)
        data = build_eval_data(config, runtime)
        with torch.device(runtime.device):
            if config.is_vlm:
                model = build_vlm(config.model, config.vision_encoder, config.adapter, config.vlm)
            else:
                model = build_model(config.model)
        checkpointer = CheckpointManager(config.checkpoint, config.checkpoint_dir)
        extra = checkpointer.read_extra(args.checkpoint)
        step = extra.get("step")
        global_batch = eval_batch_of_checkpoint(config, args.checkpoint, extra)
        checkpointer.load_weights(args.checkpoint, model=model)
        metrics = evaluate_model(
            model,
            data,
            config,
            runtime.device,
            group=runtime.group("dp"),
            global_batch=global_batch,
        )
        if not runtime.is_main:
            return 0  # every rank evaluated its share; rank 0 reports the reduced numbers
        output = args.output or os.path.join(args.checkpoint, EVAL_JSON)
        report = {
            "checkpoint": args.checkpoint,
            "step": step,
            "eval_steps": config.eval.steps,
            "eval_batch_size": global_batch,
            "metrics": metrics,
        }
        print(format_table(metrics, list(data.eval_datasets), named=bool(config.eval.sets)))
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        print(f"step {step}; wrote {output}")
        return 0
    finally:
        teardown_runtime(runtime)


def eval_batch_of_checkpoint(config: JobConfig, checkpoint: str, extra: dict[str, Any]) -> int:
    """Sequences per eval step for evaluating ``checkpoint`` in one process: eval.batch_size,
    or when it is 0 the global batch of the run that saved the checkpoint (its recorded
    config at its world size), so this evaluates the windows the run's own eval did.

    A checkpoint without a recorded config falls back to this config's global batch in one
    process, with a warning.
    """
    from kempnerforge.checkpoint.layout import read_marker
    from kempnerforge.core.logging import get_logger
    from kempnerforge.training.eval import eval_global_batch
    from kempnerforge.training.resume_guard import global_batch

    if config.eval.batch_size:
        return config.eval.batch_size
    saved = extra.get("config")
    world_size = int((read_marker(Path(checkpoint)) or {}).get("world_size", 1))
    trained = global_batch(saved, world_size) if isinstance(saved, dict) else None
    if trained is not None:
        return trained
    fallback = eval_global_batch(config, 1)
    get_logger(__name__).warning(
        "%s records no config of the run that saved it: evaluating %d sequences per eval "
        "step (this config's global batch in one process); set --eval.batch_size to the "
        "run's global batch to evaluate the windows its eval did",
        checkpoint,
        fallback,
    )
    return fallback


def build_eval_data(config: JobConfig, runtime: RuntimeContext) -> DataPipeline:
    """Tokenizer and eval sets only (no training loader); a DataError when there are none."""
    from kempnerforge.training.build import build_job_data

    data = build_job_data(config, runtime, with_train=False)
    if not data.eval_datasets and config.is_vlm:
        from kempnerforge.core.errors import DataError

        raise DataError(
            "no held-out image-text pairs: set vlm.eval_data to a jsonl index (or leave "
            "vlm.data empty to use the synthetic held-out set)"
        )
    if not data.eval_datasets:
        data.eval_batches(1, 1)  # raises the DataError that says how to configure eval data
    return data


def format_table(metrics: dict[str, Any], names: list[str], *, named: bool) -> str:
    """One row per eval set (set, tokens, loss, perplexity), plus "all" for several sets."""
    rows: list[tuple[str, float, float, float]] = []
    if named:
        for name in names:
            keys = (f"eval_tokens/{name}", f"eval_loss/{name}", f"eval_ppl/{name}")
            rows.append((name, *(metrics[k] for k in keys)))
    overall = (metrics["eval_tokens"], metrics["eval_loss"], metrics["eval_ppl"])
    if not named:
        rows.append((names[0] if names else DEFAULT_EVAL_SET, *overall))
    elif len(rows) > 1:
        rows.append(("all", *overall))
    width = max(len("set"), *(len(r[0]) for r in rows))
    lines = [f"{'set':<{width}}  {'tokens':>12}  {'loss':>10}  {'perplexity':>12}"]
    for name, tokens, loss, ppl in rows:
        lines.append(f"{name:<{width}}  {int(tokens):>12,}  {loss:>10.6f}  {ppl:>12.4f}")
    return "\n".join(lines)
