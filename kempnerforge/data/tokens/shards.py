"""Sharded prepared directories: ``DIR/shard-00003-of-00016/`` each a complete prepared
directory, written by its own prepare-data process and read back as one corpus in shard order.

A directory with a meta.json at its top is a plain prepared directory; one without, holding
``shard-I-of-N`` directories, is sharded. A shard is complete exactly when its meta.json
exists, and a sharded corpus is readable exactly when all N shards are complete and agree.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kempnerforge.core.errors import DataError
from kempnerforge.data.tokens.output_dir import check_output_dir
from kempnerforge.data.tokens.token_file import (
    MAX_ID_KEY,
    META_FILE,
    TOKENS_FILE,
    check_tokens_file,
    read_meta,
)
from kempnerforge.data.tokens.token_flags import MASKED_KEY, PACKED_COUNTS
from kempnerforge.storage.files import is_dir, names_in, size_of
from kempnerforge.storage.location import join

T = TypeVar("T")
_SHARD_NAME = re.compile(r"shard-(\d{5,})-of-(\d{5,})")
# What every shard of one corpus must share: they are read as one token stream.
AGREED_KEYS = (
    "format_version",
    "tokenizer",
    "dtype",
    "vocab_size",
    "eos_id",
    "bos_id",
    "bos_per_document",
    MASKED_KEY,  # read as one stream, the shards all have token_flags.bin or none do
    "format",
    "packed_seq_len",  # one window layout (absent: unpacked): a window may span shards
)
_SUMMED_KEYS = ("num_tokens", "num_documents", "sources")
_NAMES_SHOWN = 4


def shard_name(index: int, count: int) -> str:
    """The directory name of shard ``index`` of ``count``: shard-00003-of-00016."""
    return f"shard-{index:05d}-of-{count:05d}"


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count``: the part of a corpus one prepare-data process writes."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1:
            raise DataError(f"--num-shards {self.count}: expected an integer >= 1")
        if not 0 <= self.index < self.count:
            raise DataError(
                f"--shard-index {self.index}: expected an integer in [0, {self.count}) "
                f"for --num-shards {self.count}"
            )

    @property
    def name(self) -> str:
        return shard_name(self.index, self.count)

    def take(self, items: Sequence[T]) -> list[T]:
        """This shard's contiguous block of ``items``; the blocks of shards 0..count-1, in
        order, are ``items`` exactly, and their sizes differ by at most one."""
        n = len(items)
        return list(items[self.index * n // self.count : (self.index + 1) * n // self.count])


def _parse(name: str) -> tuple[int, int] | None:
    """(index, count) of a shard directory name, or None for any other name."""
    match = _SHARD_NAME.fullmatch(name)
    if match is None:
        return None
    index, count = int(match[1]), int(match[2])
    if index >= count or name != shard_name(index, count):
        return None
    return index, count


def _shards_present(data_dir: str) -> dict[int, set[int]]:
    """Shard count -> indices of the entries of ``data_dir`` named like shards of it (one
    listing in a store)."""
    present: dict[int, set[int]] = {}
    for name in names_in(data_dir):
        parsed = _parse(name)
        if parsed is not None:
            present.setdefault(parsed[1], set()).add(parsed[0])
    return present


def is_sharded(data_dir: str) -> bool:
    """Whether ``data_dir`` is a sharded directory: no meta.json of its own, shards inside."""
    return (
        size_of(join(data_dir, META_FILE)) is None
        and is_dir(data_dir)
        and bool(_shards_present(data_dir))
    )


def _shown(names: Sequence[str]) -> str:
    more = len(names) - _NAMES_SHOWN
    return ", ".join(names[:_NAMES_SHOWN]) + (f" and {more} more" if more > 0 else "")


def read_shards(data_dir: str) -> list[tuple[str, dict[str, Any]]]:
    """(directory, meta.json) of every shard of sharded ``data_dir``, in shard order.

    Each shard's meta.json is read and its tokens.bin size checked: O(shards) small reads,
    no tokens read. Refused, naming the shards: two shard counts in one directory, a shard
    missing or without meta.json, or shards that disagree on an AGREED_KEYS field.
    """
    present = _shards_present(data_dir)
    if not present:
        raise DataError(f"{data_dir} holds no shard-I-of-N directories: it is not sharded")
    if len(present) > 1:
        counts = ", ".join(str(count) for count in sorted(present))
        raise DataError(
            f"{data_dir} holds shards of corpora of {counts} shards: one directory holds one "
            "corpus, written with one --num-shards; remove the shards of the others"
        )
    ((count, indices),) = present.items()
    missing, incomplete = [], []
    for index in range(count):
        if index not in indices:
            missing.append(shard_name(index, count))
        elif size_of(join(join(data_dir, shard_name(index, count)), META_FILE)) is None:
            incomplete.append(shard_name(index, count))
    if missing or incomplete:
        problems = []
        if missing:
            problems.append(f"{len(missing)} missing ({_shown(missing)})")
        if incomplete:
            problems.append(f"{len(incomplete)} without meta.json ({_shown(incomplete)})")
        raise DataError(
            f"{data_dir}: a corpus of {count} shards with {' and '.join(problems)}; a shard is "
            f"complete once its `prepare-data --shard-index I --num-shards {count}` has "
            "finished: wait for those still running, or run the others again"
        )
    shards = []
    for index in range(count):
        shard_dir = join(data_dir, shard_name(index, count))
        meta = read_meta(shard_dir)
        check_tokens_file(shard_dir, meta)
        shards.append((shard_dir, meta))
    _check_agreement(shards)
    return shards


def _check_agreement(shards: list[tuple[str, dict[str, Any]]]) -> None:
    first_dir, first = shards[0]
    for shard_dir, meta in shards[1:]:
        for key in AGREED_KEYS:
            value, first_value = meta.get(key), first.get(key)
            if value != first_value:
                raise DataError(
                    f"{shard_dir}: {key} {value!r}, but {first_value!r} in {first_dir}: the "
                    "shards of a corpus are read as one stream and must be prepared with the "
                    "same tokenizer and options; prepare this shard again like the others"
                )


def corpus_meta(shards: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """What a sharded corpus is as a whole: the fields its shards share, the counts summed,
    the largest id and document (when every shard records them) and ``num_shards``."""
    metas = [meta for _, meta in shards]
    corpus = {key: metas[0].get(key) for key in AGREED_KEYS}
    for key in _SUMMED_KEYS:
        corpus[key] = sum(int(meta[key]) for meta in metas)
    if all(MAX_ID_KEY in meta for meta in metas):
        corpus[MAX_ID_KEY] = max(int(meta[MAX_ID_KEY]) for meta in metas)
    # Known for the corpus only when known for every shard (None in older ones).
    assistant = [meta["assistant_tokens"] for meta in metas]
    corpus["assistant_tokens"] = None if None in assistant else sum(assistant)
    longest = [meta["max_document_tokens"] for meta in metas]
    corpus["max_document_tokens"] = None if None in longest else max(longest)
    for key in PACKED_COUNTS:
        if all(key in meta for meta in metas):
            corpus[key] = sum(int(meta[key]) for meta in metas)
    corpus["num_shards"] = len(metas)
    return corpus


def read_parts(data_dir: str) -> tuple[dict[str, Any], list[tuple[str, dict[str, Any]]]]:
    """What the prepared directory ``data_dir`` is as a whole (its meta.json, or corpus_meta
    of its shards), and (directory, meta.json) of each part in stream order: the directory
    itself, or each of its shards. Sizes are checked; no tokens are read."""
    if is_sharded(data_dir):
        shards = read_shards(data_dir)
        return corpus_meta(shards), shards
    meta = read_meta(data_dir)
    check_tokens_file(data_dir, meta)
    return meta, [(data_dir, meta)]


def prepared_dirs(data_dir: str) -> list[str]:
    """The prepared directories of ``data_dir``: itself, or each of its shards once all are
    complete and agree."""
    if is_sharded(data_dir):
        return [shard_dir for shard_dir, _ in read_shards(data_dir)]
    return [data_dir]


def check_shard_output(output_dir: str, shard: Shard, option: str) -> str:
    """The directory ``shard`` is written to under ``output_dir``, after checking that
    ``output_dir`` holds nothing but shards of the same count (other shards may be being
    written at this moment by other processes).

    A plain corpus there, shards of another count, or other files are refused, naming
    ``option``; so is a shard directory that is not one prepare-data wrote.
    """
    if not is_dir(output_dir):
        check_output_dir(output_dir, option)  # a file, or a path below one
    else:
        names = sorted(names_in(output_dir))
        if TOKENS_FILE in names or META_FILE in names:
            raise DataError(
                f"{option} {output_dir} holds an unsharded corpus ({META_FILE}, {TOKENS_FILE}); "
                "write the shards into another directory, or remove it"
            )
        others = [n for n in names if (p := _parse(n)) is not None and p[1] != shard.count]
        if others:
            raise DataError(
                f"{option} {output_dir} holds shards of another shard count ({_shown(others)}); "
                f"shard {shard.index} of {shard.count} would mix two corpora: remove them or "
                "name another directory"
            )
        foreign = [n for n in names if _parse(n) is None]
        if foreign:
            raise DataError(
                f"{option} {output_dir} is a directory holding other files ({_shown(foreign)}), "
                "not a sharded prepared directory; name a new or empty directory, or the one "
                "these shards were written into before"
            )
    shard_dir = join(output_dir, shard.name)
    check_output_dir(shard_dir, option)
    return shard_dir


def check_unsharded_output(output_dir: str, option: str) -> None:
    """An unsharded corpus is not written over shards: the reader would take the corpus and
    silently ignore them, and the shards' writers would find a corpus in their way."""
    if not is_dir(output_dir):
        return
    names = sorted(name for name in names_in(output_dir) if _parse(name) is not None)
    if names:
        raise DataError(
            f"{option} {output_dir} holds the shards of a sharded corpus ({_shown(names)}); "
            "pass --shard-index and --num-shards to write one of them, or name another "
            "directory for an unsharded corpus"
        )
