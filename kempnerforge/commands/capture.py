"""`kempnerforge capture`: chosen layers' outputs over a set of batches, for interpretability.

the checkpoint and its run's config (training/inference/loading.py) -> the token windows ->
the model with the checkpoint's weights -> forward hooks on the named modules over the first
N batches (training/inference/capture.py) -> one safetensors file holding each layer's
outputs (float32, (samples, seq_len, ...)) and the input_ids they came from. Nothing is
written anywhere else.
"""

from __future__ import annotations

import argparse

from kempnerforge.commands.arguments import add_checkpoint_argument, add_config_argument
from kempnerforge.core.errors import ConfigError

ACTIVATIONS_FILE = "activations.safetensors"
"""The file `kempnerforge capture` writes inside the checkpoint directory unless --out."""


def add_capture_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `kempnerforge capture` (overrides are the unknown --section.field=...)."""
    add_checkpoint_argument(parser)
    parser.add_argument(
        "--layers",
        required=True,
        help="comma-separated module names of the model, e.g. layers.0,layers.3.attention,norm",
    )
    parser.add_argument(
        "--data",
        default="",
        help="a prepare-data directory to read (default: the job's first eval set)",
    )
    parser.add_argument("--batches", type=int, default=4, help="batches to run (default: 4)")
    parser.add_argument(
        "--batch-size", type=int, default=0, help="sequences per batch (default: train.batch_size)"
    )
    add_config_argument(parser)
    parser.add_argument(
        "--out",
        default="",
        help=f"safetensors file to write (default: <checkpoint>/{ACTIVATIONS_FILE})",
    )


def run_capture(args: argparse.Namespace, overrides: list[str]) -> int:
    """Capture the outputs of ``args.layers``; write the safetensors file; 0."""
    if args.batches < 1:
        raise ConfigError("--batches", args.batches, ">= 1")
    if args.batch_size < 0:
        raise ConfigError("--batch-size", args.batch_size, ">= 0 (0: train.batch_size)")
    # Heavy imports here, so `kempnerforge --help` stays fast.
    from kempnerforge.core.logging import configure_logging
    from kempnerforge.training.inference import (
        capture,
        capture_dataset,
        load_for_inference,
        open_for_inference,
        output_path,
        resolve_modules,
        save_capture,
    )

    configure_logging(0)
    job = open_for_inference(
        "capture", args.checkpoint, config_path=args.config, overrides=overrides
    )
    dataset = capture_dataset(job.config, job.runtime, args.data)
    model = load_for_inference(job)
    modules = resolve_modules(model, args.layers)
    batch_size = args.batch_size or job.config.train.batch_size
    captured = capture(model, modules, dataset, args.batches, batch_size, job.runtime.device)
    output = output_path(job, args.out, ACTIVATIONS_FILE)
    save_capture(captured, output, checkpoint=job.source, layers=args.layers)
    shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in captured.items())
    print(f"wrote {output}: {shapes}")
    return 0
