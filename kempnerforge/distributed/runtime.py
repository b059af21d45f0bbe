"""RuntimeContext: this process's place in the job (rank, device, data-parallel coordinates)."""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from kempnerforge.config.distributed import DistributedConfig
from kempnerforge.core.errors import ConfigError


@dataclass
class RuntimeContext:
    """This process's place in the job.

    ``device_mesh`` is the job's DeviceMesh over ``pp``, ``dp_replicate``, ``dp_shard``,
    ``cp`` (only when distributed.cp > 1) and ``tp`` (plus ``dp``, the two data-parallel
    dimensions flattened, and with context parallelism ``dp_cp`` and ``dp_shard_cp``, the
    same with ``cp`` joined), or None in a single process. Every collective the framework
    runs names its group through ``group()``: a reduction over the data-parallel ranks never
    counts tensor-parallel peers twice.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    dp_rank: int = 0
    dp_size: int = 1
    device_mesh: Any = None
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    """This rank's place along ``cp``: it holds slice cp_rank of every sequence."""
    cp_size: int = 1
    cp_ring: int = 1
    """Ranks of the key/value ring among the cp ranks (distributed.cp_attention resolved:
    config/context_parallel.py cp_degrees); 1 when attention exchanges heads only."""
    dp_mesh: Any = None
    """The data-parallel ranks (dp_replicate x dp_shard flattened) as a 1-D DeviceMesh."""
    cp_meshes: dict[str, Any] | None = None
    """With context parallelism (distributed.cp > 1): ``dp_cp`` (dp_replicate x dp_shard x
    cp flattened; the loss and token counts reduce over it) and ``dp_shard_cp`` (dp_shard x
    cp flattened; FSDP shards over it), kept here because slicing a flattened dimension
    from the job's mesh is deprecated; with a ring of Ulysses groups (1 < cp_ring < cp),
    ``cp_ulysses``, the cp / cp_ring consecutive cp ranks that exchange heads. None
    otherwise."""
    expert_mesh: Any = None
    """With expert parallelism (distributed.ep > 1): the ranks as a mesh of ``pp``,
    ``dp_replicate``, ``efsdp`` and ``ep``, where ``ep`` splits each dp_shard group
    (dp_shard_cp under context parallelism) into the ranks that hold different experts
    and ``efsdp`` counts the ranks holding the same ones (FSDP shards the expert weights
    over them). None otherwise."""
    side_group: Any = None
    """A gloo group over the world beside the default one, created once, for work off the
    training step: finding unresponsive ranks after a failed collective
    (kempnerforge.distributed.failure), the teardown barrier, and the background writes of
    async checkpoints. Never used by two threads at once: the loop waits for a background
    write before it tears down, and reports a failure only after that wait. None in a
    single process."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def group(self, name: str) -> dist.ProcessGroup | None:
        """The process group of mesh dimension ``name`` ('dp', 'dp_shard', 'dp_replicate',
        'cp', 'dp_cp', 'dp_shard_cp', 'cp_ulysses', 'tp', 'pp', 'ep', 'efsdp') or 'world';
        None where there is nothing to reduce over (a single process, or a dimension of
        size 1), so callers skip the collective."""
        if self.device_mesh is None:
            return None
        if name == "world":
            return dist.group.WORLD
        mesh = self._mesh(name)
        if mesh is None or mesh.size() == 1:
            return None
        return mesh.get_group()

    def mesh_size(self, name: str) -> int:
        """Size of mesh dimension ``name`` (1 in a single process, and for 'ep' or 'efsdp'
        without expert parallelism)."""
        mesh = self._mesh(name)
        return 1 if mesh is None else mesh.size()

    def sub_mesh(self, name: str) -> DeviceMesh | None:
        """The 1-D DeviceMesh of dimension ``name`` (the names of group()); None in a
        single process."""
        return self._mesh(name)

    def _mesh(self, name: str) -> DeviceMesh | None:
        if self.device_mesh is None:
            return None
        if name == "dp" or (name == "dp_cp" and self.cp_size == 1):
            return self.dp_mesh
        if name == "cp" and self.cp_size == 1:
            return None  # not a dimension of the mesh (see DistributedConfig.mesh_shape)
        if name == "dp_shard_cp" and self.cp_size == 1:
            return self.device_mesh["dp_shard"]
        if name == "cp_ulysses":
            return None if self.cp_meshes is None else self.cp_meshes.get(name)
        if name in ("dp_cp", "dp_shard_cp"):
            assert self.cp_meshes is not None
            return self.cp_meshes[name]
        if name in ("ep", "efsdp"):
            return None if self.expert_mesh is None else self.expert_mesh[name]
        return self.device_mesh[name]


def build_mesh(
    cfg: DistributedConfig, world_size: int, device: torch.device
) -> tuple[DeviceMesh, DeviceMesh]:
    """The job's DeviceMesh and its data-parallel ranks flattened to one dimension, ``dp``.

    Collective over the world: every rank builds the same mesh. JobConfig.validate has
    checked the shape against the world size before any rank got here.
    """
    shape = cfg.mesh_shape(world_size)
    mesh = init_device_mesh(device.type, tuple(shape.values()), mesh_dim_names=tuple(shape))
    return mesh, mesh["dp_replicate", "dp_shard"]._flatten("dp")


def build_cp_meshes(
    mesh: DeviceMesh, cfg: DistributedConfig, cp_ring: int = 1
) -> dict[str, DeviceMesh] | None:
    """``dp_cp`` and ``dp_shard_cp``, and ``cp_ulysses`` for a ring of ``cp_ring`` Ulysses
    groups (RuntimeContext.cp_meshes); None when distributed.cp is 1. Collective over the
    world, like build_mesh.

    Context-parallel peers hold the same weights and their own tokens: the loss and token
    counts reduce over dp_cp, and FSDP shards and averages gradients over dp_shard_cp.
    """
    if cfg.cp == 1:
        return None
    meshes = {
        "dp_cp": mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp"),
        "dp_shard_cp": mesh["dp_shard", "cp"]._flatten("dp_shard_cp"),
    }
    if 1 < cp_ring < cfg.cp:
        # cp rank = ring rank * ulysses + place: the Ulysses ranks are consecutive.
        split = mesh["cp"]._unflatten(0, (cp_ring, cfg.cp // cp_ring), ("cp_ring", "cp_ulysses"))
        meshes["cp_ulysses"] = split["cp_ulysses"]
    return meshes


def build_expert_mesh(
    cfg: DistributedConfig, world_size: int, device: torch.device
) -> DeviceMesh | None:
    """The ranks as (``pp``, ``dp_replicate``, ``efsdp``, ``ep``); None when
    distributed.ep is 1. Callers take the data-parallel dimensions by name.

    Collective over the world. Expert parallelism runs without tensor parallelism
    (JobConfig.validate), so the world is the pipeline stages times the data-parallel
    and context-parallel ranks, and rank r sits at the same place here as in the job's
    mesh: its ``ep`` peers are consecutive ranks of one dp_shard x cp group (dp_shard_cp)
    of one stage. Context-parallel peers route their own tokens like shard ranks.
    """
    if cfg.ep == 1:
        return None
    shard = cfg.resolved_dp_shard(world_size) * cfg.cp
    shape = (cfg.pp, cfg.dp_replicate, shard // cfg.ep, cfg.ep)
    names = ("pp", "dp_replicate", "efsdp", "ep")
    return init_device_mesh(device.type, shape, mesh_dim_names=names)


def world_size_from_env() -> int:
    """WORLD_SIZE as torchrun or SLURM set it; 1 for a plain `python` launch."""
    return int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))


def rank_from_env() -> int:
    """RANK as torchrun or SLURM set it; 0 for a plain `python` launch."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """train.device -> a torch.device; 'cuda' without a GPU is a config error."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("train.device", "cuda", "'cpu' or 'auto'", "no CUDA device found")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_runtime(cfg: DistributedConfig, device_name: str, cp_ring: int = 1) -> RuntimeContext:
    """Join the process group when launched with several processes; pick this rank's device.

    ``cp_ring`` is the job's key/value ring (config/context_parallel.py cp_ring: it reads
    the model's heads); 1, the default, is right for every job without one.
    """
    world_size = world_size_from_env()
    rank = rank_from_env()
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))
    device = resolve_device(device_name, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        backend = cfg.backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl" and device.type != "cuda":
            raise ConfigError(
                "distributed.backend", "nccl", "'gloo' or 'auto' on CPU", "NCCL needs GPUs"
            )
        # Binding the GPU makes NCCL form the default communicator now and lets the mesh
        # split its dimensions' groups from it (one call per dimension); unbound, every rank
        # creates every subgroup of every dimension one by one, O(world size) calls each.
        dist.init_process_group(
            backend,
            timeout=datetime.timedelta(seconds=cfg.timeout_s),
            device_id=device if backend == "nccl" else None,
        )
    if world_size == 1:
        return RuntimeContext(rank=rank, local_rank=local_rank, device=device)
    mesh, dp_mesh = build_mesh(cfg, world_size, device)
    return RuntimeContext(
        expert_mesh=build_expert_mesh(cfg, world_size, device),
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        device=device,
        dp_rank=dp_mesh.get_local_rank(),
        dp_size=dp_mesh.size(),
        device_mesh=mesh,
        dp_mesh=dp_mesh,
        tp_rank=mesh["tp"].get_local_rank(),
        tp_size=mesh["tp"].size(),
        pp_rank=mesh["pp"].get_local_rank(),
        pp_size=mesh["pp"].size(),
        cp_meshes=build_cp_meshes(mesh, cfg, cp_ring),
        cp_rank=mesh["cp"].get_local_rank() if cfg.cp > 1 else 0,
        cp_size=cfg.cp,
        cp_ring=cp_ring if cfg.cp > 1 else 1,
        side_group=dist.new_group(backend="gloo"),
    )


_left_a_process_group = False
_runs_share_the_world = False


@contextlib.contextmanager
def runs_sharing_the_world_group() -> Iterator[None]:
    """Inside this block, runs of one process join the same world group one after another:
    init_runtime joins the group that exists, and teardown_runtime leaves the run's own
    groups (its mesh dimensions, its side group) but not the world.

    A backend cannot join the world a second time in one process (the second rendezvous
    reads the first one's addresses), so a process that trains several runs in turn (the
    layout batches of check-parallel) keeps its first world group for all of them.
    """
    global _runs_share_the_world
    _runs_share_the_world = True
    try:
        yield
    finally:
        _runs_share_the_world = False


def teardown_runtime(runtime: RuntimeContext, *, together: bool = False) -> None:
    """Leave the process group, if this process joined one (inside
    runs_sharing_the_world_group: the run's own groups only).

    ``together`` (a run that ended normally on every rank) first waits at a barrier, so
    no rank tears its connections down while a peer still uses them: a peer's backend
    thread that sees a connection vanish mid-operation can abort its process.
    """
    global _left_a_process_group
    if dist.is_available() and dist.is_initialized():
        if together and runtime.side_group is not None:
            dist.barrier(group=runtime.side_group)
        if _runs_share_the_world:
            _leave_all_but_the_world()
            return
        dist.destroy_process_group()
        _left_a_process_group = True


def _leave_all_but_the_world() -> None:
    """Destroy every process group but the world (every rank calls this in step, after a
    barrier): the groups a run's meshes made hold connections and backend threads."""
    from torch.distributed import distributed_c10d

    world = distributed_c10d.GroupMember.WORLD
    for group in [g for g in distributed_c10d._world.pg_map if g is not world]:
        dist.destroy_process_group(group)


def left_a_process_group() -> bool:
    """Whether this process has left a process group (teardown_runtime).

    Such a process should end without Python's finalisation (cli.main does): a gloo
    worker thread can still be dropping its last reference to a finished collective
    after the group is gone, and if that happens while the interpreter finalises, the
    thread is forced out inside a destructor that may not throw and the process dies of
    SIGABRT (exit 134) after its work was done, which would turn a saved, preempted run's
    75 into a failure that no launcher requeues.
    """
    return _left_a_process_group
