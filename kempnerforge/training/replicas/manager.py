"""torchft's side of one replica group: its Manager over the group's own store, and the sums
over the groups of a step's quorum (TorchftReplicas). torchft is imported only when called."""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from kempnerforge.config.fault_tolerance import FaultToleranceConfig
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.training.replicas.participation import Participation
from kempnerforge.training.session import Replicas

if TYPE_CHECKING:
    from torchft import Manager


class TorchftReplicas(Replicas):
    """Sums over the replica groups of the step's quorum through torchft's collectives.

    A failed collective leaves the tensor undefined and makes should_commit answer False,
    so the attempt is redone; nothing here raises for it.
    """

    replays_attempts = False

    def __init__(self, manager: Manager, num_groups: int, participation: Participation) -> None:
        self._manager = manager
        self.num_groups = num_groups
        self.participation = participation

    def metrics_row(self) -> dict[str, float]:
        """replica/participation and replica/heals_per_hour (participation.py)."""
        return self.participation.row()

    def sum_(self, tensor: torch.Tensor) -> None:
        from torch.distributed import ReduceOp

        self._manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()

    def sum_router_totals(self, model: torch.nn.Module) -> None:
        """One all-reduce of every MoE layer's step totals (router_step.sum_step_totals)."""
        from kempnerforge.model.moe import sum_step_totals

        sum_step_totals(model, self.sum_)

    def sum_gradients(self, model: torch.nn.Module) -> None:
        """One all-reduce of every gradient of this rank (local shards), flattened."""
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in model.parameters() if p.grad is not None]
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        if not local:
            return
        flat = torch.cat([g.reshape(-1).to(torch.float32) for g in local])
        self.sum_(flat)
        offset = 0
        for g in local:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def make_manager(
    ft: FaultToleranceConfig,
    runtime: RuntimeContext,
    group_id: int,
    load: Callable[[dict[str, Any]], None],
    save: Callable[[], dict[str, Any]],
) -> Manager:
    """torchft's Manager for this rank of group ``group_id``, over the group's own store."""
    from torchft import Manager
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    from kempnerforge.distributed.live_state import WeightsOnlyHTTPTransport

    timeout = timedelta(seconds=ft.timeout_s)
    store_addr, store_port = _group_store(runtime.is_distributed)
    if runtime.device.type == "cuda":
        pg: Any = ProcessGroupNCCL(timeout=timeout)
    else:
        pg = ProcessGroupGloo(timeout=timeout)
    return Manager(
        pg=pg,
        load_state_dict=load,
        state_dict=save,
        min_replica_size=ft.min_replica_groups,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=ft.quorum_timeout_s),
        connect_timeout=timeout,
        rank=runtime.rank,
        world_size=runtime.world_size,
        store_addr=store_addr,
        store_port=store_port,
        lighthouse_addr=ft.lighthouse_address(),
        replica_id=f"replica_{group_id}",
        checkpoint_transport=WeightsOnlyHTTPTransport(timeout, num_chunks=0),
        # Every group draws the same initial weights from train.seed: nothing to sync.
        init_sync=False,
    )


_STORES: list[Any] = []  # a single-process group's own store lives as long as the process


def _group_store(distributed: bool) -> tuple[str, int]:
    """The group's TCPStore: torchrun's (MASTER_ADDR/MASTER_PORT) for a group of several
    processes; a fresh one on a free port for a group of one process. Its host as the other
    groups reach it (advertised_host): a quorum hands one group's store to all of them."""
    if distributed:
        return advertised_host(os.environ["MASTER_ADDR"]), int(os.environ["MASTER_PORT"])
    from torch._C._distributed_c10d import TCPStore  # what torch.distributed re-exports

    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    _STORES.append(store)
    return advertised_host("localhost"), store.port


def advertised_host(host: str) -> str:
    """The name by which other nodes reach a store this node serves at ``host``: ``host``
    itself, unless it is a loopback name or address (torchrun --standalone's MASTER_ADDR,
    a one-process group's own store), which every node would take for itself; then this
    node's host name. A TCPStore's server listens on every interface, so the host name
    reaches it from this node as well."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost")
    return socket.gethostname() if loopback else host
