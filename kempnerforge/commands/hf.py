"""`kempnerforge export` and `kempnerforge import-hf`: checkpoints to and from Hugging Face.

export: the checkpoint and its run's config (training/inference/loading.py) -> the export checks
(interop/hf.py) -> the model with the checkpoint's weights on the CPU -> a Hugging Face
folder. import-hf: a Hugging Face folder -> a [model] TOML table and a weights-only
checkpoint that `kempnerforge train` starts from (interop/hf_import.py). Both run in one
process and write their folder under a temporary name first (interop/folders.py), so a
failure leaves no half-written model. Heavy imports stay inside the functions, so
`kempnerforge --help` stays fast.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kempnerforge.commands.arguments import add_checkpoint_argument, add_config_argument

EXPORT_FORMATS = ("hf", "peft")


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `kempnerforge export` (overrides are the unknown --section.field=...)."""
    add_checkpoint_argument(parser)
    parser.add_argument(
        "--out",
        required=True,
        help="the folder to write, new or empty: config.json, model.safetensors and the "
        "tokenizer files when data.tokenizer is a Hugging Face tokenizer",
    )
    parser.add_argument(
        "--format",
        choices=EXPORT_FORMATS,
        default="hf",
        help="hf: a Hugging Face transformers folder, of the first supported class that "
        "computes the model exactly (docs/interop.md lists them; the command prints it), "
        "with a [lora] run's adapters merged into its weights; peft: only a [lora] run's "
        "adapters, as a peft adapter folder (adapter_config.json, adapter_model.safetensors)",
    )
    parser.add_argument(
        "--base-model",
        default=None,
        help="with --format peft: the base model's name or folder, recorded as the adapter's "
        "base_model_name_or_path",
    )
    add_config_argument(parser)


def add_import_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `kempnerforge import-hf` (overrides: --model.<field>=... only)."""
    parser.add_argument(
        "--model",
        required=True,
        help="a Hugging Face model folder with config.json and safetensors weights, of a "
        "supported model_type (docs/interop.md lists them; another is refused by name)",
    )
    parser.add_argument(
        "--out",
        required=True,
        help="the folder to write, new or empty: model.toml (the [model] table) and "
        "step_0, a checkpoint to start training from with "
        "--checkpoint.resume_from=<out>/step_0 --checkpoint.load_weights_only=true",
    )


def run_export(args: argparse.Namespace, overrides: list[str]) -> int:
    """Write the weights of ``args.checkpoint`` as a Hugging Face folder at ``args.out``; 0."""
    from kempnerforge.core.logging import configure_logging
    from kempnerforge.interop.folders import new_folder, staged
    from kempnerforge.interop.hf import check_exportable, export_hf
    from kempnerforge.interop.peft_adapter import export_peft
    from kempnerforge.training.inference import load_for_inference, open_for_inference

    out = new_folder(args.out, "--out")
    configure_logging(0)
    # No data is read, so the run's parallel layout need not fit one process (validate);
    # the conversion needs no accelerator.
    job = open_for_inference(
        "export",
        args.checkpoint,
        config_path=args.config,
        overrides=overrides,
        validate=False,
        device="cpu",
    )
    config = job.config
    architecture = check_exportable(config.model, job.recorded_config, job.source)
    adapters_only = args.format == "peft"
    model = load_for_inference(job, keep_adapters=adapters_only)
    with staged(out) as staging:
        if adapters_only:
            export_peft(model, config.model, config.lora, staging, args.base_model)
        else:
            export_hf(model, config.model, staging, config.data.tokenizer)
    what = f"the adapters of a {architecture}" if adapters_only else architecture
    print(f"wrote {out} ({what}) from {job.source}, step {job.step}")
    print(f"config: {job.config_source}")
    return 0


def run_import(args: argparse.Namespace, overrides: list[str]) -> int:
    """Write the [model] table and a step_0 checkpoint of the Hugging Face folder; 0."""
    from kempnerforge.interop.folders import new_folder
    from kempnerforge.interop.hf_import import write_imported

    source = Path(args.model).resolve()
    out = new_folder(args.out, "--out")
    toml, step = write_imported(source, out, overrides)
    print(f"wrote {toml} and the checkpoint {step} from {source}")
    print(
        f'train from it: include = ["{toml.resolve()}"] in a config (or copy its [model] table), '
        f"then kempnerforge train CONFIG --checkpoint.resume_from={step} "
        "--checkpoint.load_weights_only=true"
    )
    if (source / "tokenizer.json").is_file():
        print(f'its tokenizer: data.tokenizer = "{source}" (prepare data with it)')
    return 0
