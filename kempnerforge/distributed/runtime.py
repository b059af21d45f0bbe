"""RuntimeContext: this process's place in the job (rank, device, data-parallel coordinates)."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kempnerforge.config.distributed import DistributedConfig
from kempnerforge.config.errors import ConfigError


@dataclass
class RuntimeContext:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    dp_rank: int = 0
    dp_size: int = 1
    device_mesh: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


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


def init_runtime(cfg: DistributedConfig, device_name: str) -> RuntimeContext:
    """Join the process group when launched with several processes; pick this rank's device."""
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
        dist.init_process_group(
            backend, timeout=datetime.timedelta(seconds=cfg.timeout_s), device_id=None
        )
    dp_size = cfg.resolved_dp(world_size)
    return RuntimeContext(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        device=device,
        dp_rank=rank % dp_size,
        dp_size=dp_size,
    )


def teardown_runtime(runtime: RuntimeContext) -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
