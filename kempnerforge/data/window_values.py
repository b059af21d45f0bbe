"""Values stored per window of a corpus, read mapped: one float for each window, in a .npy file
beside a JSON manifest that says what they were computed from (a preference corpus's reference
log-probabilities: dpo.reference = "stored", training/objectives/stored_reference.py).

The .npy is written under a temporary name and renamed, then its manifest, so a file whose
manifest exists is whole; it is read with numpy's loader without pickles (nothing read runs
code) and mapped, not read: a rank touches only the values of the windows it reads.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from kempnerforge.core.errors import DataError

MANIFEST_SUFFIX = ".json"


def write_window_values(path: str, values: np.ndarray, manifest: dict[str, Any]) -> None:
    """Write ``values`` (windows,) as float32 to ``path`` and ``manifest`` (with the count
    of windows added) beside it, each atomically (a temporary name, then a rename)."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    partial = f"{path}.{os.getpid()}.tmp"
    with open(partial, "wb") as handle:
        np.save(handle, np.ascontiguousarray(values, dtype=np.float32), allow_pickle=False)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)
    text = json.dumps({**manifest, "windows": int(values.shape[0])}, indent=1, sort_keys=True)
    manifest_partial = f"{path}{MANIFEST_SUFFIX}.{os.getpid()}.tmp"
    with open(manifest_partial, "w") as handle:
        handle.write(text + "\n")
    os.replace(manifest_partial, path + MANIFEST_SUFFIX)


def read_manifest(path: str) -> dict[str, Any] | None:
    """The manifest of the values at ``path``, or None when they are not (all) written."""
    try:
        with open(path + MANIFEST_SUFFIX) as handle:
            manifest = json.load(handle)
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as error:
        raise DataError(
            f"{path}{MANIFEST_SUFFIX}: unreadable ({error}); delete it and rerun"
        ) from None
    return manifest if os.path.exists(path) else None


class WindowValues:
    """The values at ``path`` (written by write_window_values for ``windows`` windows), read
    mapped on first use; a copy sent to a loader worker opens its own map."""

    def __init__(self, path: str, windows: int) -> None:
        self.path = path
        self.windows = windows
        self._values: np.ndarray | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_values": None}

    def __getitem__(self, window: int) -> float:
        if self._values is None:
            self._values = self._open()
        return float(self._values[window])

    def _open(self) -> np.ndarray:
        try:
            values = np.load(self.path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as error:
            raise DataError(f"{self.path}: unreadable stored values ({error})") from None
        if values.shape != (self.windows,) or values.dtype != np.float32:
            raise DataError(
                f"{self.path} holds {values.dtype} values of shape {values.shape}, not one "
                f"float32 per window of the corpus ({self.windows}); delete it and its "
                f"{MANIFEST_SUFFIX} manifest and rerun to compute them again"
            )
        return values
