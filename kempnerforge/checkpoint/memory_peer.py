"""The memory tier's peer copies: each rank's copy also lives in the host memory of one
other node, so a restart after a whole node was lost (its processes and its tmpfs) still
finds a copy of every rank's share.

Rank r sends each copy to its *peer*, the same local rank on the next node,
(r + local_world_size) mod world_size, and keeps the copies of its *source*,
(r - local_world_size) mod world_size, as ``step_<N>/peer_<source>.pt`` beside its own.
torchrun and srun number ranks node by node, so peer and source sit on other nodes
whenever the job spans more than one. A rank talks only to those two, over two-rank gloo
channels of their own (one when peer and source are the same rank): no world-wide group,
nothing on the training's groups, and the transfers of a copy run on the memory tier's
writer thread only, so no channel is used from two threads.

Cost: one more copy of the source's share in this node's host memory per kept step, and
each copy sent over the network once, in CHUNK_BYTES pieces read from (and written into)
the tmpfs files themselves: no second copy in process memory.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.distributed.distributed_c10d import PrefixStore, ProcessGroupGloo, Store

CHUNK_BYTES = 64 << 20
"""The largest message of a transfer (gloo's sizes are counted in 32-bit integers
in places; 64 MiB keeps each well clear)."""

PAIR_TIMEOUT = timedelta(minutes=5)
"""How long a transfer waits for its other rank before failing (a hung peer): the copy is
then missing, training goes on."""


@dataclass
class PeerLink:
    """This rank's two partners for peer copies and the pair channels it reaches them by."""

    rank: int
    peer: int
    """The rank that keeps this rank's copies."""
    source: int
    """The rank whose copies this rank keeps."""
    pairs: dict[int, ProcessGroupGloo]
    """The other rank -> a two-rank gloo channel of this rank and it (the lower rank is its
    rank 0)."""

    def send(self, tensor: torch.Tensor, to: int, tag: int) -> Any:
        channel: Any = self.pairs[to]  # a Backend: its send and recv are not in the stubs
        return channel.send([tensor], int(to > self.rank), tag)

    def recv(self, tensor: torch.Tensor, sender: int, tag: int) -> Any:
        channel: Any = self.pairs[sender]
        return channel.recv([tensor], int(sender > self.rank), tag)


def peer_ranks(rank: int, world_size: int, local_world_size: int) -> tuple[int, int] | None:
    """(peer, source) of ``rank``: the same local rank on the next node and on the previous
    one; None when the job is one node (no other node to keep a copy) or its nodes do not
    all run ``local_world_size`` ranks."""
    if local_world_size < 1 or world_size <= local_world_size or world_size % local_world_size:
        return None
    return (rank + local_world_size) % world_size, (rank - local_world_size) % world_size


_links_built = 0
"""Peer links this process has built (build_peer_link)."""


def ranks_per_node(world_size: int) -> int:
    """Ranks on each node as the launcher says: torchrun's LOCAL_WORLD_SIZE, else srun's
    SLURM_NTASKS_PER_NODE; the whole world (one node) when neither says."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return world_size


def build_peer_link(rank: int, world_size: int, local_world_size: int) -> PeerLink | None:
    """This rank's PeerLink (None on one node, see peer_ranks), joining its one or two pair
    channels through the job's store. Each is a gloo backend of its own, named by its pair,
    not a registered group: torch names a group created by some ranks only after how many
    each had created before, which differs round a ring. Every rank joins its pairs in one
    global order (lower rank, then higher), so no ring of ranks waits on each other."""
    ranks = peer_ranks(rank, world_size, local_world_size)
    if ranks is None:
        return None
    peer, source = ranks
    store = _default_store()
    # A process that builds several runs in turn in one world (the store's keys of an
    # earlier link still there) numbers its links, in the same order on every rank.
    global _links_built
    _links_built += 1
    pairs: dict[int, ProcessGroupGloo] = {}
    for other in sorted({peer, source}, key=lambda o: (min(rank, o), max(rank, o))):
        low, high = sorted((rank, other))
        pairs[other] = ProcessGroupGloo(
            PrefixStore(f"kempnerforge-memory-peer/{_links_built}/{low}-{high}/", store),
            int(rank == high),
            2,
            PAIR_TIMEOUT,
        )
    return PeerLink(rank, peer, source, pairs)


def _default_store() -> Store:
    """The store the job's ranks met through (torchrun's, or the init method's)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def transfer(
    link: PeerLink,
    outgoing: torch.Tensor | None,
    *,
    to: int | None,
    step: int,
    receive_from: int | None = None,
    receive_into: Callable[[int], torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """Send ``outgoing`` (a 1-D tensor; None: nothing to send this time) to rank ``to``
    while receiving from ``receive_from`` into the tensor ``receive_into(numel)`` gives;
    returns it, or None when the sender had nothing. Either side may be None. A header
    (step, numel) goes first, so a transfer of another step is refused rather than mixed.
    Both directions are posted before either is waited on: two ranks that send to each
    other (a 2-node job) do not deadlock."""
    header = torch.tensor([step, -1 if outgoing is None else outgoing.numel()])
    incoming = torch.zeros(2, dtype=torch.int64)
    _wait(
        ([link.send(header, to, 0)] if to is not None else [])
        + ([link.recv(incoming, receive_from, 0)] if receive_from is not None else [])
    )
    received = None
    if receive_from is not None and int(incoming[1]) >= 0:
        if int(incoming[0]) != step:
            raise RuntimeError(
                f"memory tier: rank {receive_from} sent a copy of step {int(incoming[0])} "
                f"while this rank expected step {step}"
            )
        assert receive_into is not None
        received = receive_into(int(incoming[1]))
    requests = []
    if to is not None and outgoing is not None:
        requests += [link.send(piece, to, 1 + i) for i, piece in enumerate(_pieces(outgoing))]
    if received is not None:
        assert receive_from is not None
        requests += [
            link.recv(piece, receive_from, 1 + i) for i, piece in enumerate(_pieces(received))
        ]
    _wait(requests)
    return received


def _pieces(tensor: torch.Tensor) -> list[torch.Tensor]:
    """``tensor`` (1-D) as contiguous views of at most CHUNK_BYTES each."""
    per = max(1, CHUNK_BYTES // max(1, tensor.element_size()))
    return list(torch.split(tensor, per)) if tensor.numel() else []


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


def file_bytes(path: Path) -> torch.Tensor:
    """The bytes of the file at ``path`` as a uint8 tensor mapped onto it (a tmpfs file:
    no copy is read into process memory)."""
    size = os.path.getsize(path)
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)


def file_of_size(path: Path) -> Callable[[int], torch.Tensor]:
    """A receive_into for transfer: the file at ``path`` created with that many bytes and
    mapped, so what arrives is written straight into it."""

    def make(numel: int) -> torch.Tensor:
        path.parent.mkdir(parents=True, exist_ok=True)
        if numel == 0:
            path.write_bytes(b"")
            return torch.empty(0, dtype=torch.uint8)
        return torch.from_file(str(path), shared=True, size=numel, dtype=torch.uint8)

    return make


def agree_newest(steps: list[int], all_min: Callable[[int], int]) -> tuple[int | None, int]:
    """The newest step in every rank's ``steps`` (None when there is none), and the rounds
    it took. ``all_min`` is the minimum of a number over every rank (one all-reduce).

    Each round proposes the smallest of the ranks' newest steps below the last proposal,
    then asks whether every rank has it: two all-reduces of one number, whatever the world
    size. Proposals fall strictly, each one a step some rank holds, so the rounds are at
    most the distinct steps the ranks hold: a handful, as every rank copies on one schedule
    and keeps its newest two (and its source's two)."""
    bound: int | None = None
    rounds = 0
    while True:
        rounds += 1
        below = [s for s in steps if bound is None or s < bound]
        proposal = all_min(max(below, default=-1))
        if proposal < 0:
            return None, rounds
        if all_min(int(proposal in steps)) == 1:
            return proposal, rounds
        bound = proposal
