"""How many intra-op threads a process started by a test gets.

The suite runs on pytest-xdist workers that share the machine's cores (2 workers on 2
cores in CI). A test process asking for more threads than its share oversubscribes the
cores, and OpenMP's waiting threads then spin against the other worker's: measured on 2
cores with a second job running, the debug run took 70 s at 2 threads and 22-32 s at 1.
So every process a test starts gets the cores divided by the workers running at once: one
thread each under `-n 2`, both cores for a test run alone.
"""

from __future__ import annotations

import os


def process_threads() -> str:
    """OMP_NUM_THREADS for a process a test starts: this worker's share of the cores."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or "1")
    return str(max(1, (os.cpu_count() or 1) // max(1, workers)))


PROCESS_THREADS = process_threads()
"""process_threads() of this test process (the worker count does not change in a run)."""
