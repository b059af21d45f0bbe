"""Training loader workers: stop signals are left to the training process, and no worker
outlives it (shut down, at interpreter exit, or after it was killed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from kempnerforge.data.dataloader import TrainDataLoader, build_train_loader
from kempnerforge.data.dataset import MemoryMappedDataset
from kempnerforge.data.sampling.sampler import ShardedSampler
from tests.support.data_files import write_token_dir

REPO = Path(__file__).parents[2]
BATCH = 2
WAIT_S = 30.0


def _dataset(tmp_path: Path) -> str:
    path = tmp_path / "d"
    if not path.exists():
        write_token_dir(path, [list(range(i, i + 40)) for i in range(5)])
    return str(path)


def _loader(data: str, num_workers: int) -> TrainDataLoader:
    dataset = MemoryMappedDataset(data, seq_len=4)
    sampler = ShardedSampler(len(dataset), 0, 1, seed=5)
    return build_train_loader(dataset, sampler, BATCH, num_workers, seed=5)


def _live_children(pid: int) -> set[int]:
    """Pids of the running (not zombie) child processes of ``pid``."""
    children = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue  # exited while being read
        if int(ppid) == pid and state != "Z":
            children.add(int(stat.parent.name))
    return children


def _is_running(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError):
        return False
    return state != "Z"


def _wait_until_gone(pids: set[int], timeout_s: float = WAIT_S) -> set[int]:
    """The pids of ``pids`` still running after at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    running = {pid for pid in pids if _is_running(pid)}
    while running and time.monotonic() < deadline:
        time.sleep(0.1)
        running = {pid for pid in running if _is_running(pid)}
    return running


def _signal_from_another_process(pids: set[int], sig: signal.Signals) -> None:
    """Send ``sig`` as slurmd or a terminal would: from a process other than the parent."""
    code = "import os, sys; [os.kill(int(p), int(sys.argv[1])) for p in sys.argv[2:]]"
    subprocess.run([sys.executable, "-c", code, str(int(sig)), *map(str, pids)], check=True)


def _same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1], ids=["SIGTERM", "SIGINT", "SIGUSR1"]
)
def test_workers_keep_loading_through_a_stop_signal_from_another_process(tmp_path, sig):
    data = _dataset(tmp_path)
    expected_iter = iter(_loader(data, num_workers=0))
    expected = [next(expected_iter) for _ in range(8)]
    before = _live_children(os.getpid())
    loader = _loader(data, num_workers=2)
    batches = iter(loader)
    got = [next(batches) for _ in range(2)]
    workers = _live_children(os.getpid()) - before
    assert len(workers) == 2
    _signal_from_another_process(workers, sig)
    time.sleep(0.5)  # time for a worker that does act on the signal to die of it
    assert {pid for pid in workers if _is_running(pid)} == workers
    got += [next(batches) for _ in range(6)]
    assert _same(got, expected)
    # Dropping the loader still shuts its workers down.
    del batches, loader
    assert _wait_until_gone(workers) == set()


EXIT_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from kempnerforge.data.dataset import MemoryMappedDataset
    from kempnerforge.data.dataloader import build_train_loader
    from kempnerforge.data.sampling.sampler import ShardedSampler

    dataset = MemoryMappedDataset(sys.argv[1], seq_len=4)
    loader = build_train_loader(dataset, ShardedSampler(len(dataset), 0, 1, seed=5), 2, 2, 5)
    batches = iter(loader)
    next(batches)
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            children.append(stat.parent.name)
    print(" ".join(children), flush=True)
    if sys.argv[2] == "wait":
        time.sleep(600)
    # Otherwise exit with the loader and its workers still alive at module level.
    """
)


def _start_script(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, set[int]]:
    script = tmp_path / "live_loader.py"
    script.write_text(EXIT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(script), _dataset(tmp_path), mode],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    workers = {int(pid) for pid in line.split()}
    assert len(workers) == 2, proc.stderr.read() if proc.stderr else line
    return proc, workers


def test_workers_still_alive_at_interpreter_exit_are_ended_without_a_hang(tmp_path):
    proc, workers = _start_script(tmp_path, "exit")
    try:
        _, err = proc.communicate(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        pytest.fail("the process hung at exit with its loader's workers alive")
    assert proc.returncode == 0, err[-3000:]
    assert _wait_until_gone(workers, timeout_s=2.0) == set()


def test_workers_exit_after_their_training_process_is_killed(tmp_path):
    proc, workers = _start_script(tmp_path, "wait")
    _signal_from_another_process(workers, signal.SIGTERM)
    time.sleep(0.5)
    assert {pid for pid in workers if _is_running(pid)} == workers
    proc.kill()
    proc.communicate(timeout=WAIT_S)
    # torch's watchdog notices the lost parent within its check interval (5 s).
    assert _wait_until_gone(workers) == set()
