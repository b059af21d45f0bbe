"""dpo.reference = "stored": every window's reference log-probability, computed once by the
frozen reference and stored beside the data (data/window_values.py), then read with each
sample, so training runs no reference and holds no second copy of the weights.

The first launch computes them: the reference is built, sharded and loaded exactly as the
live one is (training/build.py), each data-parallel rank runs its contiguous share of the
corpus's windows through it, train.batch_size at a time (every rank the same number of
forwards: a sharded forward is collective), the shares are gathered on rank 0, which writes
the file, and the reference is freed. The file's name is the hash of what the values depend
on (the corpus's content, the reference's weights, the model config, train.seq_len and the
compute dtype), so a later launch (a resume, or another run from the same reference) reads
the file back, and a change of any of them computes a new one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from kempnerforge.checkpoint.manager import CheckpointManager
from kempnerforge.config.dpo import DPOConfig
from kempnerforge.config.model import ModelConfig
from kempnerforge.config.train import TrainConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.core.logging import get_logger
from kempnerforge.data.dataset import MemoryMappedDataset
from kempnerforge.data.pipeline import DataPipeline
from kempnerforge.data.sampling import PairSampler
from kempnerforge.data.window_values import WindowValues, read_manifest, write_window_values
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.training.objectives.dpo import REF_LOGPS
from kempnerforge.training.objectives.objective import Batch
from kempnerforge.training.objectives.reference import ReferenceLogps, reference_logps
from kempnerforge.training.objectives.sampling import any_rank

logger = get_logger(__name__)

FORMAT = 1
"""The stored values' manifest format."""


@dataclasses.dataclass(frozen=True)
class StoredReference:
    """Where and for what a run's stored reference log-probabilities are."""

    directory: str
    """dpo.reference_dir, or data.path's `reference` folder."""
    source: str
    """The reference's weights: a checkpoint (its location and its rank-0 checksums) or
    the seed's initialisation."""
    compute_dtype: str
    """The dtype the forward computes in (train.mixed_precision's)."""


def reference_source(checkpointer: CheckpointManager, resume_from: str, seed: int) -> str:
    """What the reference's weights are (load_reference_weights' choice), for the stored
    values' hash: the checkpoint's location and its rank-0 checksums file (a checkpoint
    saved again at the same path has other values), or the seed."""
    if resume_from in ("auto", "none"):
        return f"seed {seed}"
    path = checkpointer.find_resume_path()
    assert path is not None, "an explicit checkpoint.resume_from resolves or raises"
    sums = os.path.join(path, "checksums_rank0.json")
    content = ""
    if os.path.isfile(sums):
        with open(sums, "rb") as handle:
            content = hashlib.sha256(handle.read()).hexdigest()
    return f"{checkpointer.location_of(path)} {content}".strip()


def manifest_of(
    stored: StoredReference, dataset: MemoryMappedDataset, model: ModelConfig
) -> dict[str, Any]:
    """What the values depend on, as the manifest records it."""
    return {
        "format": FORMAT,
        "corpus": dataset.content_hashes,
        "seq_len": dataset.seq_len,
        "reference": stored.source,
        "model": dataclasses.asdict(model),
        "compute_dtype": stored.compute_dtype,
    }


def values_path(stored: StoredReference, manifest: dict[str, Any]) -> str:
    """The file of the values ``manifest`` describes: its hash names it."""
    text = json.dumps(manifest, sort_keys=True, default=str)
    key = hashlib.sha256(text.encode()).hexdigest()[:20]
    return os.path.join(stored.directory, f"reference_logps-{key}.npy")


def attach_stored_reference(
    data: DataPipeline,
    stored: StoredReference,
    model: ModelConfig,
    build_reference: Callable[[], nn.Module],
    rows: int,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager],
    group: dist.ProcessGroup | None,
) -> str:
    """Make the samples of ``data``'s preference corpus carry their stored reference
    log-probability (REF_LOGPS), computing and writing the values first when no launch has
    (``rows``: a forward's windows). Returns the values' path. Collective over ``group``
    (the job's world; None for one process) when it computes."""
    dataset, share = data.dataset, (data.dp_rank, data.dp_size)
    assert isinstance(dataset, MemoryMappedDataset), "a preference corpus is one directory"
    manifest = manifest_of(stored, dataset, model)
    path = values_path(stored, manifest)
    # Computing is collective, so the ranks decide together: any rank without the file.
    if any_rank(read_manifest(path) is None, group):
        started = time.perf_counter()
        reference = build_reference()
        values = share_values(reference, dataset, rows, share, device, autocast)
        del reference
        gathered = gather_on_rank_zero(values, share, len(dataset), group)
        if gathered is not None:
            write_window_values(path, gathered, manifest)
        if group is not None:
            dist.barrier(group)
        logger.info(
            "dpo: stored the reference log-probabilities of %d windows in %s (%.1f s)",
            len(dataset), path, time.perf_counter() - started,
        )  # fmt: skip
    else:
        logger.info("dpo: reference log-probabilities read from %s", path)
    dataset.window_values[REF_LOGPS] = WindowValues(path, len(dataset))
    return path


def share_bounds(windows: int, rank: int, size: int) -> tuple[int, int]:
    """The contiguous windows [first, last) data-parallel rank ``rank`` of ``size``
    computes."""
    return rank * windows // size, (rank + 1) * windows // size


@torch.no_grad()
def share_values(
    reference: nn.Module,
    dataset: MemoryMappedDataset,
    rows: int,
    share: tuple[int, int],
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> np.ndarray:
    """The reference log-probability of each window of this rank's share, (share,) fp32.
    Every rank runs ceil(largest share / rows) forwards; a short or missing batch is filled
    with the share's first window (or window 0), whose values are dropped."""
    rank, size = share
    first, last = share_bounds(len(dataset), rank, size)
    largest = -(-len(dataset) // size)
    out = np.zeros(last - first, dtype=np.float32)
    for offset in range(0, largest, rows):
        indices = list(range(first + offset, min(first + offset + rows, last)))
        filled = indices + [indices[0] if indices else 0] * (rows - len(indices))
        samples = [dataset[i] for i in filled]
        batch: Batch = {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
        logps = reference_logps(reference, batch, device, autocast).float().cpu().numpy()
        out[offset : offset + len(indices)] = logps[: len(indices)]
    return out


def gather_on_rank_zero(
    values: np.ndarray, share: tuple[int, int], windows: int, group: dist.ProcessGroup | None
) -> np.ndarray | None:
    """Every data-parallel rank's share, in window order, on global rank 0 of ``group``
    (the world; None elsewhere); one process (no group) returns its own. The ranks of one
    data-parallel rank (its tensor-parallel peers) computed the same values: the first of
    them is taken."""
    if group is None:
        return values
    _, size = share
    largest = -(-windows // size)
    padded = torch.zeros(largest + 1, dtype=torch.float32)
    padded[0] = float(share[0])  # which data-parallel rank sent it
    padded[1 : 1 + values.shape[0]] = torch.from_numpy(values)
    world, first_rank = dist.get_world_size(group), dist.get_rank(group) == 0
    received = [torch.zeros_like(padded) for _ in range(world)] if first_rank else None
    dist.gather(padded, received, dst=0, group=group)
    if received is None:
        return None
    out = np.zeros(windows, dtype=np.float32)
    done: set[int] = set()
    for tensor in received:
        rank = int(tensor[0])
        if rank in done:
            continue
        done.add(rank)
        first, last = share_bounds(windows, rank, size)
        out[first:last] = tensor[1 : 1 + last - first].numpy()
    return out


def preference_reference(
    data: DataPipeline,
    dpo: DPOConfig,
    tc: TrainConfig,
    model: ModelConfig,
    data_path: str,
    runtime: RuntimeContext,
    frozen_reference: Callable[[], nn.Module],
    checkpointer: CheckpointManager,
    resume_from: str,
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> ReferenceLogps | None:
    """Where a preference objective's reference log-probabilities come from: with a live
    reference, what adds them to every micro-batch (the batch stream's add_keys); with a
    stored one (dpo.reference = "stored"), the data's samples themselves, which carry their
    stored values (computed first when no launch has), so None; SimPO has none. The data
    must be pairs either way."""
    check_pairs(data, data_path)
    if dpo.loss_type == "simpo":
        return None
    if dpo.reference == "live":
        return ReferenceLogps(frozen_reference(), runtime.device, autocast)
    where = dpo.reference_dir or os.path.join(data_path, "reference")
    source = reference_source(checkpointer, resume_from, tc.seed)
    stored = StoredReference(where, source, tc.precision_on(runtime.device.type))
    attach_stored_reference(data, stored, model, frozen_reference, tc.batch_size, runtime.device,
                            autocast, runtime.group("world"))  # fmt: skip
    return None


def check_pairs(data: DataPipeline, path: str) -> None:
    """A preference objective reads pairs: refuse training data that is not a preference
    corpus (its sampler lays out pairs), before the reference is built."""
    if not isinstance(data.sampler, PairSampler):
        raise ConfigError(
            "data.path",
            path,
            "a preference corpus with train.loss_fn = 'dpo'",
            "prepare pairs with `kempnerforge prepare-data --format preference --seq-len N` "
            "and set data.path to its directory (data.datasets mixtures are not read as pairs)",
        )
