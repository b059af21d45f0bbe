"""DCP's ``.metadata``, read only through an allow-list: the one way this package reads it.

``dcp.load`` itself unpickles that file with plain ``pickle.load``, so a planted .metadata
would run code; the completeness check and every DCP load (reader.AllowListedReader) read
it here instead.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
from pathlib import Path, PurePath
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from kempnerforge.checkpoint.disk_format import DCP_METADATA


def read_dcp_metadata(path: Path) -> Metadata:
    """DCP's .metadata of checkpoint `path`, unpickled through an allow-list."""
    return parse_dcp_metadata((path / DCP_METADATA).read_bytes())


def parse_dcp_metadata(data: bytes) -> Metadata:
    """DCP metadata from the bytes of a .metadata file, unpickled through an allow-list."""
    metadata = _MetadataUnpickler(io.BytesIO(data)).load()
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
