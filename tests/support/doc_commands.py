"""The `kempnerforge` command lines of README.md and docs/*.md, as the tests see them.

A command line is a line of a code block, or an inline code span, that starts with
`kempnerforge`, `.venv/bin/kempnerforge`, `python -m kempnerforge` or `torchrun ... -m
kempnerforge` (after any `NAME=value` settings) and has an argument after the command's
name. One that holds a placeholder (`CONFIG`, `PATH`, `[...]`, `...`) is a synopsis.

A line the tests do not run carries a marker, an HTML comment on a line of its own before
its block (a code block, or the paragraph of an inline span)::

    <!-- not run in tests: REASON -->
    <!-- not run in tests "SUBSTRING": REASON -->

The first covers every command line of the block, the second only those containing
SUBSTRING. Every other command line is run by tests/e2e/test_doc_commands.py (README's
"Using it" block by tests/e2e/test_readme.py).
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import sysconfig
from dataclasses import dataclass, field

REPO = pathlib.Path(__file__).parents[2]
MARKER = re.compile(r'^<!--\s*not run in tests(?:\s+"([^"]+)")?:\s*(.+?)\s*-->\s*$')
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*(\.[a-z]+)?")
SHELL_VARIABLES = {"STDLIB": sysconfig.get_paths()["stdlib"], "SLURM_ARRAY_TASK_ID": "0"}
"""What the shell variables the docs' command lines use stand for in the tests."""


@dataclass(frozen=True)
class DocCommand:
    """One documented command line: where, as written, and what it runs."""

    file: str
    line: int
    text: str
    argv: list[str]
    """The arguments after `kempnerforge`: the command's name first."""
    env: dict[str, str] = field(default_factory=dict)
    world_size: int = 1
    not_run: str | None = None
    """The marker's reason, or None when a test runs the line."""

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def expanded(self) -> list[str]:
        """The arguments with the shell variables of SHELL_VARIABLES put in."""
        return [
            re.sub(r"\$\{?(\w+)\}?", lambda m: SHELL_VARIABLES[m.group(1)], a) for a in self.argv
        ]

    @property
    def is_synopsis(self) -> bool:
        return any(
            t in ("...", "|") or t.startswith("[") or PLACEHOLDER.fullmatch(t) for t in self.argv
        )


def doc_files() -> list[pathlib.Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def doc_commands() -> list[DocCommand]:
    """Every command line of README.md and docs/*.md, in file and line order."""
    return [c for path in doc_files() for c in _file_commands(path)]


def parse_command(text: str) -> tuple[list[str], dict[str, str], int] | None:
    """(arguments after `kempnerforge`, NAME=value settings, processes) of a shell line
    that runs kempnerforge with an argument after the command's name; None otherwise."""
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError:
        return None
    env: dict[str, str] = {}
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", tokens[0]):
        name, value = tokens.pop(0).split("=", 1)
        env[name] = value
    if not tokens:
        return None
    program, world = os.path.basename(tokens[0]), 1
    if program == "kempnerforge":
        rest = tokens[1:]
    elif program in ("python", "torchrun") and "-m" in tokens:
        at = tokens.index("-m")
        if tokens[at + 1 : at + 2] != ["kempnerforge"]:
            return None
        for option in tokens[1:at]:
            if option.startswith("--nproc_per_node="):
                world = int(option.split("=", 1)[1])
        rest = tokens[at + 2 :]
    else:
        return None
    return (rest, env, world) if len(rest) >= 2 else None


def _file_commands(path: pathlib.Path) -> list[DocCommand]:
    name = str(path.relative_to(REPO))
    lines = path.read_text().splitlines()
    found: list[DocCommand] = []
    markers: list[tuple[str | None, str]] = []  # pending for the next block
    active: list[tuple[str | None, str]] = []  # of the block being read
    fenced = False
    for index, raw in enumerate(lines):
        stripped = raw.strip()
        marker = MARKER.match(stripped)
        if marker:
            markers.append((marker.group(1), marker.group(2)))
            continue
        if stripped.startswith("```"):
            if not fenced:
                active, markers = markers, []
            fenced = not fenced
            if not fenced:
                active = []
            continue
        if not stripped:
            if not fenced:
                active = []
            continue
        if not fenced and not active and markers:
            active, markers = markers, []  # a paragraph (or indented block) starts
        code = fenced or raw.startswith("    ")
        texts = [stripped] if code else re.findall(r"`([^`]+)`", raw)
        if code and stripped.endswith("\\"):
            continue  # read as part of the line it continues (below)
        if code and index and lines[index - 1].rstrip().endswith("\\"):
            texts = [_joined(lines, index)]
        for text in texts:
            parsed = parse_command(text)
            if parsed is None:
                continue
            argv, env, world = parsed
            reason = next((r for sub, r in active if sub is None or sub in text), None)
            found.append(DocCommand(name, index + 1, text, argv, env, world, reason))
    return found


def _joined(lines: list[str], last: int) -> str:
    """The shell line that ends at ``last``, its backslash continuations joined."""
    first = last
    while first and lines[first - 1].rstrip().endswith("\\"):
        first -= 1
    return " ".join(line.strip().rstrip("\\").strip() for line in lines[first : last + 1])


def validate(command: DocCommand) -> str:
    """Check ``command`` without running it: its arguments through the command's own parser
    and, when it names a config of this repository, that config loaded with its overrides
    and validated for its world size (check-parallel: its --dry-run, which validates every
    layout). A synopsis has its flags checked. Returns what was checked; raises on a fault.
    """
    if command.argv[0] == "check-parallel":
        return _validate_check_parallel(command)
    from kempnerforge.cli import COMMANDS, _build_parser, _is_override

    parser = _build_parser()
    name, takes_overrides = command.argv[0], COMMANDS[command.argv[0]].takes_overrides
    if command.is_synopsis:
        _check_flags(command, _subparser(parser, name), takes_overrides)
        return "synopsis: flags known"
    args, extra = parser.parse_known_args(command.expanded)
    unknown = [a for a in extra if not (takes_overrides and _is_override(a))]
    assert not unknown, f"{command.where}: unrecognized arguments {unknown}"
    config = getattr(args, "config", None)
    if not config or not (REPO / config).is_file():
        return "parsed"
    from kempnerforge.config.loader import load_config
    from kempnerforge.core.errors import ConfigError

    try:
        load_config(str(REPO / config), extra).validate(command.world_size)
    except ConfigError as error:
        # A marked line may name the reader's own files (a model folder), absent here.
        value = error.value
        if not (command.not_run and isinstance(value, str) and value in command.text):
            raise
        return f"config validated up to the reader's own {value}"
    return f"config validated at world size {command.world_size}"


def _validate_check_parallel(command: DocCommand) -> str:
    import contextlib
    import io

    from kempnerforge.commands.check_parallel import build_parser, main

    if command.is_synopsis:
        _check_flags(command, build_parser(), takes_overrides=True)
        return "synopsis: flags known"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([*command.expanded[1:], "--dry-run"])
    assert code == 0, f"{command.where}: exit {code}: {err.getvalue()}"
    assert "REFUSED" not in out.getvalue(), f"{command.where}: {out.getvalue()}"
    return "layouts validated (--dry-run)"


def _subparser(parser, name: str):
    """The parser of subcommand ``name`` inside the CLI's parser."""
    actions = [a for a in parser._actions if getattr(a, "choices", None)]
    return actions[0].choices[name]


def _check_flags(command: DocCommand, parser, takes_overrides: bool) -> None:
    for token in command.argv[1:]:
        flag = token.strip("[]").split("=", 1)[0]
        if not flag.startswith("--") or (takes_overrides and "." in flag):
            continue
        assert flag in parser._option_string_actions, f"{command.where}: unknown flag {flag}"
