"""Capturing chosen layers' outputs over a set of batches (`kempnerforge capture`): which
modules, which windows, the forward with hooks, and the safetensors file they go to."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import save_file

from kempnerforge.config.job import JobConfig
from kempnerforge.core.errors import ConfigError, DataError, DataPathError, closest_name
from kempnerforge.data.dataset import MemoryMappedDataset
from kempnerforge.data.tokenizer import load_tokenizer
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.model.attention import needs_document_mask
from kempnerforge.storage.location import is_url
from kempnerforge.training.inference.eval_checkpoint import build_eval_data
from kempnerforge.training.inference.loading import write_output


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


def capture_dataset(config: JobConfig, runtime: RuntimeContext, data: str = "") -> Any:
    """The token windows to capture over: the prepare-data directory ``data`` (--data) read
    as the job's training data would be, else the job's first eval set."""
    if data:
        tokenizer = load_tokenizer(config.data.tokenizer)
        try:
            return MemoryMappedDataset(
                data,
                config.train.seq_len,
                document_masking=config.data.document_masking,
                expected_tokenizer=tokenizer.identity,
                model_vocab_size=config.model.vocab_size,
            )
        except DataError as e:
            raise DataPathError("--data", data, e) from None
    dataset = build_eval_data(config, runtime).eval_dataset
    assert dataset is not None  # build_eval_data raises without eval data
    return dataset


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
    outputs: dict[str, list[torch.Tensor]] = {name: [] for name in modules}

    def keep(name: str) -> Callable[[torch.nn.Module, Any, Any], None]:
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


def save_capture(
    captured: dict[str, torch.Tensor], path: str, *, checkpoint: str, layers: str
) -> None:
    """Write ``captured`` to the safetensors file ``path`` (a local path, its directory
    created, or a store URL), its metadata naming the checkpoint (a local one by its
    absolute path) and the layers asked for."""
    where = checkpoint if is_url(checkpoint) else os.path.abspath(checkpoint)
    metadata = {"checkpoint": where, "layers": layers}
    write_output(path, lambda local: save_file(captured, local, metadata=metadata))
