"""Process exit codes of `kempnerforge train`, chosen so a SLURM script can act on them.

A batch script typically does::

    srun kempnerforge train job.toml
    case $? in
        0)  echo "finished" ;;
        75) scontrol requeue "$SLURM_JOB_ID" ;;   # PREEMPTED: saved, run me again
        77) scontrol requeue "$SLURM_JOB_ID" ;;   # HANG: resume from the last checkpoint
        *)  echo "failed: read the log before resubmitting"; exit 1 ;;
    esac

FINISHED (0)
    Reached train.max_steps; the final checkpoint is on disk. Nothing to do.
FAILED (1)
    Unexpected error or a checkpoint problem (the message names the file). Resubmitting
    unchanged usually fails again; a crash mid-save still leaves `latest` on a complete
    checkpoint, so a fixed job resumes from there. A checkpoint store that failed or did
    not answer within checkpoint.store_timeout_s at a resume says so, naming the store:
    its checkpoints are untouched, so requeue once the store answers.
CONFIG_ERROR (2)
    The config or a data file is wrong; the one-line message names the field or file.
    Fix the config; never requeue.
NAN_ABORT (3)
    train.nan_consecutive_max steps in a row had a non-finite loss or gradient norm.
    The last checkpoint predates the divergence; lower the learning rate or change data
    before resuming. Requeueing unchanged repeats the divergence.
HANG (77)
    A training step, an eval or a checkpoint save or load ran past its limit
    (train.hang_timeout_s): every rank that could wrote its threads' stacks to
    run_dir/hangs/rank<R>-<host>.txt and exited. A hang is most often a lost node, a
    stuck GPU or network, gone on a fresh allocation: requeue, and the run resumes from
    its last checkpoint; read the stacks when it happens again.
INTERRUPTED (130)
    Ctrl-C outside training (prepare-data, eval): nothing was left half-written.
PREEMPTED (75, EX_TEMPFAIL from sysexits.h)
    A signal (SIGTERM, SIGINT or SIGUSR1, e.g. from ``#SBATCH --signal=B:USR1@120``)
    arrived, the run saved a checkpoint of its last good step and exited cleanly (replica
    groups also exit 75 when their quorum is lost: the lighthouse gone or silent).
    Requeue the job: `checkpoint.resume_from = "auto"` continues exactly there.
HARDWARE_FAULT (76)
    With train.attribute_faults, train.max_hardware_faults faulty steps in this launch came
    out clean when run again on the same weights and batches: the machine, not the data,
    is suspect (the ``suspected_hardware_fault`` events name host and rank). Nothing is
    saved after the last checkpoint, which a suspect machine may not have computed right.
    Requeue the job on other nodes (scripts/slurm/train.sbatch excludes the hosts named);
    it resumes from the last checkpoint.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
from typing import NoReturn

FINISHED = 0
"""The run reached train.max_steps and saved its final checkpoint."""
FAILED = 1
"""An unexpected or checkpoint error; read the log before resubmitting."""
CONFIG_ERROR = 2
"""A config or data problem named in a one-line message; fix it, do not requeue."""
NAN_ABORT = 3
"""Too many consecutive non-finite steps; change the run before resuming."""
PREEMPTED = 75
"""Saved after a stop signal (EX_TEMPFAIL): requeue and it resumes where it stopped."""
HARDWARE_FAULT = 76
"""Too many faults that a re-run did not repeat: requeue on other nodes."""
HANG = 77
"""A step (or its collective) hung: stacks in run_dir/hangs/; requeue, it resumes."""
INTERRUPTED = 130
"""Interrupted (Ctrl-C) outside a training run, which would have saved and exited 75."""

SUMMARY: dict[int, str] = {
    FINISHED: "finished",
    FAILED: "failed",
    CONFIG_ERROR: "bad config or data",
    NAN_ABORT: "stopped by non-finite losses",
    PREEMPTED: "preempted (requeue)",
    HARDWARE_FAULT: "suspected hardware fault (requeue on other nodes)",
    HANG: "a step hung (stacks in <run_dir>/hangs/; requeue)",
    INTERRUPTED: "interrupted (Ctrl-C) before or outside training",
}
"""Every exit code with its meaning in a few words: `train --help` prints it, and a test
holds the tables of README.md and docs/ to the same codes."""

# OS errors that say something about the machine (a full disk, a missing permission),
# reported in one line with the path; other OS errors are bugs and keep their traceback.
MACHINE_ERRNOS = {
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EACCES,
    errno.EPERM,
    errno.EROFS,
    errno.EIO,
    errno.ENOMEM,
    errno.EMFILE,
    errno.ENFILE,
}


def report(error: BaseException) -> tuple[int, str] | None:
    """The exit code and the one line a command reports for ``error``; None for an error
    that is a bug, which keeps its traceback.

    User-caused problems (config, data, a held run directory) exit 2; a checkpoint that
    cannot be saved, found or loaded, a lost peer, a machine error (a full disk, a denied
    path) and running out of memory exit 1; non-finite losses exit 3; suspected hardware
    faults 76; Ctrl-C 130.
    """
    from kempnerforge.core.errors import (
        CheckpointError,
        CollectiveFailure,
        ConfigError,
        DataError,
        HardwareFaultError,
        PeerSetupError,
    )
    from kempnerforge.resilience.nan import NaNAbortError
    from kempnerforge.resilience.run_lock import RunLockError

    if isinstance(error, ConfigError | DataError | RunLockError | PeerSetupError):
        return CONFIG_ERROR, f"error: {error}"
    if isinstance(error, CheckpointError):
        return FAILED, f"checkpoint error: {error}"
    if isinstance(error, CollectiveFailure):
        return FAILED, f"error: {error}"
    if isinstance(error, NaNAbortError):
        return NAN_ABORT, f"stopped: {error}"
    if isinstance(error, HardwareFaultError):
        return HARDWARE_FAULT, f"stopped: {error}"
    if isinstance(error, OSError) and error.errno in MACHINE_ERRNOS:
        where = error.filename if error.filename is not None else "the run"
        return FAILED, f"error: {where}: {error.strerror or error}"
    if _is_out_of_memory(error):
        text = str(error).strip()
        first_line = text.splitlines()[0] if text else type(error).__name__
        return FAILED, (
            f"error: out of memory ({first_line}); lower train.batch_size or train.seq_len, "
            "or use a smaller model"
        )
    if isinstance(error, KeyboardInterrupt):
        return INTERRUPTED, "interrupted"
    return None


def print_report(error: BaseException) -> int | None:
    """Print ``error``'s one line to stderr as a command reports it and return its exit
    code; None (nothing printed) for a bug, which the caller shows with its traceback."""
    reported = report(error)
    if reported is None:
        return None
    code, line = reported
    print(f"kempnerforge: {line}", file=sys.stderr)
    return code


def exit_now(code: int) -> NoReturn:
    """End the process with ``code`` at once, without Python's finalisation (cli.py says
    when that is needed), the output streams and log handlers flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def code_of(error: BaseException) -> int:
    """The exit code a command that raised ``error`` ends with (FAILED for a bug)."""
    if isinstance(error, SystemExit) and isinstance(error.code, int):
        return error.code
    reported = report(error)
    return FAILED if reported is None else reported[0]


def _is_out_of_memory(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, MemoryError) or (
        isinstance(error, RuntimeError)
        and ("out of memory" in text.lower() or "can't allocate memory" in text)
    )
