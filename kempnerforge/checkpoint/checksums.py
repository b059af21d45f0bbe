"""Checksums of a checkpoint's files: computed while a save writes them, checked by readers.

Each rank records the CRC-32 and length of every file it writes (its DCP ``.distcp`` files,
rank 0 also DCP's ``.metadata``, and its ``train_state_rank<R>.pt``) in
``checksums_rank<R>.json``, written before the marker. The DCP files are hashed as they
pass through the writer's output streams (``ChecksummingWriter``), on the thread that
writes them: the background thread of an async save. CRC-32 (zlib) runs at several GB/s
on one core, well above the disks a checkpoint is written to.
"""

from __future__ import annotations

import contextlib
import json
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

from kempnerforge.checkpoint.disk_format import CHECKSUM_KIND, train_state_name, write_durable

_READ_CHUNK = 8 << 20

Checksum = tuple[int, int]
"""A file's (CRC-32, length in bytes)."""


def checksums_name(rank: int) -> str:
    return f"checksums_rank{rank}.json"


def checksum_of_bytes(data: bytes | memoryview) -> Checksum:
    return zlib.crc32(data), len(data)


def checksum_of_file(f: IO[bytes]) -> Checksum:
    """The checksum of what is left to read in `f` (read whole, in chunks, once)."""
    crc, size = 0, 0
    buffer = bytearray(_READ_CHUNK)
    view = memoryview(buffer)
    while True:
        n = f.readinto(view)  # type: ignore[attr-defined]
        if not n:
            return crc, size
        crc = zlib.crc32(view[:n], crc)
        size += n


def describe(checksum: Checksum) -> str:
    crc, size = checksum
    return f"crc32 {crc:08x}, {size} bytes"


class _HashingStream:
    """A binary output stream that hashes every byte written through it, in order.

    DCP writes its files sequentially (``write`` only; ``tell`` to note item offsets), so
    the running CRC is the file's. Everything else goes to the real stream.
    """

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.crc = 0
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.size += len(view)
        try:
            return self._raw.write(data)
        except OSError as e:
            self.os_error = e  # torch's writer reports it only as "unexpected pos"
            raise

    os_error: OSError | None = None
    """The OS error a write through this stream raised (a full disk), if any."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class HashingFileSystem(FileSystem):
    """DCP's local file system whose written files are hashed as they are written.

    ``sums`` maps each file name written (``.metadata`` after its rename) to its checksum.
    """

    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[str, Checksum] = {}
        self.os_error: OSError | None = None
        """The first OS error a write of this file system raised, kept for the report: DCP
        passes on only the message of torch's writer."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashing = _HashingStream(stream)
            try:
                yield hashing
            finally:
                if hashing.os_error is not None and self.os_error is None:
                    self.os_error = hashing.os_error
        self.sums[Path(path).name] = (hashing.crc, hashing.size)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        if Path(path).name in self.sums:
            self.sums[Path(new_path).name] = self.sums.pop(Path(path).name)


class ChecksummingWriter(FileSystemWriter):
    """DCP's FileSystemWriter, recording the checksum of each file it writes in ``sums``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self._hashing = HashingFileSystem()
        self.fs = self._hashing

    @property
    def sums(self) -> dict[str, Checksum]:
        return self._hashing.sums

    @property
    def os_error(self) -> OSError | None:
        """The first OS error one of this rank's DCP file writes raised, if any."""
        return self._hashing.os_error


def checksums_text(sums: dict[str, Checksum]) -> bytes:
    """What a ``checksums_rank<R>.json`` holds for files of checksums `sums`."""
    files = {name: {"crc32": crc, "bytes": size} for name, (crc, size) in sorted(sums.items())}
    return (json.dumps({"kind": CHECKSUM_KIND, "files": files}, indent=1) + "\n").encode()


def write_checksums(directory: Path, rank: int, sums: dict[str, Checksum]) -> None:
    """Write rank `rank`'s ``checksums_rank<R>.json`` (fsynced) into `directory`."""
    write_durable(directory / checksums_name(rank), checksums_text(sums))


def read_checksums(directory: Path, rank: int) -> tuple[dict[str, Checksum] | None, str | None]:
    """Rank `rank`'s recorded checksums in `directory` and None, or None and what is wrong."""
    name = checksums_name(rank)
    try:
        data = json.loads((directory / name).read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return None, f"{name} is missing (complete.json says every rank recorded checksums)"
    except (OSError, ValueError) as e:
        return None, f"{name} is unreadable ({type(e).__name__})"
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict) or data.get("kind") != CHECKSUM_KIND:
        return None, f"{name} is not a checksum file a save writes"
    sums: dict[str, Checksum] = {}
    for file, entry in files.items():
        crc = entry.get("crc32") if isinstance(entry, dict) else None
        size = entry.get("bytes") if isinstance(entry, dict) else None
        if not (isinstance(crc, int) and isinstance(size, int)):
            return None, f"{name}: the entry of {file!r} is not a crc32 and a length"
        sums[str(file)] = (crc, size)
    return sums, None


def write_rank_files(
    tmp: Path, rank: int, train_state_data: bytes, dcp_sums: dict[str, Checksum]
) -> None:
    """After this rank's DCP files: its train state, then the checksums of all it wrote."""
    name = train_state_name(rank)
    write_durable(tmp / name, train_state_data)
    write_checksums(tmp, rank, {**dcp_sums, name: checksum_of_bytes(train_state_data)})
