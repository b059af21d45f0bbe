"""The built-in corpus: this interpreter's standard library source, prepared once and cached.

It lets `kempnerforge train` run with no data configured and nothing downloaded: about 30 MB
of Python, split by file into train and held-out directories.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import re
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

from kempnerforge.core.errors import DataError
from kempnerforge.core.logging import get_logger
from kempnerforge.data.prepare import write_corpus
from kempnerforge.data.tokenizer import Tokenizer
from kempnerforge.data.tokens import is_complete

logger = get_logger(__name__)

_EXCLUDED_PARTS = frozenset({"site-packages", "dist-packages"})


def default_cache_dir() -> str:
    """$KEMPNERFORGE_CACHE, else ~/.cache/kempnerforge."""
    return os.environ.get("KEMPNERFORGE_CACHE") or str(Path.home() / ".cache" / "kempnerforge")


def stdlib_dir() -> str:
    """Where the running interpreter's standard library lives."""
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str) -> list[Path]:
    """Every ``*.py`` under ``root``, sorted by relative path, leaving out installed
    third-party packages.

    Every run on the built-in corpus (every rank of it) lists these to find its cache
    entry, so the walk never enters site-packages, which can hold many times the standard
    library's files, and reads each directory once with os.scandir, whose entries know
    their type without a stat: about a third of os.walk's time over the ~1,800 files. It
    lists what os.walk lists: directories that are symbolic links are not entered, files
    that are links to files count, unreadable directories are skipped.
    """
    found: list[tuple[str, Path]] = []
    pending = [(root, "")]
    while pending:
        directory, prefix = pending.pop()
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            try:
                is_dir = entry.is_dir()
            except OSError:
                continue
            if is_dir:
                if entry.name not in _EXCLUDED_PARTS and not entry.is_symlink():
                    pending.append((entry.path, f"{prefix}{entry.name}/"))
            elif entry.name.endswith(".py") and entry.is_file():
                found.append((prefix + entry.name, Path(entry.path)))
    return [path for _, path in sorted(found)]


def _cache_key(
    root: str, files: list[Path], tokenizer: Tokenizer, eval_fraction: float, bos: bool
) -> str:
    """Directory name that changes whenever the files, the tokenizer, the split or the BOS
    choice would."""
    digest = hashlib.sha256()
    digest.update(f"{platform.python_version()}\0{eval_fraction!r}\0".encode())
    if bos:  # only then, so caches prepared before the option existed stay valid
        digest.update(b"bos\0")
    for path in files:
        digest.update(f"{path.relative_to(root).as_posix()}\0{path.stat().st_size}\0".encode())
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    identity = re.sub(r"[^A-Za-z0-9._-]", "-", tokenizer.identity)
    return f"stdlib-py{version}-{identity}-{digest.hexdigest()[:12]}"


def _read_sources(files: list[Path], skipped: list[str]) -> Iterator[tuple[str, list[str]]]:
    """One document per file; files that are not UTF-8 (a few encoding tests) are skipped."""
    for path in files:
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            skipped.append(str(path))
            yield str(path), []
            continue
        yield str(path), [text]


def builtin_corpus(
    cache_dir: str, tokenizer: Tokenizer, eval_fraction: float, bos_per_document: bool = False
) -> tuple[str, str]:
    """Train and eval directories of the built-in corpus, preparing them on first use.

    With ``bos_per_document`` every document starts with the tokenizer's BOS (a separate
    cache entry).

    Safe when several processes call it at once: one prepares under a lock, the others wait
    and reuse its result. The eval directory is "" when ``eval_fraction`` is 0.
    """
    root = stdlib_dir()
    files = stdlib_files(root)
    key = _cache_key(root, files, tokenizer, eval_fraction, bos_per_document)
    base = Path(cache_dir).expanduser() / key
    train_dir = str(base / "train")
    eval_dir = str(base / "eval") if eval_fraction > 0 else ""
    if _ready(train_dir, eval_dir):
        logger.info("using the cached built-in corpus at %s", base)
        return train_dir, eval_dir
    try:
        base.mkdir(parents=True, exist_ok=True)
        lock = open(base.parent / f"{key}.lock", "w")  # noqa: SIM115 (closed by the with below)
    except OSError as exc:
        raise DataError(
            f"{base}: cannot create the built-in corpus cache ({exc.strerror}); set "
            "data.cache_dir or $KEMPNERFORGE_CACHE to a writable directory"
        ) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _ready(train_dir, eval_dir):  # another process prepared it while we waited
            logger.info("using the built-in corpus another process prepared at %s", base)
            return train_dir, eval_dir
        _prepare(root, files, tokenizer, eval_fraction, bos_per_document, train_dir, eval_dir)
    return train_dir, eval_dir


def _ready(train_dir: str, eval_dir: str) -> bool:
    return is_complete(train_dir) and (not eval_dir or is_complete(eval_dir))


def _prepare(
    root: str,
    files: list[Path],
    tokenizer: Tokenizer,
    eval_fraction: float,
    bos_per_document: bool,
    train_dir: str,
    eval_dir: str,
) -> None:
    size_mb = sum(p.stat().st_size for p in files) / 1e6
    logger.info(
        "preparing the built-in corpus (first use): %d files, %.1f MB of Python from %s "
        "into %s; done once, then reused from the cache",
        len(files),
        size_mb,
        root,
        Path(train_dir).parent,
    )
    start = time.monotonic()
    skipped: list[str] = []
    meta = write_corpus(
        _read_sources(files, skipped),
        len(files),
        train_dir,
        tokenizer,
        eval_fraction=eval_fraction,
        eval_output_dir=eval_dir or None,
        bos_per_document=bos_per_document,
    )
    if skipped:
        logger.info("skipped %d files that are not UTF-8: %s", len(skipped), ", ".join(skipped))
    source = {"root": root, "files": len(files), "skipped": len(skipped)}
    (Path(train_dir).parent / "source.json").write_text(json.dumps(source, indent=2) + "\n")
    logger.info(
        "built-in corpus ready in %.1f s: %s train tokens in %s documents",
        time.monotonic() - start,
        f"{meta['num_tokens']:,}",
        f"{meta['num_documents']:,}",
    )
