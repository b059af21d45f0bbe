"""Process exit codes of `kempnerforge train`, chosen so a SLURM script can act on them.

A batch script typically does::

    srun kempnerforge train job.toml
    case $? in
        0)  echo "finished" ;;
        75) scontrol requeue "$SLURM_JOB_ID" ;;   # PREEMPTED: saved, run me again
        *)  echo "failed: read the log before resubmitting"; exit 1 ;;
    esac

FINISHED (0)
    Reached train.max_steps; the final checkpoint is on disk. Nothing to do.
FAILED (1)
    Unexpected error or a checkpoint problem (the message names the file). Resubmitting
    unchanged usually fails again; a crash mid-save still leaves `latest` on a complete
    checkpoint, so a fixed job resumes from there.
CONFIG_ERROR (2)
    The config or a data file is wrong; the one-line message names the field or file.
    Fix the config; never requeue.
NAN_ABORT (3)
    train.nan_consecutive_max steps in a row had a non-finite loss or gradient norm.
    The last checkpoint predates the divergence; lower the learning rate or change data
    before resuming. Requeueing unchanged repeats the divergence.
INTERRUPTED (130)
    Ctrl-C outside training (prepare-data, eval): nothing was left half-written.
PREEMPTED (75, EX_TEMPFAIL from sysexits.h)
    A signal (SIGTERM, SIGINT or SIGUSR1, e.g. from ``#SBATCH --signal=B:USR1@120``)
    arrived, the run saved a checkpoint of its last good step and exited cleanly.
    Requeue the job: `checkpoint.resume_from = "auto"` continues exactly there.
"""

from __future__ import annotations

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
INTERRUPTED = 130
"""Interrupted (Ctrl-C) outside a training run, which would have saved and exited 75."""
