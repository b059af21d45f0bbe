"""The background half of an async save: the DCP write in flight and the test-only fault delay.

Fault injection, for tests only and off unless set: ``KEMPNERFORGE_FAULT_SAVE_DELAY_S``
(float seconds) makes every save sleep after its DCP files are written and before its
marker, so a test can kill the process mid-save; ``KEMPNERFORGE_FAULT_SAVE_DELAY_FROM_STEP``
(int, default 0) limits the delay to saves of that step or later.
"""

from __future__ import annotations

import functools
import os
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.storage import StorageWriter

from kempnerforge.core.logging import get_logger

logger = get_logger(__name__)

FAULT_SAVE_DELAY_ENV = "KEMPNERFORGE_FAULT_SAVE_DELAY_S"
FAULT_SAVE_DELAY_FROM_STEP_ENV = "KEMPNERFORGE_FAULT_SAVE_DELAY_FROM_STEP"


def fault_save_delay(step: int) -> None:
    """Test-only: sleep $KEMPNERFORGE_FAULT_SAVE_DELAY_S before the marker of save `step`.

    Does nothing unless the variable is set; only steps >= $..._FROM_STEP are delayed.
    """
    delay_s = float(os.environ.get(FAULT_SAVE_DELAY_ENV) or 0)
    if delay_s > 0 and step >= int(os.environ.get(FAULT_SAVE_DELAY_FROM_STEP_ENV) or 0):
        logger.warning("fault injection: delaying the save of step %d by %.1f s", step, delay_s)
        time.sleep(delay_s)


@dataclass
class PendingSave:
    """A save whose files are being written in the background and which is not committed."""

    step: int
    tmp: Path
    """The ``step_<N>.tmp`` directory being written."""
    marker: dict[str, Any]
    """The completion marker the commit writes."""
    future: Future[None]
    """Done when the files are durable; holds the write's exception if it failed."""
    started_s: float
    """time.monotonic() when save() was called."""
    os_error: Callable[[], OSError | None] = lambda: None
    """The OS error this rank's own file writes raised, once the write is done (its
    report names a full disk, which DCP's message alone does not)."""


def _new_stager() -> DefaultStager:
    """Synchronous staging, no pinned/shared memory: what works on CPU and GPU alike."""
    return DefaultStager(StagingOptions(False, False, False, False))


@functools.cache
def stager_outlives_a_stage() -> bool:
    """Whether one DefaultStager can stage twice, keeping its buffers for the next save.

    torch 2.11's DefaultStager closes its StateDictStager at the end of every stage (to
    break a reference cycle): the buffers are dropped and so is its copy table, and the
    next stage with it fails (KeyError: <class 'type'>). There every save needs a stager
    of its own. Found out once per process by staging a one-element state twice.
    """
    stager = _new_stager()
    try:
        for _ in range(2):
            stager.stage({"probe": [torch.zeros(1)]})
    except Exception:  # any failure to stage again: a fresh stager per save is always right
        return False
    finally:
        stager.close()
    return True


class BackgroundWriter:
    """Starts DCP async saves and finishes each on a thread of its own.

    Before ``start`` returns, every tensor is copied into CPU staging buffers, so later
    in-place updates of parameters or optimizer moments never reach the files. Where
    torch allows it (stager_outlives_a_stage) the buffers are kept and reused by the next
    save (a copy into memory already mapped is several times faster than into fresh
    memory): async mode then holds one CPU copy of the model and optimizer state for the
    writer's life. The caller must not start a save before the previous one is done, as
    the copy overwrites its buffers. The returned future is done after DCP has written
    and fsynced the files and the fault delay (if any) has passed, never on the caller's
    thread.
    """

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._stager: DefaultStager | None = None

    def start(
        self,
        state_dict: dict[str, Any],
        writer: StorageWriter,
        *,
        step: int,
        process_group: dist.ProcessGroup | None,
        no_dist: bool,
        then: Callable[[], None],
    ) -> Future[None]:
        """Stage `state_dict`, write it through `writer` (a DCP storage writer that knows
        its directory), then run `then` (both in the background); `step` selects the fault
        delay."""
        if no_dist:
            # DCP warns from its own thread that it assumes one process: that is our intent.
            warnings.filterwarnings(
                "ignore", message=r".*assuming the intent is to save in a single process.*"
            )
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="kempnerforge-checkpoint")
        if self._stager is None or not stager_outlives_a_stage():
            self._stager = _new_stager()
        upload = dcp_async_save(
            state_dict,
            storage_writer=writer,
            process_group=process_group,
            no_dist=no_dist,
            async_stager=self._stager,
        )
        assert isinstance(upload, Future), "synchronous staging: done before async_save returns"
        assert self._executor is not None
        return self._executor.submit(_finish_write, upload, then, step)


def _finish_write(upload: Future[Any], then: Callable[[], None], step: int) -> None:
    upload.result()
    then()
    fault_save_delay(step)
