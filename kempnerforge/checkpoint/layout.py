"""The on-disk checkpoint format: names, durable writes, and checks that a checkpoint is whole."""

from __future__ import annotations

import dataclasses
import enum
import io
import json
import os
import pickle
import re
import zipfile
from pathlib import Path, PurePath
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from kempnerforge.checkpoint.rng import capture_rng_state

FORMAT_VERSION = 1
MARKER = "complete.json"
LATEST = "latest"
DCP_METADATA = ".metadata"
STEP_DIR = re.compile(r"step_(\d+)")
LEFTOVER_DIR = re.compile(r"step_(\d+)\.(tmp|old|trash)")
"""A save in progress (.tmp), a copy being replaced (.old), a deletion in progress (.trash)."""
_RESERVED_KEYS = ("scheduler", "optimizer_initialized")


def train_state_name(rank: int) -> str:
    return f"train_state_rank{rank}.pt"


def is_checkpoint_name(name: str) -> bool:
    return bool(STEP_DIR.fullmatch(name) or LEFTOVER_DIR.fullmatch(name))


def step_dirs(directory: Path) -> list[tuple[int, Path]]:
    """The ``step_<N>`` directories under `directory`, newest first."""
    if not directory.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in directory.iterdir()
        if (m := STEP_DIR.fullmatch(p.name)) and p.is_dir()
    ]
    return sorted(found, key=lambda item: item[0], reverse=True)


def read_latest(directory: Path) -> str | None:
    """The directory name `latest` holds, or None when there is no `latest`."""
    try:
        return (directory / LATEST).read_text().strip() or None
    except (FileNotFoundError, IsADirectoryError):  # a directory: not our pointer format
        return None


def write_latest(directory: Path, name: str) -> None:
    write_atomic(directory / LATEST, name + "\n")


def build_train_state(
    step: int, scheduler_state: dict[str, Any], train_state: dict[str, Any]
) -> dict[str, Any]:
    """The caller's train state plus step, scheduler and (when absent) RNG, checked plain."""
    for key in _RESERVED_KEYS:
        if key in train_state:
            raise ValueError(f"train_state[{key!r}] is reserved for the checkpoint manager")
    if train_state.get("step", step) != step:
        raise ValueError(f"train_state['step'] = {train_state['step']} but saving step {step}")
    state = {"tokens_seen": 0, "dataloader": None, "extra": {}, **train_state}
    state["step"] = step
    state["scheduler"] = scheduler_state
    if "rng" not in state:
        state["rng"] = capture_rng_state()
    check_plain(state)
    return state


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` so readers see the old or the new content, never a mix."""
    tmp = path.with_name(f"{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def torch_bytes(obj: Any) -> bytes:
    """`obj` as the bytes ``torch.save`` writes: a snapshot later changes cannot alter."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def write_durable(path: Path, data: bytes) -> None:
    """Write `data` to `path` and fsync it (the directory entry is the caller's fsync_dir)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new names, renames) durable, where the OS allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory; they order renames themselves
    finally:
        os.close(fd)


def write_marker(path: Path, marker: dict[str, Any]) -> None:
    """Write the completion marker of checkpoint `path`: the last file a save writes."""
    write_atomic(path / MARKER, json.dumps(marker, indent=2) + "\n")


def read_marker(path: Path) -> dict[str, Any] | None:
    """The completion marker of checkpoint `path`, or None when absent or unreadable."""
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or not isinstance(marker.get("step"), int):
        return None
    return marker


def checkpoint_problems(path: Path) -> list[str]:
    """What keeps `path` from being a complete checkpoint; empty when it is one."""
    return inspect_checkpoint(path)[0]


def inspect_checkpoint(path: Path) -> tuple[list[str], Metadata | None]:
    """The problems of checkpoint `path` (empty when complete) and its DCP metadata.

    Checks the marker parses, each saved rank's train state is a whole zip (torch.save)
    file, DCP's .metadata loads through an allow-list, and every file it references is
    long enough. Reads no tensor data.
    """
    if not path.is_dir():
        return ["the directory does not exist"], None
    problems: list[str] = []
    marker = read_marker(path)
    if marker is None:
        problems.append(f"{MARKER} is missing or unreadable (the save did not finish)")
    else:
        for rank in range(int(marker.get("world_size", 1))):
            if not zipfile.is_zipfile(path / train_state_name(rank)):
                problems.append(f"{train_state_name(rank)} is missing or truncated")
    if not (path / DCP_METADATA).is_file():
        return [*problems, f"{DCP_METADATA} (DCP) is missing"], None
    try:
        metadata = read_dcp_metadata(path)
    except Exception as e:
        return [*problems, f"{DCP_METADATA} (DCP) is unreadable: {e}"], None
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(end, needed.get(info.relative_path, 0))
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"{name} (DCP) is missing")
        elif file.stat().st_size < size:
            problems.append(f"{name} (DCP) is truncated ({file.stat().st_size} of {size} bytes)")
    return problems, metadata


def read_dcp_metadata(path: Path) -> Metadata:
    """DCP's .metadata of checkpoint `path`, unpickled through an allow-list.

    ``dcp.load`` reads this file with plain ``pickle.load``, so a planted .metadata would
    run code; checking it here first keeps loads as safe as the weights-only train state.
    """
    with open(path / DCP_METADATA, "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)
_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP's metadata records, torch dtypes/layouts and paths; nothing callable."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint."):
            obj = super().find_class(module, name)
            # Only records: building a dataclass or an enum member runs no user code.
            if isinstance(obj, type) and (
                dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)
            ):
                return obj
        elif module == "pathlib":
            obj = super().find_class(module, name)
            if isinstance(obj, type) and issubclass(obj, PurePath):
                return obj
        elif module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUE_TYPES):
            return getattr(torch, name)
        elif (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def check_plain(value: Any, where: str = "train_state") -> None:
    """Raise TypeError naming the first entry a weights-only torch.load would refuse."""
    if value is None or isinstance(value, bool | int | float | str | torch.Tensor):
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str | int):
                raise TypeError(f"{where}: key {key!r} is a {type(key).__name__}, not str/int")
            check_plain(item, f"{where}[{key!r}]")
        return
    raise TypeError(
        f"{where} is a {type(value).__name__}: a checkpoint's train state holds only None, "
        "bool, int, float, str, tensors, lists, tuples and dicts (convert it, e.g. int(x))"
    )
