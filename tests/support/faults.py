"""Hooks that make real faults happen inside a run, for the fault-tolerance tests.

Hooks are built with no arguments, so each reads its settings from the environment, which
run_distributed hands to every rank.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import time
from typing import Any

import torch

from kempnerforge.training.hooks import StepContext, TrainingHook
from kempnerforge.training.session import TrainingSession

FSIZE_RANK_ENV = "KF_TEST_FSIZE_RANK"
FSIZE_FROM_ENV = "KF_TEST_FSIZE_LIMIT_AT"
FSIZE_UNTIL_ENV = "KF_TEST_FSIZE_LIFT_AT"
FSIZE_LIMIT_BYTES = 48 * 1024
"""Larger than anything a rank writes but its checkpoint files (the tiny model's DCP shard
and optimizer moments are larger); metrics and logs stay far below it."""

SLEEP_RANK_ENV = "KF_TEST_SLEEP_RANK"
SLEEP_AT_ENV = "KF_TEST_SLEEP_AT"


def _steps(name: str) -> set[int]:
    return {int(s) for s in os.environ.get(name, "").split(",") if s}


class FileSizeLimit(TrainingHook):
    """On rank $KF_TEST_FSIZE_RANK, after the steps in $KF_TEST_FSIZE_LIMIT_AT, limit the
    size of any file this process writes (RLIMIT_FSIZE), so a save's writes fail with a
    real EFBIG; after the steps in $KF_TEST_FSIZE_LIFT_AT, lift the limit again.

    on_step_end runs before the loop saves that step, so the save of a limited step fails.
    """

    def __init__(self) -> None:
        self.active = os.environ.get("RANK", "0") == os.environ.get(FSIZE_RANK_ENV)
        self.limit_at, self.lift_at = _steps(FSIZE_FROM_ENV), _steps(FSIZE_UNTIL_ENV)

    def on_step_end(self, ctx: StepContext) -> None:
        if not self.active:
            return
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        if ctx.step in self.limit_at:
            # A write past the limit then fails with EFBIG instead of killing the process.
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT_BYTES, hard))
        elif ctx.step in self.lift_at:
            resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))


def sleep_through_the_collective(seconds: float) -> None:
    """Sleep, as a rank stuck outside the step's collectives would (the name is what its
    stack dump shows)."""
    time.sleep(seconds)


class SleepOnOneRank(TrainingHook):
    """On rank $KF_TEST_SLEEP_RANK, at the end of step $KF_TEST_SLEEP_AT, sleep an hour:
    the other ranks wait for it in the next step's first collective."""

    def __init__(self) -> None:
        self.active = os.environ.get("RANK", "0") == os.environ.get(SLEEP_RANK_ENV)
        self.at = _steps(SLEEP_AT_ENV)

    def on_step_end(self, ctx: StepContext) -> None:
        if self.active and ctx.step in self.at:
            sleep_through_the_collective(3600)


PAUSE_S = 0.05


class PauseAfterEachStep(TrainingHook):
    """Sleep PAUSE_S after each step: a run that only waits to be stopped (by a time
    limit's warning, a signal) then spends its wait asleep instead of training thousands
    of steps, leaving the cores to the rest of the suite."""

    def on_step_end(self, ctx: StepContext) -> None:
        time.sleep(PAUSE_S)


KILL_AT_ENV = "KF_TEST_KILL_AT"
KILL_ARMED_ENV = "KF_TEST_KILL_ARMED"
KILL_RANK_ENV = "KF_TEST_KILL_RANK"


class KillOnceAt(TrainingHook):
    """SIGKILL this process (rank $KF_TEST_KILL_RANK, 0 by default) at the end of step
    $KF_TEST_KILL_AT when the file named by $KF_TEST_KILL_ARMED exists; the file goes
    first, so the relaunch trains through."""

    def __init__(self) -> None:
        self.step = int(os.environ.get(KILL_AT_ENV, "0"))
        self.armed = os.environ.get(KILL_ARMED_ENV, "")
        self.active = os.environ.get("RANK", "0") == os.environ.get(KILL_RANK_ENV, "0")

    def on_step_end(self, ctx: StepContext) -> None:
        if self.active and ctx.step == self.step and os.path.exists(self.armed):
            self.kill()

    def kill(self) -> None:
        os.remove(self.armed)
        os.kill(os.getpid(), signal.SIGKILL)


class KillNodeOnceAt(KillOnceAt):
    """KillOnceAt, the rank's node lost with it: its torchrun (the rank's parent) and the
    rank SIGKILLed at once."""

    def kill(self) -> None:
        os.remove(self.armed)
        os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


class KillEveryLaunchAt(KillOnceAt):
    """KillOnceAt, the file left in place: every launch that reaches the step dies there."""

    def kill(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


def crash_at_step(session: TrainingSession, step: int) -> None:
    """Make ``session``'s step body raise RuntimeError("the node went away") when the loop
    asks for ``step`` (0-based, so the steps before it are taken): a process lost mid-run,
    after whatever it last saved."""
    inner = session.step_fn

    def crashing(s: TrainingSession, at: int):
        if at == step:
            raise RuntimeError("the node went away")
        return inner(s, at)

    session.step_fn = crashing


class PoisonedSamples:
    """Bad data for tests, as a loss function: NaN on every micro-batch that holds one of
    ``samples`` of ``dataset`` (found by its labels row, so it follows the sample wherever
    the data order puts it), else ``real``'s loss. Records every labels row it is given."""

    def __init__(self, real: Any, dataset: Any, samples: list[int]) -> None:
        self.real = real
        self.poison = {dataset[i]["labels"].numpy().tobytes() for i in samples}
        self.rows: list[bytes] = []

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        rows = [row.numpy().tobytes() for row in labels]
        self.rows += rows
        loss = self.real(logits, labels)
        return loss * float("nan") if self.poison & set(rows) else loss


NAN_AT_ENV = "KF_TEST_NAN_AT"
"""Steps after which NaNWeightsAt or NaNOutputOnce strikes (comma-separated)."""


class NaNWeightsAt(TrainingHook):
    """After the steps in $KF_TEST_NAN_AT, fill the model's first parameter with NaN: every
    later step's loss is NaN however often it is re-run, a divergence no retry can mend."""

    def __init__(self) -> None:
        self.at = _steps(NAN_AT_ENV)

    def on_step_end(self, ctx: StepContext) -> None:
        if ctx.step in self.at:
            with torch.no_grad():
                next(ctx.model.parameters()).fill_(float("nan"))


class NaNOutputOnce(TrainingHook):
    """After the steps in $KF_TEST_NAN_AT, make the model's next forward output NaN, once:
    a fault of the machine (a bad kernel launch, a flipped bit) that the step's re-run on
    the same weights and batches does not repeat."""

    def __init__(self) -> None:
        self.at = _steps(NAN_AT_ENV)

    def on_step_end(self, ctx: StepContext) -> None:
        if ctx.step not in self.at:
            return

        def poison(module: torch.nn.Module, args: Any, output: Any) -> Any:
            handle.remove()
            if isinstance(output, torch.Tensor):
                return output * float("nan")
            # A tuple whose first item is the logits or the head's loss (HeadLoss).
            poisoned = [output[0] * float("nan"), *output[1:]]
            return output._make(poisoned) if hasattr(output, "_make") else type(output)(poisoned)

        handle = ctx.model.register_forward_hook(poison)


FILL_ENV = "KF_TEST_FILL"
"""What FillDisk fills: entries ``STEP:DIR[:inodes][:pad=FILE]``, separated by spaces."""


class FillDisk(TrainingHook):
    """After the steps $KF_TEST_FILL names, fill the file system of each entry's DIR: one
    file grown until the OS answers ENOSPC, for an ``inodes`` entry also empty files until
    no inode is left (a new directory then fails too), and for a ``pad=FILE`` entry first
    the free end of FILE's last block (FILE relative to DIR: a run's metrics.jsonl), with
    a padding row, so that the very next append to FILE fails. The disk stays full: every
    later write there that needs a new block (or inode) fails with a real ENOSPC.

    on_step_end runs after the step's metrics row and before the loop saves that step.
    """

    def __init__(self) -> None:
        self.entries: list[tuple[int, str, list[str]]] = []
        for entry in os.environ.get(FILL_ENV, "").split():
            step, directory, *options = entry.split(":")
            self.entries.append((int(step), directory, options))

    def on_step_end(self, ctx: StepContext) -> None:
        for step, directory, options in self.entries:
            if step != ctx.step:
                continue
            for option in options:
                if option.startswith("pad="):
                    pad_last_block(os.path.join(directory, option[len("pad=") :]), ctx.step)
            fill_file_system(directory, inodes="inodes" in options)


def pad_last_block(path: str, step: int) -> None:
    """Append one JSON row to ``path`` that ends exactly at a block boundary (tmpfs gives
    a file whole pages), so the file's next append needs a new block."""
    block = os.statvfs(path).f_bsize
    head = json.dumps({"event": "test_padding", "step": step, "pad": ""})[:-2]
    free = -os.path.getsize(path) % block
    width = free - len(head) - 3  # the row's closing '"}' and its newline
    if width < 0:
        width += block
    with open(path, "a") as f:
        f.write(head + "x" * width + '"}\n')


def fill_file_system(directory: str, *, inodes: bool) -> None:
    """Take every free block (and with ``inodes`` every free inode) of ``directory``'s file
    system, with files named ``filler*`` there."""
    chunk = b"\0" * 4096
    with open(os.path.join(directory, "filler"), "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise
    count = 0
    while inodes:
        try:
            os.close(os.open(os.path.join(directory, f"filler-{count}"), os.O_CREAT | os.O_WRONLY))
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise
            break
        count += 1
