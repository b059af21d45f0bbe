"""Which checkpoint checkpoint.resume_from selects: one rank lists, every rank judges.

Rank 0 reads the directory (``latest``, the ``step_<N>`` names) and hands the list to the
others, so every rank tries the same candidates in the same order even where a shared
file system shows them the directory late. Each candidate tried costs one verdict: one
pass split over the ranks (integrity.share_problems) agreed in one small collective. The
first complete candidate wins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kempnerforge.checkpoint.disk_format import (
    LATEST,
    foreign_kind,
    is_real_dir,
    read_latest,
    step_dirs,
)
from kempnerforge.core.errors import CheckpointError, incomplete
from kempnerforge.core.logging import get_logger

logger = get_logger(__name__)

Verdict = Callable[[Path], list[str]]
"""A checkpoint's problems as every rank agrees on them, empty when it is complete."""


@dataclass(frozen=True)
class Candidate:
    """A checkpoint to try, and how a skip names it."""

    path: Path
    label: str
    named_by_latest: bool = False
    refused: str | None = None
    """Why it is no checkpoint at all, seen from the directory alone (a link, a file)."""


@dataclass(frozen=True)
class Candidates:
    """What checkpoint.resume_from leaves to try, newest first; found by one rank."""

    directory: Path
    explicit: Path | None = None
    """The checkpoint a path in resume_from names; nothing else is tried then."""
    tries: list[Candidate] = field(default_factory=list)
    has_step_dirs: bool = False
    """Whether the directory holds any ``step_<N>``: when all are broken, that is an error."""
    no_pointer: str = ""
    """Why ``latest`` named nothing, for the warning when an older checkpoint is taken."""


def list_candidates(directory: Path, choice: str) -> Candidates | None:
    """What `choice` (checkpoint.resume_from) leaves to try in `directory`; None for 'none'.

    Reads the directory only, never a checkpoint's files.
    """
    if choice == "none":
        return None
    if choice != "auto":
        path = Path(choice)
        if not path.exists() and (directory / choice).exists():
            path = directory / choice
        return Candidates(directory, explicit=path)
    tries = []
    latest = read_latest(directory)
    if latest is not None:
        path = directory / latest
        refused = None
        if path.is_symlink() or (path.exists() and not is_real_dir(path)):
            # Only a directory a save wrote counts; a link may lead anywhere.
            refused = f"it is {foreign_kind(path)}, not a checkpoint directory"
        tries.append(Candidate(path, f"{path} named by '{LATEST}'", True, refused))
    found = step_dirs(directory)
    tries.extend(Candidate(path, str(path)) for _, path in found if path.name != latest)
    return Candidates(directory, None, tries, bool(found), _no_pointer(directory))


def choose(candidates: Candidates, verdict: Verdict, *, quiet: bool = False) -> str | None:
    """The first complete checkpoint of `candidates`, judged by `verdict`; None for none.

    Every rank calls it with the same candidates (`verdict` is collective). An explicit
    checkpoint that is not complete raises CheckpointError naming it and the problem; so
    does a directory whose ``step_<N>`` checkpoints are all broken (starting over would
    silently drop them). Taking an older checkpoint than ``latest`` names is warned about
    (on the ranks not `quiet`), naming what was skipped.
    """
    if candidates.explicit is not None:
        path = candidates.explicit
        problems = verdict(path)
        if problems:
            raise incomplete(path, problems)
        return str(path)
    skipped: list[str] = []
    for candidate in candidates.tries:
        problems = [candidate.refused] if candidate.refused else verdict(candidate.path)
        if not problems:
            if not candidate.named_by_latest and not quiet:
                reason = f"skipped {'; '.join(skipped)}" if skipped else candidates.no_pointer
                logger.warning(
                    "resuming from %s, the newest complete checkpoint (%s)", candidate.label, reason
                )
            return str(candidate.path)
        skipped.append(f"{candidate.label} ({problems[0]})")
    if candidates.has_step_dirs:
        raise CheckpointError(
            candidates.directory,
            f"no complete checkpoint to resume from (skipped {'; '.join(skipped)}); "
            "set checkpoint.resume_from = 'none' to start over",
        )
    if skipped and not quiet:
        logger.warning("no checkpoint to resume from: skipped %s", skipped[0])
    return None


def _no_pointer(directory: Path) -> str:
    """Why `latest` named nothing: absent, or present but not a pointer (warned apart)."""
    pointer = directory / LATEST
    if pointer.is_symlink() or pointer.exists():
        return f"'{LATEST}' is unusable"
    return f"no '{LATEST}' file"
