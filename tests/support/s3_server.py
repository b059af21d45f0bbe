"""A real S3 server for tests: moto's threaded server on a free local port, reached through
the real client stack (s3fs, botocore) by the standard environment variables, with a log of
the requests it answered (to count what opening a corpus reads)."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}


@dataclass
class Request:
    method: str
    path: str  # "/bucket/key", without the query
    query: str
    range: str  # the Range header, "" when absent


@dataclass
class S3Server:
    """A running moto server: its endpoint and every request it answered since ``clear``."""

    endpoint: str
    requests: list[Request] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    fault: tuple[str, str] | None = None
    """(path fragment, 'refuse' or 'stall') while a test has writes fail (faulting)."""
    released: threading.Event = field(default_factory=threading.Event)

    def environment(self, home: str) -> dict[str, str]:
        """The variables a process needs to reach this server with the credentials it
        accepts, and no other AWS configuration (files under ``home`` that do not exist,
        no instance metadata lookups)."""
        return {
            **CREDENTIALS,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": f"{home}/no-aws-config",
            "AWS_SHARED_CREDENTIALS_FILE": f"{home}/no-aws-credentials",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def record(self, environ: dict[str, Any]) -> None:
        with self._lock:
            self.requests.append(
                Request(
                    environ.get("REQUEST_METHOD", ""),
                    environ.get("PATH_INFO", ""),
                    environ.get("QUERY_STRING", ""),
                    environ.get("HTTP_RANGE", ""),
                )
            )

    def fault_for(self, environ: dict[str, Any]) -> str | None:
        """'stall' or 'refuse' for a write whose path holds the fragment faulting() set."""
        fault = self.fault
        if fault is None or environ.get("REQUEST_METHOD") not in ("PUT", "POST"):
            return None
        return fault[1] if fault[0] in environ.get("PATH_INFO", "") else None

    @contextmanager
    def faulting(self, fragment: str, kind: str) -> Iterator[None]:
        """Writes (PUT, POST) to paths holding ``fragment`` are refused (403 AccessDenied,
        kind 'refuse') or never answered until the block ends (kind 'stall')."""
        self.released.clear()
        self.fault = (fragment, kind)
        try:
            yield
        finally:
            self.fault = None
            self.released.set()

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()

    def taken(self) -> list[Request]:
        with self._lock:
            return list(self.requests)

    @contextmanager
    def refusing_credentials(self) -> Iterator[None]:
        """Check every request's signature against the server's IAM users (it has none):
        the test credentials are refused, as wrong keys are by a real store."""
        from moto import settings

        saved = settings.INITIAL_NO_AUTH_ACTION_COUNT
        settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
        try:
            yield
        finally:
            settings.INITIAL_NO_AUTH_ACTION_COUNT = saved


_REFUSED = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
    b"<Message>Access Denied</Message></Error>"
)


def _counting(app: Callable[..., Any], server: S3Server) -> Callable[..., Any]:
    def counted(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        server.record(environ)
        fault = server.fault_for(environ)
        if fault == "stall":
            server.released.wait()  # a store that accepted the request and went silent
        elif fault == "refuse":
            start_response("403 Forbidden", [("Content-Type", "application/xml")])
            return [_REFUSED]
        return app(environ, start_response)

    return counted


@contextmanager
def s3_server() -> Iterator[S3Server]:
    """Start moto's S3 server on a free port of 127.0.0.1; stopped on exit."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    server = S3Server(endpoint=f"http://{host}:{port}")
    wsgi = moto._server  # the werkzeug server; it reads .app on every request
    assert wsgi is not None
    wsgi.app = _counting(wsgi.app, server)
    try:
        yield server
    finally:
        moto.stop()


def new_bucket_name() -> str:
    """A bucket name no other test uses (lower-case letters, digits and '-')."""
    return f"kf-{uuid.uuid4().hex[:12]}"
