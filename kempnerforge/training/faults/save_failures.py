"""Failed saves during training: reported, and survived up to checkpoint.max_failed_saves.

A save on the schedule that fails (a full disk, an I/O error, a denied path) commits
nothing and leaves ``latest`` where it was; the ranks agree that it failed before any of
them raises (checkpoint/saver.py), so every rank goes on training together and the next
save on the schedule tries again. A save a stop needs (a stop signal, the end of the
run) is not made here, and its failure still ends the run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from kempnerforge.checkpoint.failures import FailedSave
from kempnerforge.checkpoint.manager import CheckpointManager
from kempnerforge.core.errors import CheckpointError
from kempnerforge.core.logging import get_logger
from kempnerforge.training.session import TrainingSession

logger = get_logger(__name__)


@contextlib.contextmanager
def tolerating_failed_saves(session: TrainingSession) -> Iterator[None]:
    """Report a save that fails inside the block (a ``checkpoint_failed`` event and a
    warning) and carry on, unless checkpoint.max_failed_saves saves have now failed in a
    row: then raise CheckpointError naming the field and the last failure (exit 1)."""
    try:
        yield
    except FailedSave as error:
        checkpointer = session.checkpointer
        failed = checkpointer.failed_saves_in_a_row
        allowed = session.config.checkpoint.max_failed_saves
        path = checkpointer.location(f"step_{error.step}")
        fields: dict[str, object] = {"reason": error.reason, "path": path, "in_a_row": failed}
        if error.bytes_free is not None:
            fields["bytes_free"] = error.bytes_free
        session.tracker.log_event(error.step, "checkpoint_failed", **fields)
        if failed >= allowed:
            raise CheckpointError(
                checkpointer.location_of(checkpointer.directory),
                f"{failed} checkpoint saves in a row failed (checkpoint.max_failed_saves = "
                f"{allowed}), the last: {error.problem}",
            ) from error
        logger.warning(
            "checkpoint %s was not saved (%s); training goes on and the next save tries "
            "again (%d of checkpoint.max_failed_saves = %d failed in a row)",
            path,
            error.reason,
            failed,
            allowed,
        )


def drain_after_failure(checkpointer: CheckpointManager) -> None:
    """Wait for a save in flight while another error propagates, without masking it.

    A full disk fails the metrics row and the checkpoint alike, in either order; the run
    stops on the first error, which the CLI reports in one line, so what the drain meets
    is one more log line, never a traceback chained to it: a save that failed too, or a
    save committed whose event row (on the full disk) could not be written.
    """
    try:
        checkpointer.wait()
    except CheckpointError as error:
        logger.warning("the checkpoint in flight was not saved either: %s", error)
    except OSError as error:
        # Raised only past the commit: a failed write of the save itself is a FailedSave.
        logger.warning("the checkpoint in flight was committed; a write after it failed: %s", error)
    except Exception:
        logger.exception("the checkpoint in flight also failed while the run was stopping")


# --- Checkpoints ------------------------------------------------------------------------
