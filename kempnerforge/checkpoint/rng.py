"""This rank's random number generator state, as plain types a weights-only load accepts."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from kempnerforge.core.logging import get_logger

logger = get_logger(__name__)


def capture_rng_state() -> dict[str, Any]:
    """Snapshot python `random`, numpy's global generator, torch CPU and every CUDA device.

    The result holds only ints, floats, strings, None, lists and tensors, so it survives
    ``torch.save`` and ``torch.load(..., weights_only=True)``. Each rank captures its own.
    """
    py_version, py_words, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {
            "version": int(py_version),
            # 625 words below 2**32 each: int64 holds them exactly.
            "state": torch.tensor(py_words, dtype=torch.int64),
            "gauss_next": py_gauss,
        },
        "numpy": {
            "bit_generator": str(np_name),
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back a state from `capture_rng_state`, so the next draws repeat the saved ones.

    CUDA states are restored for the devices both the checkpoint and this process have;
    a different device count is reported once, since those draws will then differ.
    """
    py = state["python"]
    random.setstate((py["version"], tuple(int(w) for w in py["state"].tolist()), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state(
        (
            npy["bit_generator"],
            npy["keys"].numpy().astype(np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    saved_cuda = state.get("cuda", [])
    num_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if len(saved_cuda) != num_devices:
        logger.warning(
            "the checkpoint has CUDA RNG states for %d device(s) but this process sees %d: "
            "CUDA random draws will not repeat the saved run's",
            len(saved_cuda),
            num_devices,
        )
    for device, cuda_state in enumerate(saved_cuda[:num_devices]):
        torch.cuda.set_rng_state(cuda_state, device=device)
