"""Is a checkpoint whole? Cheap checks of its marker, train states and DCP files, no tensor read.

Also the only way this package reads DCP's ``.metadata``: through an allow-list, since
``dcp.load`` itself unpickles that file with plain ``pickle.load`` (loads use reader.py).
"""

from __future__ import annotations

import dataclasses
import enum
import pickle
import struct
import zipfile
from pathlib import Path, PurePath
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint.metadata import Metadata

from kempnerforge.checkpoint.layout import DCP_METADATA, load_marker, train_state_name

_LOCAL_HEADER = b"PK\x03\x04"
_CENTRAL_HEADER = b"PK\x01\x02"
_END_RECORD = b"PK\x05\x06"
_END_RECORD_SIZE = 22
_MAX_ZIP_COMMENT = 0xFFFF
_ZIP64_SENTINEL = 0xFFFFFFFF
"""An end record's central-directory offset when the real one is in the zip64 record."""


def checkpoint_problems(path: Path) -> list[str]:
    """What keeps `path` from being a complete checkpoint; empty when it is one."""
    return inspect_checkpoint(path)[0]


def inspect_checkpoint(path: Path) -> tuple[list[str], Metadata | None]:
    """The problems of checkpoint `path` (empty when complete) and its DCP metadata.

    Checks the marker is one a save writes (types and bounds), each saved rank's train
    state is a whole zip (torch.save) file, DCP's .metadata loads through an allow-list,
    every file it references is long enough, and each item in those files starts and
    ends like the torch.save record it must be. Reads a few bytes per item, no tensor data.
    """
    if not path.is_dir():
        return ["the directory does not exist"], None
    problems: list[str] = []
    marker, marker_problem = load_marker(path)
    if marker is None:
        problems.append(str(marker_problem))
    else:
        problems.extend(_train_state_problems(path, marker["world_size"]))
    if not (path / DCP_METADATA).is_file():
        return [*problems, f"{DCP_METADATA} (DCP) is missing"], None
    try:
        metadata = read_dcp_metadata(path)
    except Exception as e:
        return [*problems, f"{DCP_METADATA} (DCP) is unreadable: {e}"], None
    problems.extend(_dcp_file_problems(path, metadata))
    return problems, metadata


def _train_state_problems(path: Path, world_size: int) -> list[str]:
    """The first train state of ranks below `world_size` that is missing or not a whole zip."""
    for rank in range(world_size):
        if not zipfile.is_zipfile(path / train_state_name(rank)):
            return [
                f"{train_state_name(rank)} is missing or truncated "
                f"(complete.json says {world_size} ranks saved)"
            ]
    return []


def _dcp_file_problems(path: Path, metadata: Metadata) -> list[str]:
    """Each DCP file its metadata names that is missing, short, or holds a broken item."""
    items: dict[str, list[tuple[int, int]]] = {}
    for info in (metadata.storage_data or {}).values():
        # A storage transform (compression, ...) changes the stored bytes: no zip to see.
        # A save of ours never uses one, so this only passes foreign items unchecked.
        if not getattr(info, "transform_descriptors", None):
            items.setdefault(info.relative_path, []).append((info.offset, info.length))
        else:
            items.setdefault(info.relative_path, [])
    sizes = {
        name: max((offset + length for offset, length in spans), default=0)
        for name, spans in items.items()
    }
    problems = []
    for name, spans in sorted(items.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"{name} (DCP) is missing")
            continue
        size = file.stat().st_size
        if size < sizes[name]:
            problems.append(f"{name} (DCP) is truncated ({size} of {sizes[name]} bytes)")
            continue
        with open(file, "rb") as f:
            for offset, length in sorted(spans):
                broken = _zip_record_problem(f, offset, length)
                if broken:
                    problems.append(f"{name} (DCP) is corrupt: the item at byte {offset} {broken}")
                    break
    return problems


def _zip_record_problem(f: BinaryIO, offset: int, length: int) -> str | None:
    """What is wrong with the torch.save zip at [offset, offset + length) of `f`, or None.

    DCP's filesystem writer stores every item, tensor or pickled object, as one
    ``torch.save`` zip. Checked: the first local file header, the end-of-central-directory
    record at the item's end (a trailing comment allowed), and the central directory's
    first header where the end record locates it. Three small reads in the usual case.
    """
    if length < len(_LOCAL_HEADER) + _END_RECORD_SIZE:
        return f"is {length} bytes, too short for a torch.save record"
    f.seek(offset)
    if f.read(len(_LOCAL_HEADER)) != _LOCAL_HEADER:
        return "does not start with a zip header (overwritten?)"
    end = _find_end_record(f, offset, length)
    if end is None:
        return "has no zip end record (overwritten?)"
    end_at, record = end
    cd_size, cd_offset = struct.unpack("<II", record[12:20])
    if cd_offset != _ZIP64_SENTINEL and cd_offset + cd_size <= end_at - offset:
        f.seek(offset + cd_offset)
        if f.read(len(_CENTRAL_HEADER)) != _CENTRAL_HEADER:
            return "has no zip central directory where its end record says (overwritten?)"
    elif cd_offset != _ZIP64_SENTINEL:
        return "has a zip end record that points outside the item (overwritten?)"
    return None


def _find_end_record(f: BinaryIO, offset: int, length: int) -> tuple[int, bytes] | None:
    """The file position and bytes of the zip end record closing the item, or None."""
    f.seek(offset + length - _END_RECORD_SIZE)
    record = f.read(_END_RECORD_SIZE)
    if record[:4] == _END_RECORD and record[20:22] == b"\x00\x00":
        return offset + length - _END_RECORD_SIZE, record  # torch.save writes no comment
    # A comment follows the record: look for it in the last 64 KiB (the comment's limit).
    tail_len = min(length, _END_RECORD_SIZE + _MAX_ZIP_COMMENT)
    f.seek(offset + length - tail_len)
    tail = f.read(tail_len)
    at = tail.rfind(_END_RECORD)
    while at >= 0:
        record = tail[at : at + _END_RECORD_SIZE]
        if len(record) == _END_RECORD_SIZE:
            (comment_len,) = struct.unpack("<H", record[20:22])
            if at + _END_RECORD_SIZE + comment_len == tail_len:
                return offset + length - tail_len + at, record
        at = tail.rfind(_END_RECORD, 0, at)
    return None


def read_dcp_metadata(path: Path) -> Metadata:
    """DCP's .metadata of checkpoint `path`, unpickled through an allow-list.

    torch's FileSystemReader reads this file with plain ``pickle.load``, so a planted
    .metadata would run code; the completeness check and every DCP load (through
    reader.AllowListedReader) read it here instead.
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
