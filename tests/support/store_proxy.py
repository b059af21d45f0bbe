"""A fault-injecting HTTP proxy for a test's S3 server: a threaded TCP proxy on 127.0.0.1
that forwards every connection to the server and reads each request's line (method, path,
query) as it passes, so a test can make one kind of request stall, reset, answer 503
SlowDown or crawl, while the real client stack (s3fs, botocore) talks to it as to a store.

Requests are framed by their Content-Length or chunked body, so keep-alive connections
carrying several requests are judged request by request; responses are relayed as they
come (the clients never pipeline, so the bytes after a request belong to its response).
"""

from __future__ import annotations

import contextlib
import re
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

ACTIONS = ("stall", "reset", "503", "slow")

_SLOW_DOWN = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
    b"Content-Length: 118\r\n\r\n"
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


@dataclass
class Fault:
    """What to do to the requests that match: ``method`` ('' for any), ``path`` (a regular
    expression searched in the path, without the query) and ``query`` (a substring of it).

    ``action``: 'stall' (stop forwarding and answering until ``release`` or the client
    hangs up), 'reset' (end the connection with a TCP reset), '503' (answer SlowDown
    without forwarding) or 'slow' (forward at ``bytes_per_s``). ``after_bytes`` of the
    request (``side`` 'request') or of its response (``side`` 'response') pass first.
    ``times``: the first that many matches only (None: every one).
    """

    action: str
    method: str = ""
    path: str = ""
    query: str = ""
    side: str = "request"
    after_bytes: int = 0
    bytes_per_s: int = 64 << 10
    times: int | None = None
    hits: int = 0

    def __post_init__(self) -> None:
        assert self.action in ACTIONS, self.action
        assert self.side in ("request", "response"), self.side

    def matches(self, method: str, path: str, query: str) -> bool:
        if self.method and method != self.method:
            return False
        if self.query and self.query not in query:
            return False
        return not self.path or re.search(self.path, path) is not None


@dataclass
class Seen:
    """A request the proxy read: its line, and the fault applied to it ('' for none)."""

    method: str
    path: str
    query: str
    fault: str


@dataclass
class FaultProxy:
    """The proxy's endpoint, its faults and the requests it saw (see the module docstring)."""

    upstream: tuple[str, int]
    endpoint: str = ""
    seen: list[Seen] = field(default_factory=list)
    _faults: list[Fault] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _release: threading.Event = field(default_factory=threading.Event)
    _stopped: threading.Event = field(default_factory=threading.Event)
    _sockets: set[socket.socket] = field(default_factory=set)

    @contextlib.contextmanager
    def faults(self, *faults: Fault) -> Iterator[list[Fault]]:
        """Apply ``faults`` (the first that matches a request wins) for the block; stalled
        requests are released when it ends."""
        with self._lock:
            self._release.clear()
            self._faults = list(faults)
        try:
            yield self._faults
        finally:
            self.release()

    def release(self) -> None:
        """Drop every fault and let stalled requests go on."""
        with self._lock:
            self._faults = []
        self._release.set()

    def taken(self) -> list[Seen]:
        with self._lock:
            return list(self.seen)

    def _fault_for(self, method: str, path: str, query: str) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.matches(method, path, query) and (
                    fault.times is None or fault.hits < fault.times
                ):
                    fault.hits += 1
                    self.seen.append(Seen(method, path, query, fault.action))
                    return fault
            self.seen.append(Seen(method, path, query, ""))
        return None

    def serve(self) -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        self._sockets.add(listener)
        self.endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()
        self._release.set()
        for sock in list(self._sockets):
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                return
            _Connection(self, client).start()


class _Hangup(Exception):
    """The client or the server closed its side."""


class _Connection:
    """One client connection and its own connection to the server."""

    def __init__(self, proxy: FaultProxy, client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.server = socket.create_connection(proxy.upstream)
        proxy._sockets |= {client, self.server}
        self.closed = threading.Event()
        self.buffer = b""
        self.response_fault: Fault | None = None
        self.response_bytes = 0

    def start(self) -> None:
        threading.Thread(target=self._requests, daemon=True).start()
        threading.Thread(target=self._responses, daemon=True).start()

    def close(self, *, reset: bool = False) -> None:
        self.closed.set()
        for sock in (self.client, self.server):
            # shutdown first: it wakes the other thread's recv on this socket, which would
            # otherwise keep it open; a reset sends no FIN (SHUT_RD), only the RST of close.
            with contextlib.suppress(OSError):
                if reset:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.shutdown(socket.SHUT_RD if reset else socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()
            self.proxy._sockets.discard(sock)

    # --- client -> server, one request at a time ----------------------------------------

    def _requests(self) -> None:
        try:
            while not self.closed.is_set():
                self._one_request()
        except (_Hangup, OSError):
            pass
        self.close()

    def _read(self, at_least: int = 1) -> None:
        while len(self.buffer) < at_least:
            data = self.client.recv(1 << 16)
            if not data:
                raise _Hangup
            self.buffer += data

    def _take(self, n: int) -> bytes:
        self._read(n)
        data, self.buffer = self.buffer[:n], self.buffer[n:]
        return data

    def _line(self) -> bytes:
        while b"\r\n" not in self.buffer:
            self._read(len(self.buffer) + 1)
        at = self.buffer.index(b"\r\n") + 2
        return self._take(at)

    def _one_request(self) -> None:
        while b"\r\n\r\n" not in self.buffer:
            self._read(len(self.buffer) + 1)
        head = self._take(self.buffer.index(b"\r\n\r\n") + 4)
        method, target, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
        url = urlsplit(target)
        fault = self.proxy._fault_for(method, url.path, url.query)
        if fault is not None and fault.action == "503":
            self.client.sendall(_SLOW_DOWN)
            raise _Hangup
        if fault is not None and fault.side == "response":
            self.response_fault, self.response_bytes = fault, 0
            fault = None
        request = _Outgoing(self, fault)
        request.send(head)
        headers = head.decode("latin-1").lower()
        length = re.search(r"\r\ncontent-length:\s*(\d+)", headers)
        if re.search(r"\r\ntransfer-encoding:[^\r]*chunked", headers):
            while True:
                size_line = self._line()
                request.send(size_line)
                size = int(size_line.split(b";")[0].strip(), 16)
                if size == 0:
                    break
                request.send(self._take(size + 2))
            while (trailer := self._line()) != b"\r\n":
                request.send(trailer)
            request.send(trailer)
        elif length is not None:
            left = int(length.group(1))
            while left > 0:
                self._read()
                chunk = self._take(min(left, len(self.buffer)))
                request.send(chunk)
                left -= len(chunk)
        request.finish()

    # --- server -> client -----------------------------------------------------------------

    def _responses(self) -> None:
        try:
            while not self.closed.is_set():
                data = self.server.recv(1 << 16)
                if not data:
                    break
                self._relay(data)
        except (_Hangup, OSError):
            pass
        self.close()

    def _relay(self, data: bytes) -> None:
        fault = self.response_fault
        if fault is None:
            self.client.sendall(data)
            return
        passing = max(0, fault.after_bytes - self.response_bytes)
        self.response_bytes += len(data)
        if fault.action == "slow":
            _send_slowly(self.client, data, fault.bytes_per_s, self.closed)
            return
        if len(data) <= passing:
            self.client.sendall(data)
            return
        self.client.sendall(data[:passing])
        if fault.action == "reset":
            self.close(reset=True)
            raise _Hangup
        _stall(self)  # 'stall'
        self.response_fault = None
        self.client.sendall(data[passing:])


class _Outgoing:
    """The bytes of one request on their way to the server, through its fault (if any)."""

    def __init__(self, conn: _Connection, fault: Fault | None) -> None:
        self.conn = conn
        self.fault = fault
        self.sent = 0

    def send(self, data: bytes) -> None:
        fault = self.fault
        if fault is None:
            self.conn.server.sendall(data)
            return
        if fault.action == "slow":
            _send_slowly(self.conn.server, data, fault.bytes_per_s, self.conn.closed)
            return
        passing = max(0, fault.after_bytes - self.sent)
        self.sent += len(data)
        if len(data) <= passing:
            self.conn.server.sendall(data)
            return
        self.conn.server.sendall(data[:passing])
        if fault.action == "reset":
            self.conn.close(reset=True)
            raise _Hangup
        _stall(self.conn, watch_client=True)  # 'stall': the rest goes on once released
        self.fault = None
        self.conn.server.sendall(data[passing:])

    def finish(self) -> None:
        if self.fault is not None and self.fault.action == "stall":
            _stall(self.conn, watch_client=True)  # the whole request held, nothing sent
            self.fault = None


def _stall(conn: _Connection, *, watch_client: bool = False) -> None:
    """Hold a request or response until the proxy releases it; a client that hangs up
    meanwhile (its call abandoned) ends the connection, and nothing held is forwarded."""
    while True:
        released = conn.proxy._release.wait(0.05)
        if conn.closed.is_set():
            raise _Hangup
        if watch_client and _hung_up(conn):  # looked at once more when released
            conn.close()
            raise _Hangup
        if released:
            return


def _hung_up(conn: _Connection) -> bool:
    """Whether the client closed its connection; what it sent meanwhile is kept, in order,
    for when the stall ends."""
    try:
        conn.client.setblocking(False)
        try:
            data = conn.client.recv(1 << 16)
        finally:
            conn.client.setblocking(True)
    except BlockingIOError:
        return False
    except OSError:
        return True
    conn.buffer += data
    return data == b""


def _send_slowly(sock: socket.socket, data: bytes, rate: int, closed: threading.Event) -> None:
    step = max(1, rate // 20)
    for start in range(0, len(data), step):
        if closed.is_set():
            raise _Hangup
        sock.sendall(data[start : start + step])
        time.sleep(len(data[start : start + step]) / rate)


@contextlib.contextmanager
def fault_proxy(endpoint: str) -> Iterator[FaultProxy]:
    """A FaultProxy in front of the server at ``endpoint`` (an http URL with a host and a
    port), stopped on exit."""
    parts = urlsplit(endpoint)
    assert parts.hostname is not None and parts.port is not None
    proxy = FaultProxy((parts.hostname, parts.port))
    proxy.serve()
    try:
        yield proxy
    finally:
        proxy.stop()
