"""torchrun for one node of a SLURM job (scripts/slurm/train.sbatch): torch's own launcher,
with a stop signal reported in one line instead of a traceback.

torchrun turns a stop signal (SIGTERM, SIGUSR1, ...) into an exception once it has passed
the signal on to its ranks and waited for them: the ranks save and exit on their own, so
the exception is the expected end of a preempted run, not a crash. Printed as torch prints
it, a traceback of thirty lines, it reads as one to anyone scanning a job log. This entry
point runs the same launcher and, for that exception, prints what happened and exits with
128 + the signal, as a shell reports a process a signal ended (torch's two warnings about
the same event are left out); for a rank that failed, whose own output says why, one line
and exit code 1, torchrun's code for it.

    python -m kempnerforge.launch.node_torchrun [torchrun's arguments]

One behaviour differs: when a rank fails, torchrun stops the node's other ranks with
SIGTERM and waits 30 s before SIGKILL, whatever the failure. A rank that failed saved
nothing, and the others cannot save without it (a save is collective): the grace only
delays the requeue, by the full 30 s when a rank is frozen (stopped, or stuck where it
never sees the signal, as a hung rank is). So after a failure the others get
FAILURE_GRACE_S; when a rank exited PREEMPTED (75: it saved after a stop signal, and its
peers may be finishing the same save) they keep torchrun's 30 s.
"""

from __future__ import annotations

import logging
import signal
import sys

FAILURE_GRACE_S = 5
"""Seconds the node's other ranks get to exit after SIGTERM once a rank failed."""

PREEMPTED = 75
"""kempnerforge.resilience.exit_codes.PREEMPTED (not imported: this module loads no more
than torchrun does)."""


def _short_grace_after_a_failure() -> None:
    """Make torchrun stop the node's other ranks within FAILURE_GRACE_S of a rank's failure,
    unless a rank exited PREEMPTED. torchrun's process context closes the others itself
    (SIGTERM, a wait, SIGKILL) as soon as it sees a failure, calling its close() with no
    timeout; a close with a timeout (a stop signal's) is left as it is. Leaves torchrun as it
    is when its process context is not the one this reads (another torch)."""
    from torch.distributed.elastic.multiprocessing.api import PContext

    close = getattr(PContext, "close", None)
    if close is None:
        return

    def close_after_a_failure(self, death_sig=None, timeout=None):
        if timeout is None:
            failures = getattr(self, "_failures", None) or {}
            codes = {failure.exitcode for failure in failures.values()}
            timeout = FAILURE_GRACE_S if codes and PREEMPTED not in codes else 30
        return close(self, death_sig, timeout)

    setattr(PContext, "close", close_after_a_failure)  # noqa: B010


class _StopSignalWarnings(logging.Filter):
    """Drops torch's 'death signal' and 'closing signal' warnings: this module says it once."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return "death signal" not in message and "closing signal" not in message


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    _short_grace_after_a_failure()
    stop_warnings = _StopSignalWarnings()
    for name in (
        "torch.distributed.elastic.agent.server.api",
        "torch.distributed.elastic.multiprocessing.api",
    ):
        logging.getLogger(name).addFilter(stop_warnings)
    try:
        torchrun(argv)
    except SignalException as stop:
        name = signal.Signals(stop.sigval).name
        print(
            f"torchrun: stopped by {name}; it passed the signal on to its ranks, which save "
            "and exit on their own",
            file=sys.stderr,
        )
        return 128 + int(stop.sigval)
    except ChildFailedError as failed:
        # Each rank said why in its own output above; one line for the node.
        codes = sorted({f.exitcode for f in failed.failures.values()})
        print(
            f"torchrun: {len(failed.failures)} of its ranks failed (exit codes "
            f"{', '.join(map(str, codes))}); their output above says why",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
