"""Is a checkpoint whole? One pass split over the ranks that read it; no tensor is decoded.

Every rank reads the two shared files (the marker and DCP's .metadata, which it needs to
load anyway) and checks only the files it reads itself: the train state it loads and its
share of the DCP files (those written by the ranks ``w`` with ``w % world_size == rank``:
its own when the world size is unchanged). Rank 0 also checks .metadata's checksum. So a
rank opens O(1) files plus its share, whatever the world size, and the ranks' verdicts are
agreed in one small collective by the caller. ``checkpoint_problems`` runs every share in
one process (tools, tests).

A file's checks: it exists and is as long as .metadata says; each DCP item starts and ends
like the ``torch.save`` zip it must be (a shard overwritten with zeros); and, for a
checkpoint whose marker says it holds checksums, the whole file's CRC-32 matches the one
its writer recorded (a flipped bit inside a tensor). Older checkpoints have no checksums:
they are checked without them, and the first check of one says so.
"""

from __future__ import annotations

import os
import re
import struct
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from torch.distributed.checkpoint.metadata import Metadata

from kempnerforge.checkpoint.checksums import (
    Checksum,
    checksum_of_bytes,
    checksum_of_file,
    checksums_name,
    describe,
    read_checksums,
)
from kempnerforge.checkpoint.dcp_metadata import parse_dcp_metadata
from kempnerforge.checkpoint.disk_format import (
    CHECKSUM_KIND,
    DCP_METADATA,
    load_marker,
    train_state_name,
)
from kempnerforge.core.logging import get_logger

logger = get_logger(__name__)

_DCP_FILE = re.compile(r"__(\d+)_\d+\.distcp")
"""A file DCP's writer names after the rank that wrote it: ``__<rank>_<n>.distcp``."""
_LOCAL_HEADER = b"PK\x03\x04"
_CENTRAL_HEADER = b"PK\x01\x02"
_END_RECORD = b"PK\x05\x06"
_END_RECORD_SIZE = 22
_MAX_ZIP_COMMENT = 0xFFFF
_ZIP64_SENTINEL = 0xFFFFFFFF
"""An end record's central-directory offset when the real one is in the zip64 record."""
_unverified: set[str] = set()


class _Problem(Exception):
    """The first thing found wrong; the check stops there."""


def share_problems(path: Path, rank: int, world_size: int) -> list[str]:
    """What keeps `path` from being complete, as rank `rank` of `world_size` reads it.

    Empty when this rank's share is whole; else one line naming the file. Every rank of a
    job calls it at once and the verdicts are agreed (Coordinator.first_failure).
    """
    return _first_problem(path, [rank], world_size)


def share_files(path: Path, rank: int, world_size: int) -> list[str]:
    """The files share_problems reads for rank `rank` besides the marker and .metadata,
    read from `path` (empty when either is unreadable: the check then says why). For a
    checkpoint in a store, what the rank fetches before its check: its own share only."""
    marker, _ = load_marker(path)
    try:
        _, metadata = _read_metadata(path)
    except _Problem:
        return []
    if marker is None:
        return []
    writers = {train_state_source(rank, marker["world_size"])}
    names = {train_state_name(w) for w in writers}
    if rank == 0:
        writers.add(0)  # .metadata's checksum
    spans = _spans_by_file(metadata)
    for index, name in enumerate(sorted(spans)):
        writer = _dcp_file_writer(name, index)
        if writer % world_size == rank:
            names.add(name)
            writers.add(writer)
    if marker.get("checksums") == CHECKSUM_KIND:
        names |= {checksums_name(w) for w in writers}
    return sorted(names)


def checkpoint_problems(path: Path) -> list[str]:
    """What keeps `path` from being a complete checkpoint, every rank's share checked here."""
    return _first_problem(path, None, None)


def _dcp_file_writer(name: str, index: int) -> int:
    """The rank that wrote DCP file `name`, the `index`-th in name order (the index for a
    name DCP's writer does not give)."""
    match = _DCP_FILE.fullmatch(name)
    return int(match.group(1)) if match else index


def train_state_source(rank: int, saved_world_size: int) -> int:
    """Whose train state rank `rank` loads: its own, or rank 0's when the saving run had
    fewer ranks."""
    return rank if rank < saved_world_size else 0


def _first_problem(path: Path, ranks: Sequence[int] | None, world_size: int | None) -> list[str]:
    try:
        _check(path, ranks, world_size)
    except _Problem as problem:
        return [str(problem)]
    return []


def _check(path: Path, ranks: Sequence[int] | None, world_size: int | None) -> None:
    """Raise _Problem at the first thing wrong in the shares of `ranks` (all when None)."""
    if not path.is_dir():
        raise _Problem("the directory does not exist")
    marker, marker_problem = load_marker(path)
    if marker is None:
        raise _Problem(str(marker_problem))
    metadata_bytes, metadata = _read_metadata(path)
    saved = marker["world_size"]
    if ranks is None:
        ranks = range(saved)
    world = saved if world_size is None else world_size
    sums = _Recorded(path) if marker.get("checksums") == CHECKSUM_KIND else None
    if sums is None and 0 in ranks and str(path) not in _unverified:
        _unverified.add(str(path))
        logger.info(
            "%s holds no checksums (saved by an older version): its files are checked for "
            "length and structure only",
            path,
        )
    for source in sorted({train_state_source(r, saved) for r in ranks}):
        _check_train_state(path, source, saved, sums)
    if 0 in ranks and sums is not None:
        sums.match(DCP_METADATA, checksum_of_bytes(metadata_bytes), writer=0)
    spans = _spans_by_file(metadata)
    for index, name in enumerate(sorted(spans)):
        writer = _dcp_file_writer(name, index)
        if writer % world in ranks:
            _check_dcp_file(path / name, spans[name], writer, sums)


def _read_metadata(path: Path) -> tuple[bytes, Metadata]:
    try:
        data = (path / DCP_METADATA).read_bytes()
    except FileNotFoundError:
        raise _Problem(f"{DCP_METADATA} (DCP) is missing") from None
    except OSError as e:
        raise _Problem(f"{DCP_METADATA} (DCP) is unreadable: {e}") from None
    try:
        return data, parse_dcp_metadata(data)
    except Exception as e:
        raise _Problem(f"{DCP_METADATA} (DCP) is unreadable: {e}") from None


class _Recorded:
    """The checksums the writers of a checkpoint recorded, read per writer when first asked."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._by_writer: dict[int, dict[str, Checksum]] = {}

    def match(self, name: str, actual: Checksum, *, writer: int) -> None:
        """Raise _Problem unless file `name`, written by rank `writer`, has checksum `actual`."""
        if writer not in self._by_writer:
            sums, problem = read_checksums(self.path, writer)
            if sums is None:
                raise _Problem(str(problem))
            self._by_writer[writer] = sums
        expected = self._by_writer[writer].get(name)
        if expected is None:
            raise _Problem(f"{name} has no checksum in {checksums_name(writer)}")
        if expected != actual:
            raise _Problem(
                f"{name} does not match its checksum in {checksums_name(writer)} "
                f"({describe(actual)} read, {describe(expected)} written): its bytes "
                "changed after the save (a disk or transfer error?)"
            )


def _check_train_state(path: Path, rank: int, saved: int, sums: _Recorded | None) -> None:
    name = train_state_name(rank)
    problem = _Problem(f"{name} is missing or truncated (complete.json says {saved} ranks saved)")
    try:
        with open(path / name, "rb") as f:
            if not zipfile.is_zipfile(f):
                raise problem
            if sums is not None:
                f.seek(0)
                sums.match(name, checksum_of_file(f), writer=rank)
    except OSError:
        raise problem from None


def _spans_by_file(metadata: Metadata) -> dict[str, list[tuple[int, int]]]:
    """(offset, length) of each checkable item, by the DCP file that holds it."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for info in (metadata.storage_data or {}).values():
        # A storage transform (compression, ...) changes the stored bytes: no zip to see.
        # A save of ours never uses one, so this only passes foreign items unchecked.
        items = spans.setdefault(info.relative_path, [])
        if not getattr(info, "transform_descriptors", None):
            items.append((info.offset, info.length))
    return spans


def _check_dcp_file(
    file: Path, spans: list[tuple[int, int]], writer: int, sums: _Recorded | None
) -> None:
    """One DCP file: present, long enough, each item a zip record, the checksum right."""
    name = file.name
    needed = max((offset + length for offset, length in spans), default=0)
    try:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < needed:
                raise _Problem(f"{name} (DCP) is truncated ({size} of {needed} bytes)")
            for offset, length in sorted(spans):
                broken = _zip_record_problem(f, offset, length)
                if broken:
                    raise _Problem(f"{name} (DCP) is corrupt: the item at byte {offset} {broken}")
            if sums is not None:
                f.seek(0)
                sums.match(name, checksum_of_file(f), writer=writer)
    except FileNotFoundError:
        raise _Problem(f"{name} (DCP) is missing") from None
    except OSError as e:
        raise _Problem(f"{name} (DCP) is unreadable ({type(e).__name__}: {e})") from None


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
