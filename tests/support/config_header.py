"""The shell commands a config's header comment documents (a worked example's recipe), read
so that a test runs exactly what the config and the docs show."""

from __future__ import annotations

from pathlib import Path


def header_commands(config: Path, prefixes: tuple[str, ...] = (".venv/",)) -> list[str]:
    """The lines of ``config``'s leading comment that start with one of ``prefixes``, with
    continuation lines (a trailing backslash) joined."""
    lines = []
    for line in config.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:].strip())
    text = "\n".join(lines).replace("\\\n", " ")
    return [line for line in text.splitlines() if line.startswith(prefixes)]
