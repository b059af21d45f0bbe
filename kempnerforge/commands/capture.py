"""`kempnerforge capture`: chosen layers' outputs over a set of batches, for interpretability.

config -> model with a checkpoint's weights -> forward hooks on the named modules -> the
first N batches of a token dataset -> one safetensors file on the CPU holding each
layer's outputs (float32, (samples, seq_len, ...)) and the input_ids they came from.
Nothing is written anywhere else.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from kempnerforge.config.run_config import RUN_CONFIG_FILE, run_config_beside
from kempnerforge.core.errors import ConfigError, closest_name

if TYPE_CHECKING:
    import torch

ACTIVATIONS_FILE = "activations.safetensors"
"""The file `kempnerforge capture` writes inside the checkpoint directory unless --out."""


def add_capture_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `kempnerforge capture` (overrides are the unknown --section.field=...)."""
    parser.add_argument("--checkpoint", required=True, help="a checkpoint directory (step_<N>)")
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
    parser.add_argument(
        "--config",
        default="",
        help="the run's config (default: config.toml of the run holding the checkpoint)",
    )
    parser.add_argument(
        "--out",
        default="",
        help=f"safetensors file to write (default: <checkpoint>/{ACTIVATIONS_FILE})",
    )


def run_capture(args: argparse.Namespace, overrides: list[str]) -> int:
    """Capture the outputs of ``args.layers``; write the safetensors file; 0."""
    import torch
    from safetensors.torch import save_file

    from kempnerforge.checkpoint.manager import CheckpointManager
    from kempnerforge.config.loader import load_config
    from kempnerforge.core.logging import configure_logging
    from kempnerforge.distributed.runtime import init_runtime, teardown_runtime, world_size_from_env
    from kempnerforge.model import build_model

    if args.batches < 1:
        raise ConfigError("--batches", args.batches, ">= 1")
    if args.batch_size < 0:
        raise ConfigError("--batch-size", args.batch_size, ">= 0 (0: train.batch_size)")
    config_path = args.config or run_config_of(args.checkpoint)
    config = load_config(config_path, overrides)
    world_size = world_size_from_env()
    config.validate(world_size)
    if world_size > 1:
        raise ConfigError("WORLD_SIZE", world_size, "1: kempnerforge capture runs in one process")
    if config.is_vlm:
        raise ConfigError(
            "--config",
            config_path,
            "a text model's config",
            "capture reads token data; a vision-language model is not supported",
        )
    runtime = init_runtime(config.distributed, config.train.device)
    configure_logging(runtime.rank)
    try:
        with torch.device(runtime.device):
            model = build_model(config.model)
        CheckpointManager(config.checkpoint, config.checkpoint_dir).load_weights(
            args.checkpoint, model=model
        )
        modules = resolve_modules(model, args.layers)
        dataset = _dataset(args, config, runtime)
        batch_size = args.batch_size or config.train.batch_size
        captured = capture(model, modules, dataset, args.batches, batch_size, runtime.device)
        output = args.out or os.path.join(args.checkpoint, ACTIVATIONS_FILE)
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        metadata = {"checkpoint": os.path.abspath(args.checkpoint), "layers": args.layers}
        save_file(captured, output, metadata=metadata)
        shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in captured.items())
        print(f"wrote {output}: {shapes}")
        return 0
    finally:
        teardown_runtime(runtime)


def run_config_of(checkpoint: str) -> str:
    """config.toml of the run holding ``checkpoint`` (<run_dir>/checkpoints/step_<N>)."""
    if not os.path.isdir(checkpoint):
        raise ConfigError("--checkpoint", checkpoint, "an existing checkpoint directory")
    path = run_config_beside(checkpoint)
    if not path.is_file():
        raise ConfigError(
            "--config", "", f"the run's {RUN_CONFIG_FILE} (there is no {path})", "pass --config"
        )
    return str(path)


def resolve_modules(model: torch.nn.Module, layers: str) -> dict[str, torch.nn.Module]:
    """The named modules of ``layers`` (comma-separated), in order; a ConfigError naming
    a name the model does not have, with the closest one."""
    named = dict(model.named_modules())
    modules: dict[str, torch.nn.Module] = {}
    for name in (part.strip() for part in layers.split(",")):
        if not name:
            continue
        if name not in named:
            suggestion = closest_name(name, [n for n in named if n])
            raise ConfigError(
                "--layers",
                name,
                "a module name of the model (as in model.named_modules())",
                f"did you mean {suggestion!r}?" if suggestion else "",
            )
        modules[name] = named[name]
    if not modules:
        raise ConfigError("--layers", layers, "at least one module name")
    return modules


def capture(
    model: torch.nn.Module,
    modules: dict[str, torch.nn.Module],
    dataset: Any,
    num_batches: int,
    batch_size: int,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Run the first num_batches * batch_size windows of ``dataset`` (in order, wrapping)
    through ``model`` in eval mode; each module's output (the first tensor of a tuple)
    as float32 on the CPU, concatenated over batches, plus the input_ids."""
    import torch

    from kempnerforge.model.attention import needs_document_mask

    outputs: dict[str, list[torch.Tensor]] = {name: [] for name in modules}

    def keep(name: str):
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            tensor = output[0] if isinstance(output, tuple | list) else output
            outputs[name].append(tensor.detach().float().cpu())

        return hook

    handles = [module.register_forward_hook(keep(name)) for name, module in modules.items()]
    inputs: list[torch.Tensor] = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for j in range(num_batches):
                rows = [dataset[(j * batch_size + k) % len(dataset)] for k in range(batch_size)]
                batch = {key: torch.stack([r[key] for r in rows]) for key in rows[0]}
                doc_ids = (
                    batch.get("doc_ids") if needs_document_mask(batch.get("doc_ids")) else None
                )
                model(
                    batch["input_ids"].to(device),
                    doc_ids=doc_ids.to(device) if doc_ids is not None else None,
                )
                inputs.append(batch["input_ids"])
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    captured = {name: torch.cat(parts).contiguous() for name, parts in outputs.items()}
    captured["input_ids"] = torch.cat(inputs)
    return captured


def _dataset(args: argparse.Namespace, config: Any, runtime: Any) -> Any:
    """--data opened as the job's training data would be, else the first eval set."""
    if args.data:
        from kempnerforge.core.errors import DataError, DataPathError
        from kempnerforge.data.dataset import MemoryMappedDataset
        from kempnerforge.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(config.data.tokenizer)
        try:
            return MemoryMappedDataset(
                args.data,
                config.train.seq_len,
                document_masking=config.data.document_masking,
                expected_tokenizer=tokenizer.identity,
                model_vocab_size=config.model.vocab_size,
            )
        except DataError as e:
            raise DataPathError("--data", args.data, e) from None
    from kempnerforge.commands.eval import build_eval_data

    dataset = build_eval_data(config, runtime).eval_dataset
    assert dataset is not None  # build_eval_data raises without eval data
    return dataset
