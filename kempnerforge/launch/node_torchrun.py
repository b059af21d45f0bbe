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
"""

from __future__ import annotations

import logging
import signal
import sys


class _StopSignalWarnings(logging.Filter):
    """Drops torch's 'death signal' and 'closing signal' warnings: this module says it once."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return "death signal" not in message and "closing signal" not in message


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

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
