"""The on-disk checkpoint format: names, the `latest` pointer, the marker, durable writes."""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from kempnerforge.checkpoint.rng import capture_rng_state
from kempnerforge.core.logging import get_logger

logger = get_logger(__name__)

FORMAT_VERSION = 1
MARKER = "complete.json"
CHECKSUM_KIND = "crc32"
"""The marker's ``checksums`` value: every rank wrote checksums_rank<R>.json (checksums.py).
A marker without the field is an older version's checkpoint, which has none."""
LATEST = "latest"
DCP_METADATA = ".metadata"
STEP_DIR = re.compile(r"step_(\d+)")
LEFTOVER_DIR = re.compile(r"step_(\d+)\.(tmp|old|trash)")
"""A save in progress (.tmp), a copy being replaced (.old), a deletion in progress (.trash)."""
MAX_WORLD_SIZE = 2**20
"""The largest world size a marker may record: a bound, so a corrupt marker cannot make a
check loop for hours over train-state files that were never written."""
_LATEST_MAX_BYTES = 4096
"""More than any pointer a save writes; a longer `latest` is not ours and is not read whole."""
_RESERVED_KEYS = ("scheduler", "optimizer_initialized")
_MISSING = object()
_warned: set[str] = set()


def train_state_name(rank: int) -> str:
    return f"train_state_rank{rank}.pt"


def is_checkpoint_name(name: str) -> bool:
    return bool(STEP_DIR.fullmatch(name) or LEFTOVER_DIR.fullmatch(name))


def is_real_dir(path: Path) -> bool:
    """True when `path` is a directory and not a symbolic link: the only kind a save creates."""
    return not path.is_symlink() and path.is_dir()


def foreign_kind(path: Path) -> str:
    """What `path` is, in words, when it is not a real directory: 'a symbolic link', ..."""
    return "a symbolic link" if path.is_symlink() else "a file, not a directory"


def warn_once(message: str) -> None:
    """Log `message` as a warning the first time only: retention and resume meet the same
    stray entry on every save."""
    if message not in _warned:
        _warned.add(message)
        logger.warning("%s", message)


def step_dirs(directory: Path) -> list[tuple[int, Path]]:
    """The ``step_<N>`` directories under `directory`, newest first.

    A ``step_<N>`` that is a symbolic link or a file is none of ours: it is left out, with
    a warning, so neither resume nor retention ever follows or deletes it.
    """
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = STEP_DIR.fullmatch(path.name)
        if not match:
            continue
        if is_real_dir(path):
            found.append((int(match.group(1)), path))
        else:
            warn_once(
                f"ignoring {path}: it is {foreign_kind(path)}, and checkpoints are the "
                "directories a save writes (move it away to silence this)"
            )
    return sorted(found, key=lambda item: item[0], reverse=True)


def read_latest(directory: Path) -> str | None:
    """The checkpoint name `latest` holds, or None when there is no usable pointer.

    A `latest` that is a directory, is not UTF-8 text or names something other than a
    ``step_<N>`` (or a save's ``.tmp``/``.old`` copy) was not written by a save: it
    counts as no pointer, with a warning, and resume falls back to the newest complete
    checkpoint.
    """
    path = directory / LATEST
    try:
        with open(path, "rb") as f:
            data = f.read(_LATEST_MAX_BYTES + 1)
        name = data.decode("utf-8").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        problem = "is a directory" if path.is_dir() else f"is unreadable ({type(e).__name__})"
        warn_once(f"ignoring {path}: it {problem}, not the pointer file a save writes")
        return None
    if not is_checkpoint_name(name):
        shown = name if len(name) <= 40 and name.isprintable() else f"{name[:40]!r}..."
        warn_once(f"ignoring {path}: it names {shown!r}, not a step_<N> checkpoint")
        return None
    return name


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
    """The completion marker of checkpoint `path`, or None when absent, unreadable or
    not a marker a save writes (see load_marker)."""
    marker, _ = load_marker(path)
    return marker


def load_marker(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The completion marker of checkpoint `path` and None, or None and what is wrong."""
    try:
        marker = json.loads((path / MARKER).read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return None, f"{MARKER} is missing (the save did not finish)"
    except (OSError, ValueError) as e:
        return None, f"{MARKER} is unreadable ({type(e).__name__}: {_one_line(e)})"
    problem = marker_problem(marker)
    return (None, f"{MARKER}: {problem}") if problem else (marker, None)


def marker_problem(marker: Any) -> str | None:
    """What makes a parsed marker not one a save writes (a wrong type, an absurd value)."""
    if not isinstance(marker, dict):
        return f"holds a JSON {_json_kind(marker)}, not an object"
    version = marker.get("format_version", _MISSING)
    if not _is_int(version) or version != FORMAT_VERSION:
        return f"format_version is {_shown(version)}; this version reads {FORMAT_VERSION} only"
    bounds = (("step", 0, None), ("tokens_seen", 0, None), ("world_size", 1, MAX_WORLD_SIZE))
    for field, low, high in bounds:
        value = marker.get(field, _MISSING)
        if not _is_int(value) or value < low or (high is not None and value > high):
            allowed = f"from {low} to {high}" if high is not None else f">= {low}"
            return f"{field} is {_shown(value)}, not an integer {allowed}"
    checksums = marker.get("checksums", CHECKSUM_KIND)
    if checksums != CHECKSUM_KIND:
        return f"checksums is {_shown(checksums)}; this version reads {CHECKSUM_KIND!r} only"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    """A marker value for a message: JSON spelling, cut short (a marker may be huge)."""
    if value is _MISSING:
        return "missing"
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:40] + "..."


def _json_kind(value: Any) -> str:
    kinds = ((list, "array"), (str, "string"), (bool, "boolean"), (int | float, "number"))
    return next((name for kind, name in kinds if isinstance(value, kind)), "null")


def _one_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else ""


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
