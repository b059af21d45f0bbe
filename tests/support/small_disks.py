"""Small tmpfs file systems for the tests of a full disk: mounted for one command, in a
mount namespace of its own, so nothing stays mounted when the command ends and the disks
fill with a real ENOSPC from the kernel.

Unprivileged through a user namespace (`unshare -rm`) where the kernel allows it, else as
root (`unshare -m`). Where neither can mount, the tests skip naming why, except when
KEMPNERFORGE_REQUIRE_TMPFS=1 (CI sets it): then they fail.
"""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NoReturn

import pytest

REQUIRE_ENV = "KEMPNERFORGE_REQUIRE_TMPFS"


@functools.cache
def _unshare() -> tuple[list[str] | None, str]:
    """(the unshare command that can mount a tmpfs here, or None; why not)."""
    if shutil.which("unshare") is None:
        return None, "no unshare on PATH (util-linux)"
    reasons = []
    with tempfile.TemporaryDirectory() as probe:
        mount = f"mount -t tmpfs -o size=64k tmpfs {shlex.quote(probe)}"
        tries = [["unshare", "-rm"]] + ([["unshare", "-m"]] if os.geteuid() == 0 else [])
        for prefix in tries:
            done = subprocess.run(
                [*prefix, "sh", "-c", mount], capture_output=True, text=True, timeout=60
            )
            if done.returncode == 0:
                return prefix, ""
            reasons.append(f"{' '.join(prefix)}: {done.stderr.strip() or done.returncode}")
    if os.geteuid() != 0:
        reasons.append("not root, so no mount namespace without a user namespace")
    return None, "; ".join(reasons)


def require_small_disks() -> None:
    """Skip (fail under KEMPNERFORGE_REQUIRE_TMPFS=1) where no tmpfs can be mounted."""
    prefix, why = _unshare()
    if prefix is None:
        no_small_disks(f"cannot mount a small tmpfs here: {why}")


def no_small_disks(reason: str) -> NoReturn:
    """Skip a full-disk test, naming why; fail instead under KEMPNERFORGE_REQUIRE_TMPFS=1."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(reason)
    pytest.skip(reason)


def on_small_disks(
    mounts: dict[Path, str], argv: list[str], keep: dict[Path, Path] | None = None
) -> list[str]:
    """The command line that mounts a tmpfs at each path of ``mounts`` (with its mount
    options, e.g. ``size=1m``), runs ``argv`` with its exit status and, after it, copies
    each file of ``keep`` that exists (a path under a mount, to its path outside), since
    the mounts end with the command."""
    prefix, why = _unshare()
    assert prefix is not None, why
    steps = [
        f"mount -t tmpfs -o {options} tmpfs {shlex.quote(str(path))}"
        for path, options in mounts.items()
    ]
    copies = [
        f"[ -e {shlex.quote(str(src))} ] && cp {shlex.quote(str(src))} {shlex.quote(str(dst))}"
        for src, dst in (keep or {}).items()
    ]
    script = (
        " && ".join(steps)
        + ' && { "$@"; status=$?; '
        + "; ".join([*copies, "exit $status"])
        + "; }"
    )
    return [*prefix, "sh", "-c", script, "sh", *argv]
