"""Tests and CI send traffic only to this machine: no test file, fixture, support file or
CI script names an address other than a loopback one (or an unspecified one to bind).

Every text file under tests/ and .ci/ is scanned for what
would be an address: IPv4 and IPv6 literals, the host of a URL (http, https, tcp, ws,
grpc), the host of a socket address tuple or a ``host=``-like keyword, and the value of an
address setting (NodeAddr, SlurmctldHost, MASTER_ADDR, --rdzv_endpoint, AWS_ENDPOINT_URL,
TORCHFT_LIGHTHOUSE, ...). A name that is not loopback is allowed only as an entry of
EXCEPTIONS, with the reason no traffic goes there. Hosts made at run time (an f-string's
``{host}``, ``socket.gethostname()``) are this machine's and are not literals.
"""

from __future__ import annotations

import io
import ipaddress
import pathlib
import re
import tokenize

import pytest

REPO = pathlib.Path(__file__).parents[2]
SCANNED = ("tests", ".ci")
LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}
UNSPECIFIED = {"", "0.0.0.0", "::", "*"}
"""Bind addresses (every interface of this machine), never a destination."""

EXCEPTIONS: dict[tuple[str, str], str] = {
    ("tests/unit/test_replica_store_host.py", "10.1.2.3"): (
        "a value given to advertised_host, which only rewrites a name: nothing connects"
    ),
    ("tests/unit/test_replica_store_host.py", "fe80::1"): (
        "a value given to advertised_host, which only rewrites a name: nothing connects"
    ),
}
"""(file, name) pairs that are not loopback yet send nothing anywhere, with the reason."""

IPV4 = re.compile(r"(?<![\w.])(\d{1,3}(?:\.\d{1,3}){3})(?![\w.])")
IPV6 = re.compile(r"(?<![\w:.])((?:[0-9A-Fa-f]{1,4})?(?::[0-9A-Fa-f]{0,4}){2,7})(?![\w:])")
URL = re.compile(r"\b(?:https?|tcp|wss?|grpc)://(\[[^\]]*\]|[^/:\s\"'`{}()\[\]]+)")
SOCKET_CALL = re.compile(
    r"\b(?:bind|connect|connect_ex|create_connection|sendto|getaddrinfo|TCPStore)\(\s*\(?\s*"
    r"([\"'])(.*?)\1"
)
KEYWORD = re.compile(
    r"\b(?:host|hostname|ip_address|master_addr|addr|address|endpoint)\s*=\s*([\"'])(.*?)\1"
)
SETTING = re.compile(
    r"(?i)(?:(?<![$\w])(?:NodeAddr|SlurmctldHost|MASTER_ADDR|AWS_ENDPOINT_URL|"
    r"TORCHFT_LIGHTHOUSE)\s*[=:]\s*|--(?:rdzv[_-]endpoint|master[_-]addr|lighthouse)[=\s]+)"
    r"[\"']?(?:[a-z]+://)?(\[[^\]]*\]|[^\s\"'/:(){}$]+)"
)
SELF = "tests/unit/test_loopback_only.py"
"""Not scanned: its samples of what the scan must refuse and its table of exceptions are
data, never an address anything is sent to."""


def scanned_files() -> list[pathlib.Path]:
    files = []
    for name in SCANNED:
        path = REPO / name
        found = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        files += [p for p in found if "__pycache__" not in p.parts and _is_text(p)]
    files = [p for p in files if str(p.relative_to(REPO)) != SELF]
    return files


def _is_text(path: pathlib.Path) -> bool:
    try:
        path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return False
    return True


def _literals(path: pathlib.Path, text: str) -> list[str]:
    """Where IP literals are looked for: a Python file's string literals (code such as a
    slice ``[::2]`` is no address), every line of any other file."""
    if path.suffix != ".py":
        return text.splitlines()
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return [t.string for t in tokens if t.type in (tokenize.STRING, tokenize.COMMENT)]


def addresses(path: pathlib.Path, text: str) -> set[str]:
    """Every name or literal ``text`` (of ``path``) uses as a network address."""
    found: set[str] = set()
    for chunk in _literals(path, text):
        found |= {literal for literal in IPV4.findall(chunk) if _parses(literal)}
        for literal in IPV6.findall(chunk):
            if ("::" in literal or literal.count(":") == 7) and _parses(literal):
                found.add(literal)
    # A call or setting that takes an address spans a string and the code around it.
    for line in text.splitlines():
        found |= {m.group(1) for m in URL.finditer(line)}
        found |= {m.group(2) for m in SOCKET_CALL.finditer(line)}
        found |= {m.group(2) for m in KEYWORD.finditer(line)}
        found |= {m.group(1) for m in SETTING.finditer(line)}
    return {name.strip("[]") for name in found}


def _parses(literal: str) -> bool:
    try:
        ipaddress.ip_address(literal)
    except ValueError:
        return False
    return True


def is_local(name: str) -> bool:
    """A loopback address or name, or an unspecified address to bind."""
    if name.lower() in LOOPBACK_NAMES or name in UNSPECIFIED:
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified


def offending(path: pathlib.Path, text: str) -> set[str]:
    """The names ``text`` uses as addresses that are neither local nor excepted."""
    where = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
    return {
        name
        for name in addresses(path, text)
        if not is_local(name) and (where, name) not in EXCEPTIONS
    }


@pytest.mark.parametrize("path", scanned_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_test_or_ci_file_names_an_address_off_this_machine(path):
    assert not offending(path, path.read_text(encoding="utf-8")), (
        f"{path.relative_to(REPO)} names a non-loopback address; use 127.0.0.1 (or another "
        "127.x address, or ::1) and a free port, or add an entry with its reason to "
        "EXCEPTIONS if nothing is ever sent there"
    )


def test_every_exception_is_still_needed_and_gives_a_reason():
    for (name, value), reason in EXCEPTIONS.items():
        path = REPO / name
        assert reason.strip(), (name, value)
        assert value in addresses(path, path.read_text(encoding="utf-8")), (name, value)
        assert not is_local(value), (name, value)


@pytest.mark.parametrize(
    "line",
    [
        'f"NodeName=ghost NodeAddr=192.0.2.1 CPUs=1 State=DRAIN",',
        'socket.create_connection(("node-9", 80))',
        'env["MASTER_ADDR"] = "x"; MASTER_ADDR=node-9 torchrun ...',
        'url = "http://node-9:29510/status"',
        'server = ThreadedMotoServer(ip_address="node-9", port=0)',
        'peer = "[2001:db8::7]"',
    ],
)
def test_the_scan_finds_an_address_off_this_machine(line, tmp_path):
    sample = tmp_path / "sample.py"
    assert offending(sample, f"x = {line!r}\n{line}\n")


@pytest.mark.parametrize(
    "line",
    [
        'f"NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus}",',
        's.bind(("127.0.0.2", 0))',
        'server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)',
        'url = f"http://{host}:{port}"',
        'store = TCPStore("localhost", 0); held.bind(("::", 0))',
        "x = values[::2]",
    ],
)
def test_the_scan_lets_loopback_and_bind_addresses_pass(line, tmp_path):
    sample = tmp_path / "sample.py"
    assert not offending(sample, f"{line}\n")
