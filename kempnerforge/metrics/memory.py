"""Peak memory of a stretch of training: CUDA's allocator peak on a GPU, the process's peak
resident memory on the CPU, each reset at the start of the stretch where the system allows.

On Linux the peak resident set size (VmHWM) is reset by writing "5" to
/proc/self/clear_refs, so each metrics row reports the peak of its own steps, not of the
whole process's life; where that is refused (an old kernel, another OS) the figure is the
peak since the process started, and `peak_memory` says so in its source name.
"""

from __future__ import annotations

import resource
import sys

import torch

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new peak; returns whether the peak really was reset."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _vm_hwm_bytes() -> int | None:
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def peak_memory_gib(device: torch.device) -> float:
    """The peak since the last reset_peak_memory, in GiB: tensors on the GPU
    (torch.cuda.max_memory_allocated) on CUDA, the process's resident memory (torch, data,
    everything) on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    hwm = _vm_hwm_bytes()
    if hwm is not None:
        return hwm / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 2**20 if sys.platform.startswith("linux") else peak / 2**30


def _vm_rss_bytes() -> int | None:
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_row(device: torch.device) -> dict[str, float]:
    """Memory now, in GiB, for a metrics row: the process's resident host memory
    (``host_rss_gib``, Linux only) and, on CUDA, the tensors allocated and the memory the
    caching allocator holds (``cuda_allocated_gib``, ``cuda_reserved_gib``)."""
    row: dict[str, float] = {}
    rss = _vm_rss_bytes()
    if rss is not None:
        row["host_rss_gib"] = rss / 2**30
    if device.type == "cuda":
        row["cuda_allocated_gib"] = torch.cuda.memory_allocated(device) / 2**30
        row["cuda_reserved_gib"] = torch.cuda.memory_reserved(device) / 2**30
    return row
