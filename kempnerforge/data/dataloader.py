"""TrainDataLoader: a StatefulDataLoader that resumes exactly, also across worker counts."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import torch
from torch.utils.data import Dataset
from torch.utils.data.dataloader import _BaseDataLoaderIter
from torchdata.stateful_dataloader import StatefulDataLoader

from kempnerforge.core.logging import get_logger
from kempnerforge.data.sampling import MixtureSampler, ShardedSampler

logger = get_logger(__name__)

# Signals the training process turns into a clean stop (save, then exit 75). A group signal
# (slurmd ending a job step, Ctrl-C in a terminal) reaches the loader's workers as well.
_IGNORED_IN_WORKERS = (signal.SIGINT, signal.SIGUSR1)


class TrainDataLoader(StatefulDataLoader):
    """StatefulDataLoader whose ``iter`` continues a started epoch instead of restarting it.

    A plain one restarts the epoch when asked for a new iterator mid-epoch; a training loop
    that drops its iterator (after swapping or reloading data) wants the next batch instead.
    So a new iterator is built from this loader's own state_dict, which with workers also
    accounts for batches they prefetched but nobody consumed.
    """

    def __iter__(self) -> _BaseDataLoaderIter:
        iterator = self._iterator
        if (
            self.next_iter_state is None
            and iterator is not None
            and not self._initial_iter_for_state_dict
            and not getattr(iterator, "_finished", True)
            and getattr(iterator, "_num_yielded", 0) > 0
        ):
            self.load_state_dict(self.state_dict())
        return super().__iter__()


def leave_stop_signals_to_parent(worker_id: int) -> None:
    """Worker init: stop signals from anyone but the training process leave the worker running.

    torch's worker handler ends a worker on a SIGTERM from anywhere, and the training process
    then fails on the lost worker instead of saving; so the stop is left to the training
    process, which shuts the workers down itself. SIGINT and SIGUSR1 are ignored. SIGTERM
    cannot be: the training process and multiprocessing's exit handler stop leftover workers
    with it, and an ignoring worker would hang that exit. So it is blocked and taken by a
    thread that exits the worker when the training process sent it, as torch's handler does.
    A worker whose training process died still exits on its own (torch's watchdog).

    Runs after torch's own worker signal setup, which it overrides.
    """
    for signum in _IGNORED_IN_WORKERS:
        signal.signal(signum, signal.SIG_IGN)
    # Blocked before the thread starts, and before torch starts threads of its own here,
    # so every thread of the worker inherits the block and only sigwaitinfo receives it.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    parent = os.getppid()
    threading.Thread(
        target=_exit_on_sigterm_from,
        args=(parent,),
        name=f"sigterm-from-{parent}",
        daemon=True,
    ).start()


def _exit_on_sigterm_from(parent: int) -> None:
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid == parent:
            # The worker has nothing to flush: its results travel through queues the
            # training process has already given up on when it terminates a worker.
            os._exit(0)


def stop_workers(iterator: Any) -> None:
    """Stop a dropped loader iterator's worker processes now.

    Left to the garbage collector, an iterator caught in a reference cycle is shut down in
    whatever order the collector picks: its queues may be finalised first, so the stop
    message never reaches the workers and each one sits out torch's 5 s join timeout
    before it is killed, stalling whatever code the collection interrupted. A single-process
    iterator has no workers and is left alone.
    """
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def build_train_loader(
    dataset: Dataset[Any],
    sampler: ShardedSampler | MixtureSampler,
    batch_size: int,
    num_workers: int,
    seed: int,
) -> TrainDataLoader:
    """The training loader: whole batches only, deterministic given ``seed``.

    Its workers leave stop signals to the training process (leave_stop_signals_to_parent).
    """
    return TrainDataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=True,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        pin_memory=torch.cuda.is_available(),
        # Seeds the workers' base seed; the order itself comes from the sampler.
        generator=torch.Generator().manual_seed(seed),
        # Snapshot at every batch, so a saved state is exact without replaying batches.
        snapshot_every_n_steps=1,
        worker_init_fn=leave_stop_signals_to_parent if num_workers > 0 else None,
    )


def state_num_workers(state: dict[str, Any]) -> int:
    """Worker count of the loader that saved ``state``."""
    if "_snapshot" in state:
        return int(state["_snapshot"]["_main_snapshot"]["_num_workers"])
    return 0


def sampler_state_of(state: dict[str, Any]) -> dict[str, Any] | None:
    """The ShardedSampler state inside a saved StatefulDataLoader state, if it has one."""
    main = state["_snapshot"]["_main_snapshot"] if "_snapshot" in state else state
    iter_state = main.get("_sampler_iter_state") or {}
    return iter_state.get("sampler_state")


def load_loader_state(
    loader: TrainDataLoader, sampler: ShardedSampler | MixtureSampler, state: dict[str, Any]
) -> None:
    """Restore ``state`` into ``loader``, even one with another worker count.

    With the same worker count the loader restores itself (exact); otherwise the sampler's
    position is restored alone, which is exact too because the loader snapshots every batch.
    """
    if not state:
        return
    sampler_state = sampler_state_of(state)
    if sampler_state is None:
        raise ValueError("dataloader state holds no ShardedSampler state")
    # Restored now, not only when the next iterator is built, so the epoch reads right at once.
    sampler.load_state_dict(sampler_state)
    saved_workers = state_num_workers(state)
    if saved_workers == loader.num_workers:
        loader.load_state_dict(state)
        return
    logger.info(
        "dataloader workers changed from %d to %d: resuming from the sampler position",
        saved_workers,
        loader.num_workers,
    )
    loader.load_state_dict({})
