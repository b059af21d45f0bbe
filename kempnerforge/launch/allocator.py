"""The host memory allocator of a training process: tcmalloc / jemalloc preloaded by a
re-exec, or glibc malloc tuned in place.

Why: glibc serves every allocation above its mmap threshold (32 MiB at most) with a fresh
mmap and returns it to the kernel on free, so the activations, logits and gradients that a
CPU step allocates and frees get new zero-filled pages from the kernel every step. A third
of a CPU step's time can go to those page faults. tcmalloc and jemalloc keep freed memory
for reuse; so does glibc once told to (no mmap for large blocks, no trimming of the heap).

A preloaded library must be in place before the process starts, so `kempnerforge train`
restarts itself once (os.execv, same pid, same arguments) with LD_PRELOAD set, before it
imports torch; glibc's tuning (mallopt) applies in the running process. Nothing here
imports torch, and this module imports nothing from the package but config errors.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from dataclasses import dataclass

from kempnerforge.core.errors import ConfigError

ALLOCATOR_ENV = "KEMPNERFORGE_ALLOCATOR"
"""Overrides train.allocator: auto, tcmalloc, jemalloc, glibc, system or a library path."""

PRELOADED_ENV = "KEMPNERFORGE_ALLOCATOR_PRELOADED"
"""Set by the re-exec to the library it preloaded, so the new process does not restart
again and can check that the library really is mapped."""

LIBRARY_NAMES = {
    "tcmalloc": (
        "libtcmalloc_minimal.so.4",
        "libtcmalloc.so.4",
        "libtcmalloc_minimal.so",
        "libtcmalloc.so",
    ),
    "jemalloc": ("libjemalloc.so.2", "libjemalloc.so"),
}
"""File names of each preloadable allocator, most specific first."""

INSTALL_HINT = {
    "tcmalloc": "e.g. apt install libtcmalloc-minimal4, or conda install gperftools",
    "jemalloc": "e.g. apt install libjemalloc2, or conda install jemalloc",
}

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4
_TOP_PAD_BYTES = 64 << 20  # grow the heap in 64 MiB steps: fewer brk calls


@dataclass(frozen=True)
class AllocatorPlan:
    """What to do about the allocator before the run starts."""

    name: str
    """'tcmalloc', 'jemalloc', 'glibc', 'system', or 'library' for a path."""
    library: str | None = None
    """The library to preload (tcmalloc, jemalloc, a path), else None."""
    reason: str = ""
    """Why this allocator, for the start-up log line."""


def library_dirs() -> list[str]:
    """Directories searched for an allocator library: the environment's own lib folders
    (a venv or conda prefix), then the system's."""
    dirs = [os.path.join(sys.prefix, "lib"), os.path.join(sys.base_prefix, "lib")]
    conda = os.environ.get("CONDA_PREFIX")
    if conda:
        dirs.append(os.path.join(conda, "lib"))
    machine = platform.machine()
    dirs += [
        f"/usr/lib/{machine}-linux-gnu",
        f"/lib/{machine}-linux-gnu",
        "/usr/lib64",
        "/lib64",
        "/usr/local/lib",
        "/usr/lib",
    ]
    return list(dict.fromkeys(dirs))


def find_library(name: str, dirs: list[str] | None = None) -> str | None:
    """The path of allocator ``name`` ('tcmalloc' or 'jemalloc') if installed, else None."""
    for directory in library_dirs() if dirs is None else dirs:
        for filename in LIBRARY_NAMES[name]:
            path = os.path.join(directory, filename)
            if os.path.isfile(path):
                return path
    return None


def is_glibc() -> bool:
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def plan_allocator(configured: str, dirs: list[str] | None = None) -> AllocatorPlan:
    """Decide the allocator from train.allocator (``configured``) or KEMPNERFORGE_ALLOCATOR.

    Raises ConfigError when an allocator that was asked for by name or path is missing.
    """
    choice, field = configured, "train.allocator"
    if os.environ.get(ALLOCATOR_ENV):
        choice, field = os.environ[ALLOCATOR_ENV], ALLOCATOR_ENV
    if choice.startswith("/"):
        if not os.path.isfile(choice):
            raise ConfigError(field, choice, "an existing allocator library (no such file)")
        return AllocatorPlan("library", choice, f"{field} names it")
    if choice in LIBRARY_NAMES:
        path = find_library(choice, dirs)
        if path is None:
            raise ConfigError(
                field,
                choice,
                f"an installed allocator: {choice} was not found in "
                f"{', '.join(library_dirs() if dirs is None else dirs)} "
                f"({INSTALL_HINT[choice]}), or 'auto'",
            )
        return AllocatorPlan(choice, path, f"{field} = {choice}")
    if choice == "auto":
        path = find_library("tcmalloc", dirs)
        if path is not None:
            return AllocatorPlan("tcmalloc", path, "found (train.allocator = auto)")
        if is_glibc():
            return AllocatorPlan(
                "glibc",
                reason="tcmalloc not installed (train.allocator = auto; "
                f"{INSTALL_HINT['tcmalloc']})",
            )
        return AllocatorPlan("system", reason="no tcmalloc, and the C library is not glibc")
    if choice == "glibc" and not is_glibc():
        raise ConfigError(field, choice, "'glibc' only where the C library is glibc; use 'system'")
    if choice not in ("glibc", "system"):
        raise ConfigError(
            field, choice, "one of auto, tcmalloc, jemalloc, glibc, system, or a path"
        )
    return AllocatorPlan(choice, reason=f"{field} = {choice}")


def preloaded(library: str) -> bool:
    """Whether ``library`` is mapped into this process (read from /proc/self/maps)."""
    real = os.path.realpath(library)
    try:
        with open("/proc/self/maps") as f:
            return any(line.rstrip().endswith((library, real)) for line in f)
    except OSError:
        return False


def needs_restart(plan: AllocatorPlan) -> bool:
    """Whether the process must re-exec itself to preload ``plan.library``."""
    if plan.library is None or os.environ.get(PRELOADED_ENV):
        return False
    return not preloaded(plan.library)


def restart_with(plan: AllocatorPlan) -> None:
    """Replace this process by the same command with ``plan.library`` preloaded.

    os.execv keeps the pid, the open files and the signal dispositions' defaults, so a
    launcher (torchrun, SLURM) sees the same process. Never returns.
    """
    assert plan.library is not None
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(filter(None, [plan.library, env.get("LD_PRELOAD", "")]))
    env[PRELOADED_ENV] = plan.library
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def tune_glibc() -> bool:
    """Make glibc malloc keep freed memory for reuse: no mmap for large blocks (they come
    from the heap, where free keeps them) and no trimming of the heap's top. Returns
    whether glibc accepted every setting."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    settings = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, _TOP_PAD_BYTES))
    return all(libc.mallopt(param, value) == 1 for param, value in settings)


def prepare_allocator(configured: str) -> AllocatorPlan:
    """Put the planned allocator in place: restart with a preload (does not return), or
    tune glibc in place; returns the plan in force for describe_allocator."""
    plan = plan_allocator(configured)
    if needs_restart(plan):
        restart_with(plan)
    if plan.name == "glibc" and not tune_glibc():
        return AllocatorPlan("system", reason="glibc refused the mallopt settings")
    return plan


def describe_allocator(plan: AllocatorPlan) -> str:
    """The start-up log line: which allocator this process runs with, and why."""
    if plan.library is not None:
        if preloaded(plan.library):
            return f"memory allocator: {plan.name} ({plan.library}, preloaded; {plan.reason})"
        return (
            f"memory allocator: system malloc; {plan.library} was asked for ({plan.reason}) "
            "but is not mapped into this process"
        )
    if plan.name == "glibc":
        return f"memory allocator: glibc malloc tuned to reuse freed memory ({plan.reason})"
    return f"memory allocator: system malloc, as the process started ({plan.reason})"


def put_allocator_in_place(
    config_path: str, overrides: list[str], *, restart: bool
) -> AllocatorPlan | None:
    """Put the train.allocator of a command's config in place before torch is imported.

    This may restart the command with the allocator preloaded (prepare_allocator), which
    only a process started as the command may do (``restart``), not a caller of the CLI's
    main() inside its own process. None when the config does not load: the command
    reports that itself, in its own words.
    """
    from kempnerforge.config.loader import load_config

    try:
        configured = load_config(config_path, overrides).train.allocator
    except (ConfigError, OSError):
        return None
    if restart:
        return prepare_allocator(configured)
    return plan_allocator(configured)
