"""Opening a store's fsspec filesystem (one per protocol and process) and calling it, each
call ended by a deadline (deadlines.py).

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
from kempnerforge.storage.deadlines import Deadline, DeadlinePassed, call_by
from kempnerforge.storage.location import scheme_of

T = TypeVar("T")

CALL_DEADLINE_S = 120.0
"""Seconds any call to any store may take, its tries included, unless its caller sets
another deadline (checkpoint.store_timeout_s for checkpoints): past it the call is
cancelled (an asynchronous client) or abandoned (a synchronous one) and fails."""
CALL_DEADLINE = "the store call limit"
"""How an error names CALL_DEADLINE_S."""
CONNECT_TIMEOUT_S = 5
"""S3: seconds to open a connection, so an unreachable endpoint fails in seconds."""
READ_TIMEOUT_S = 30
"""S3: seconds a store may stay silent mid-request before the request counts as failed."""
ATTEMPTS = 3
"""S3: tries per request by botocore, and tries of s3fs's own loop around them for the
errors it retries (resets, timeouts, SlowDown): at most 9 sends of one request, all within
the call's deadline."""
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


class StoreTimeout(StoreError):
    """A store call ran past its deadline (the store stalled or is too slow)."""


def store_timeout(url: str, deadline: Deadline) -> StoreTimeout:
    """The StoreTimeout of a call to ``url`` that ran past ``deadline``."""
    return StoreTimeout(
        f"{url}: the store did not answer within {deadline.describe()} (it stalled or is "
        "too slow); check the store's health, or raise the limit for a slow store"
    )


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
        if protocol in S3_PROTOCOLS:
            fs.retries = ATTEMPTS  # s3fs's own retry loop, around the SDK's
            # The client is made now (credentials found, its models loaded: up to a second
            # of CPU), not inside the first call's deadline.
            fs.connect()
    except Exception as exc:  # each client raises its own kinds for a bad environment
        raise store_error(url, exc) from None
    return fs


def store_call(url: str, action: Callable[[Any, str], T], *, deadline: Deadline | None = None) -> T:
    """``action(filesystem, path in the store)`` for ``url``, ended by ``deadline`` (by
    default CALL_DEADLINE_S from now; deadlines.call_by); any failure of the store (each
    client raises its own kinds: OSError, botocore's, aiohttp's) comes out as StoreError,
    a call past its deadline as StoreTimeout."""
    fs = filesystem(url)
    deadline = deadline or Deadline(CALL_DEADLINE_S, CALL_DEADLINE)
    try:
        return call_by(deadline, fs, lambda bounded: action(bounded, fs._strip_protocol(url)))
    except StoreError:
        raise
    except Exception as exc:
        from fsspec.exceptions import FSTimeoutError  # fsspec is imported by then

        if isinstance(exc, DeadlinePassed | FSTimeoutError) or deadline.passed():
            raise store_timeout(url, deadline) from None
        raise store_error(url, exc) from None
