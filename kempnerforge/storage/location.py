"""Telling an object-store URL from a local path, and naming objects under a URL."""

from __future__ import annotations

import re
from pathlib import Path

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
LOCAL_SCHEME = "file"


def scheme_of(path: str) -> str | None:
    """The protocol of ``path`` ('s3', 'gs', 'file', ...) in lower case, or None for a path.

    A URL is anything starting with ``scheme://``; a local name such as ``s3:`` (without the
    slashes) stays a path, as the filesystem itself would read it.
    """
    match = _SCHEME.match(path)
    return match[1].lower() if match else None


def is_url(path: str) -> bool:
    """Whether ``path`` names an object in a store (``file://`` included), not a local path."""
    return scheme_of(path) is not None


def is_store_url(path: str) -> bool:
    """Whether ``path`` is a URL of a store other than the local filesystem (``file://``)."""
    scheme = scheme_of(path)
    return scheme is not None and scheme != LOCAL_SCHEME


def local_path(path: str) -> str:
    """``path`` with a ``file://`` prefix removed: such a URL is read as the local path it
    names (memory-mapped), like a plain path."""
    if scheme_of(path) == LOCAL_SCHEME:
        return path[len(LOCAL_SCHEME) + 3 :] or "/"
    return path


def join(base: str, name: str) -> str:
    """``name`` inside ``base``: a key below a URL (joined with '/'), or a local path."""
    if is_url(base):
        return base.rstrip("/") + "/" + name
    return str(Path(base) / name)


def base_name(path: str) -> str:
    """The last component of a path or URL (ignoring a trailing '/')."""
    return path.rstrip("/").rsplit("/", 1)[-1]
