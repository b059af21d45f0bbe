"""Opening a store's fsspec filesystem: one per protocol and process, with bounded time.

A filesystem holds connections and an event loop that do not survive a fork, so each process
(every dataloader worker) opens its own on first use, and nothing here is pickled: objects
that read a store keep its URL and ask ``filesystem`` again. Credentials are whatever the
store's SDK finds in its standard environment variables and files; nothing here reads,
passes or logs them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

from kempnerforge.core.errors import DataError
from kempnerforge.storage.location import scheme_of

T = TypeVar("T")

CONNECT_TIMEOUT_S = 5
"""Seconds to open a connection: an unreachable endpoint fails in seconds, not minutes."""
READ_TIMEOUT_S = 30
"""Seconds a store may stay silent mid-request before the request counts as failed."""
ATTEMPTS = 3
"""Tries per request (the SDK's and s3fs's retries alike): a store's brief hiccup is ridden
out, a store that refuses or cannot be reached stops the run within a minute or so."""
S3_PROTOCOLS = ("s3", "s3a")
INSTALL_HINTS = {
    **dict.fromkeys(S3_PROTOCOLS, "pip install 'kempnerforge[s3]'"),
    **dict.fromkeys(("gs", "gcs"), "pip install 'kempnerforge[cloud]'"),
}
"""What to install for a protocol whose fsspec client is missing."""

_FILESYSTEMS: dict[tuple[int, str], Any] = {}


class StoreError(DataError):
    """A store could not be opened, reached or read: names the URL and the store's own error.

    A DataError, so the CLI prints its one line and exits with code 2; a config field that
    gave the URL is prefixed where the data is opened (DataPathError).
    """


def store_error(url: str, exc: BaseException) -> StoreError:
    """The StoreError for ``exc`` raised by the store while reading ``url``: the store's own
    words on one line (they never hold a credential, only its key id at most)."""
    text = " ".join(str(exc).split()) or "no message"
    return StoreError(
        f"{url}: the store failed ({type(exc).__name__}: {text}); check the URL, the store's "
        "credentials (its SDK's environment variables or files) and, for an S3-compatible "
        "store, AWS_ENDPOINT_URL"
    )


def store_options(protocol: str) -> dict[str, Any]:
    """Keyword arguments for the filesystem of ``protocol``: bounded timeouts and retries
    for S3 (the endpoint comes from AWS_ENDPOINT_URL, read by botocore itself), and no
    listing cache, so a directory written a moment ago is seen as it is."""
    if protocol in S3_PROTOCOLS:
        return {
            "use_listings_cache": False,
            "config_kwargs": {
                "connect_timeout": CONNECT_TIMEOUT_S,
                "read_timeout": READ_TIMEOUT_S,
                "retries": {"max_attempts": ATTEMPTS, "mode": "standard"},
            },
        }
    return {}


def filesystem(url: str) -> Any:
    """The fsspec filesystem of ``url``'s protocol for this process, opened on first use.

    A StoreError names the package to install when the protocol's client is missing.
    """
    protocol = scheme_of(url)
    if protocol is None:
        raise ValueError(f"{url} is a local path, not a URL")
    key = (os.getpid(), protocol)
    fs = _FILESYSTEMS.get(key)
    if fs is None:
        fs = _open(protocol, url)
        _FILESYSTEMS[key] = fs
    return fs


def forget_filesystems() -> None:
    """Drop this process's filesystems: the next use opens new ones, reading the store's
    environment (credentials, AWS_ENDPOINT_URL) afresh, e.g. after credentials rotated."""
    _FILESYSTEMS.clear()


def _open(protocol: str, url: str) -> Any:
    import fsspec

    try:
        cls = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as exc:
        hint = INSTALL_HINTS.get(protocol, "install it")
        raise StoreError(
            f"{url}: no client for {protocol}:// stores is installed ({exc}); {hint}"
        ) from None
    try:
        fs = cls(skip_instance_cache=True, **store_options(protocol))
    except Exception as exc:  # each client raises its own kinds for a bad environment
        raise store_error(url, exc) from None
    if protocol in S3_PROTOCOLS:
        fs.retries = ATTEMPTS  # s3fs's own retry loop, around the SDK's
    return fs


def store_call(url: str, action: Callable[[Any, str], T]) -> T:
    """``action(filesystem, path in the store)`` for ``url``; any failure of the store (each
    client raises its own kinds: OSError, botocore's, aiohttp's) comes out as StoreError."""
    fs = filesystem(url)
    try:
        return action(fs, fs._strip_protocol(url))
    except StoreError:
        raise
    except Exception as exc:
        raise store_error(url, exc) from None
