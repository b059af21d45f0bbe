"""A checkpoint as N ranks would have saved it, built cheaply, and a counter of file accesses.

``write_fake_checkpoint`` writes what a save of ``world_size`` ranks leaves: the marker, a
real DCP ``.metadata`` naming one ``__<r>_0.distcp`` file per rank, each rank's train state
and its ``checksums_rank<r>.json``, all in the package's own formats; each DCP file holds
one real ``torch.save`` record, so every check a rank runs on its share passes. The bytes
are the same for every rank, serialised once.
"""

from __future__ import annotations

import builtins
import io
import os
import pickle
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from kempnerforge.checkpoint.checksums import checksum_of_bytes, checksums_name, checksums_text
from kempnerforge.checkpoint.disk_format import (
    CHECKSUM_KIND,
    DCP_METADATA,
    FORMAT_VERSION,
    train_state_name,
    write_marker,
)


def _torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def write_fake_checkpoint(directory: Path, step: int, world_size: int) -> Path:
    """``directory/step_<step>`` as `world_size` ranks would have saved it; its path."""
    path = directory / f"step_{step}"
    path.mkdir(parents=True)
    item = _torch_bytes(torch.zeros(1))
    state = _torch_bytes({"step": step, "tokens_seen": 0})
    chunks, storage = [], {}
    for rank in range(world_size):
        name = f"__{rank}_0.distcp"
        chunks.append(ChunkStorageMetadata(torch.Size([rank]), torch.Size([1])))
        index = MetadataIndex("model.w", torch.Size([rank]), rank)
        storage[index] = _StorageInfo(name, 0, len(item))
    tensor = TensorStorageMetadata(TensorProperties(), torch.Size([world_size]), chunks)
    metadata = pickle.dumps(Metadata({"model.w": tensor}, storage_data=storage))
    (path / DCP_METADATA).write_bytes(metadata)
    for rank in range(world_size):
        name = f"__{rank}_0.distcp"
        (path / name).write_bytes(item)
        (path / train_state_name(rank)).write_bytes(state)
        sums = {name: checksum_of_bytes(item), train_state_name(rank): checksum_of_bytes(state)}
        if rank == 0:
            sums[DCP_METADATA] = checksum_of_bytes(metadata)
        (path / checksums_name(rank)).write_bytes(checksums_text(sums))
    marker = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "tokens_seen": 0,
        "world_size": world_size,
        "checksums": CHECKSUM_KIND,
    }
    write_marker(path, marker)
    return path


class FileAccess:
    """What was opened (``opens``) and looked up (``stats``: stat, lstat, a directory
    listing) under one root, by path relative to it."""

    def __init__(self, root: Path) -> None:
        self.root = str(root) + os.sep
        self.opens: Counter[str] = Counter()
        self.stats: Counter[str] = Counter()

    def note(self, counts: Counter[str], target: Any) -> None:
        if isinstance(target, (str, os.PathLike)):
            path = os.fspath(target)
            if isinstance(path, str) and path.startswith(self.root):
                counts[path[len(self.root) :]] += 1

    def names(self) -> list[str]:
        """The base names of the files opened, sorted (a name opened twice is listed twice)."""
        return sorted(os.path.basename(p) for p in self.opens.elements())


@contextmanager
def count_file_access(monkeypatch: pytest.MonkeyPatch, root: Path) -> Iterator[FileAccess]:
    """Count every open (builtins/io.open, os.open) and every stat, lstat and listing of a
    path under `root` while the block runs (pathlib, zipfile and torch.load go through
    these)."""
    access = FileAccess(root)

    def counting(real: Callable[..., Any], counts: Counter[str]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            access.note(counts, args[0] if args else None)
            return real(*args, **kwargs)

        return wrapper

    with monkeypatch.context() as patch:
        opened = counting(builtins.open, access.opens)
        patch.setattr(builtins, "open", opened)
        patch.setattr(io, "open", opened)
        patch.setattr(os, "open", counting(os.open, access.opens))
        for name in ("stat", "lstat", "listdir", "scandir"):
            patch.setattr(os, name, counting(getattr(os, name), access.stats))
        yield access
