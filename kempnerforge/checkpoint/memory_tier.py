"""The memory tier: each rank's share of the training state, copied every
checkpoint.memory_interval steps into node-local shared memory (a tmpfs such as /dev/shm)
that outlives the training processes. A worker killed, or every worker of a node restarted
by torchrun, resumes from the newest copy every rank holds, taken a few steps ago, instead
of the last persistent checkpoint, and reads it at memory speed.

Layout: ``<memory_dir>/<run key>/step_<N>/rank_<R>.pt``, ``<run key>`` a hash of the
checkpoint directory and the world size, so two runs on a node never share a copy and a
launch of another world size finds none. A file is written under a ``.tmp`` name and
renamed, so one that exists is whole. A copy holds this rank's local shards (of every
parameter, buffer and optimizer state tensor, as the layout splits them), the scheduler's
state and the rank's train state, all plain tensors and values that a weights-only load
reads back: it resumes on the layout that wrote it. The newest ``keep`` steps stay; older
ones go once a newer one is whole.

Cost: per kept step, one more copy of the rank's share in host memory. The snapshot (a copy
to host memory, from the device on a GPU) is taken between steps; writing it into the
tmpfs happens on a background thread, at most one at a time.

On a job of several nodes each copy is also sent to a peer rank on another node, which
keeps it as ``step_<N>/peer_<R>.pt`` (checkpoint/memory_peer.py): a restart after a whole
node was lost takes a rank's copy from its peer. The ranks agree on the newest step every
one of them can reach, its own copy or the one its peer keeps.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from kempnerforge.checkpoint.memory_peer import (
    PeerLink,
    agree_newest,
    file_bytes,
    file_of_size,
    transfer,
)
from kempnerforge.core.logging import get_logger

logger = get_logger(__name__)

STEP_PREFIX = "step_"


def run_key(checkpoint_dir: str, world_size: int) -> str:
    """The memory tier's folder name of a run: its checkpoint directory and world size."""
    text = f"{os.path.abspath(checkpoint_dir)}|{world_size}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _host_copy(value: Any) -> Any:
    """``value`` with every tensor replaced by a host copy of its local shard."""
    if isinstance(value, torch.Tensor):
        return _local(value).detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _host_copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_host_copy(v) for v in value)
    return value


def snapshot(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    train_state: dict[str, Any],
) -> dict[str, Any]:
    """This rank's share of the training state, copied to host memory now."""
    return {
        "model": _host_copy(model.state_dict()),
        "optimizer": _host_copy(optimizer.state_dict()),
        "scheduler": _host_copy(scheduler.state_dict()),
        "train_state": _host_copy(train_state),
    }


def restore(
    saved: dict[str, Any],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
) -> dict[str, Any]:
    """Put a snapshot back into the live model, optimizer and scheduler of the layout that
    took it; returns its train state. Parameters and buffers are copied into their local
    shards in place; optimizer state tensors shaped as their parameter's shard become
    shards of the same layout again."""
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            _local(tensor).copy_(saved["model"][name])
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = saved["optimizer"]
    for index, entries in state["state"].items():
        param = params[int(index)]
        state["state"][index] = {k: _like(v, param) for k, v in entries.items()}
    optimizer.load_state_dict(state)
    scheduler.load_state_dict(saved["scheduler"])
    return saved["train_state"]


def _like(value: Any, param: torch.Tensor) -> Any:
    """An optimizer state entry on the parameter's device, a shard of the parameter's
    layout when it is shaped as the parameter's shard."""
    if not isinstance(value, torch.Tensor):
        return value
    if isinstance(param, DTensor) and value.shape == param.to_local().shape and value.dim():
        return DTensor.from_local(
            value.to(param.device),
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    return value.to(param.device) if value.dim() else value


class MemoryTier:
    """This rank's copies in ``root`` (``<memory_dir>/<run key>``), and those of the rank
    whose copies it keeps when ``peer`` links it to other nodes."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        rank: int,
        keep: int = 2,
        peer: PeerLink | None = None,
    ) -> None:
        self.root = Path(root)
        self.rank = rank
        self.keep = keep
        self.peer = peer
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None

    def _file(self, step: int, owner: int | None = None) -> Path:
        """This rank's copy of ``step``, or the kept copy of rank ``owner``'s."""
        name = f"rank_{self.rank}.pt" if owner is None else f"peer_{owner}.pt"
        return self.root / f"{STEP_PREFIX}{step}" / name

    def steps(self, owner: int | None = None) -> list[int]:
        """Steps of which this rank holds a whole copy of its own (of rank ``owner``'s,
        kept for it), oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            name = entry.name
            if name.startswith(STEP_PREFIX) and name[len(STEP_PREFIX) :].isdigit():
                step = int(name[len(STEP_PREFIX) :])
                if self._file(step, owner).is_file():
                    found.append(step)
        return sorted(found)

    def save(self, step: int, state: dict[str, Any]) -> str:
        """Write ``state`` (a snapshot) as this rank's copy of ``step`` on a background
        thread, after the previous write has finished; then drop copies beyond ``keep``.
        Returns the copy's path."""
        self.wait()
        self._writer = threading.Thread(
            target=self._write, args=(step, state), name="memory-tier-writer", daemon=True
        )
        self._writer.start()
        return str(self._file(step))

    def wait(self) -> None:
        """Finish the write in flight; a failed write is logged, not raised (the tier is a
        faster way back, the persistent checkpoints remain the guarantee)."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            logger.warning("memory tier: a copy was not written: %s", self._error)
            self._error = None

    def _write(self, step: int, state: dict[str, Any]) -> None:
        written: Path | None = None
        try:
            target = self._file(step)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(target.name + ".tmp")
            torch.save(state, tmp)
            os.replace(tmp, target)
            written = target
            self._drop_beyond_keep(None)  # at once: never more than keep of its own
        except BaseException as error:  # noqa: BLE001 - reported by wait()
            self._error = error
        if self.peer is not None:  # even without a copy: the peer waits to hear so
            try:
                self._swap_with_peers(step, written)
                self._drop_beyond_keep(self.peer.source)
            except BaseException as error:  # noqa: BLE001 - reported by wait()
                self._error = self._error or error

    def _drop_beyond_keep(self, owner: int | None) -> None:
        """Remove all but the newest ``keep`` copies of this rank's (of ``owner``'s)."""
        for old in self.steps(owner)[: -self.keep]:
            self._drop(old, owner)

    def _swap_with_peers(self, step: int, written: Path | None) -> None:
        """Send this rank's copy of ``step`` to its peer; keep its source's copy."""
        assert self.peer is not None
        kept = self._file(step, self.peer.source)
        tmp = kept.with_name(kept.name + ".tmp")
        received = transfer(
            self.peer,
            None if written is None else file_bytes(written),
            to=self.peer.peer,
            step=step,
            receive_from=self.peer.source,
            receive_into=file_of_size(tmp),
        )
        if received is not None:
            del received  # the mapping, written through into the file
            os.replace(tmp, kept)

    def _owners(self) -> list[int | None]:
        """Whose copies this rank holds: its own (None), and its source's when it keeps them."""
        return [None] if self.peer is None else [None, self.peer.source]

    def _drop(self, step: int, owner: int | None = None) -> None:
        self._file(step, owner).unlink(missing_ok=True)
        folder = self._file(step).parent
        with contextlib.suppress(OSError):
            folder.rmdir()  # the last rank's file gone: the step's folder goes too

    def reachable_steps(self) -> list[int]:
        """Steps of which this rank can read its copy back: its own, and those its peer
        keeps for it. Collective over this rank's pair groups (every rank calls it)."""
        own = self.steps()
        if self.peer is None:
            return own
        kept = torch.tensor(self.steps(self.peer.source)[-8:], dtype=torch.int64)
        from_peer = transfer(
            self.peer,
            kept,
            to=self.peer.source,
            step=-1,
            receive_from=self.peer.peer,
            receive_into=lambda n: torch.empty(n, dtype=torch.int64),
        )
        return sorted(set(own) | set(from_peer.tolist() if from_peer is not None else []))

    def fetch(self, step: int) -> int | None:
        """Make sure this rank holds its own copy of ``step``, taking the one its peer keeps
        when it has none; returns the rank it took it from, None when it had its own.
        Collective over the pair groups: every rank calls it with the same step, and sends
        its source the copy it keeps of it when the source lacks one."""
        need = not self._file(step).is_file()
        if self.peer is None:
            return None
        flag = torch.tensor([int(need)], dtype=torch.int64)
        source_needs = transfer(
            self.peer,
            flag,
            to=self.peer.peer,
            step=step,
            receive_from=self.peer.source,
            receive_into=lambda n: torch.empty(n, dtype=torch.int64),
        )
        give = source_needs is not None and bool(source_needs[0])
        kept = self._file(step, self.peer.source)
        mine = self._file(step)
        tmp = mine.with_name(mine.name + ".tmp")
        received = transfer(
            self.peer,
            file_bytes(kept) if give and kept.is_file() else None,
            to=self.peer.source if give else None,
            step=step,
            receive_from=self.peer.peer if need else None,
            receive_into=file_of_size(tmp),
        )
        if need and received is None:
            raise RuntimeError(
                f"memory tier: rank {self.peer.peer} keeps no copy of step {step} for rank "
                f"{self.rank}, although it said it did"
            )
        if received is None:
            return None
        del received
        os.replace(tmp, mine)
        return self.peer.peer

    def load(self, step: int) -> dict[str, Any]:
        """This rank's copy of ``step``, read weights-only (nothing in it can run code) and
        mapped, not read: restore copies each tensor from the tmpfs straight into its live one."""
        return torch.load(self._file(step), map_location="cpu", weights_only=True, mmap=True)

    def close(self, *, finished: bool) -> None:
        """At the end of a launch: a finished run's copies go (its last checkpoint holds the
        end); a stopped one's stay for its relaunch, the write in flight finished."""
        if finished:
            self.clear()
        else:
            self.wait()

    def clear(self) -> None:
        """Remove this rank's copies, and the run's folders once no rank's are left in
        them (each rank clears its own: no rank waits for another)."""
        self.wait()
        for owner in self._owners():
            for step in self.steps(owner):
                self._drop(step, owner)
        with contextlib.suppress(OSError):
            self.root.rmdir()


def agreed_step(
    tier: MemoryTier, group: dist.ProcessGroup | None, device: torch.device | None = None
) -> int | None:
    """The newest step of which every rank of ``group`` (None: this process alone) can read
    its copy back (its own, or its peer's: MemoryTier.reachable_steps), or None. A few
    all-reduces of one number on ``device`` (the group's device), whatever the world size
    (memory_peer.agree_newest)."""
    mine = tier.reachable_steps()
    if group is None:
        return mine[-1] if mine else None

    def all_min(value: int) -> int:
        number = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(number, op=dist.ReduceOp.MIN, group=group)
        return int(number.item())

    return agree_newest(mine, all_min)[0]
