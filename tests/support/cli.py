"""run_kempnerforge and run_python: the command line and the repository's scripts as a user
runs them, each in a process of its own (a command's forked from the warm server, which has
imported torch already: tests.support.warm_process says what that changes)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from collections.abc import Mapping

from tests.support import warm_process

REPO = pathlib.Path(__file__).parents[2]


def run_kempnerforge(
    *args: str,
    cwd: str | os.PathLike[str] = REPO,
    env_extra: Mapping[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """`python -m kempnerforge *args`, as run_python runs it, in a process forked from the
    warm server."""
    return warm_process.run(
        [sys.executable, "-m", "kempnerforge", *args],
        cwd=cwd,
        env={**os.environ, **(env_extra or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_python(
    *argv: str,
    cwd: str | os.PathLike[str] = REPO,
    env_extra: Mapping[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """`python *argv` in ``cwd``, with this process's environment plus ``env_extra``; its
    output captured as text. A run past ``timeout`` seconds raises TimeoutExpired, so a
    hung command fails its test instead of stalling the suite."""
    return subprocess.run(
        [sys.executable, *argv],
        cwd=cwd,
        env={**os.environ, **(env_extra or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
