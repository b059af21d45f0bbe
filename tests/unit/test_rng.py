"""capture_rng_state / restore_rng_state: the same draws after a restore, weights-only safe."""

from __future__ import annotations

import random

import numpy as np
import torch

from kempnerforge.checkpoint.rng import capture_rng_state, restore_rng_state


def _draws() -> tuple[list[float], list[float], list[float]]:
    # gauss() and standard_normal() exercise the cached second Gaussian of each generator.
    py = [random.random(), random.gauss(0.0, 1.0), random.random()]
    npy = [float(np.random.rand()), float(np.random.standard_normal()), float(np.random.rand())]
    return py, npy, torch.rand(3).tolist() + torch.randn(2).tolist()


def test_restore_repeats_python_numpy_and_torch_draws():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0.0, 1.0)  # leave a cached Gaussian in the state
    np.random.standard_normal()
    state = capture_rng_state()
    expected = _draws()
    _draws()  # move every generator on
    restore_rng_state(state)
    assert _draws() == expected


def test_state_survives_a_weights_only_round_trip(tmp_path):
    np.random.seed(7)
    state = capture_rng_state()
    expected = _draws()
    path = tmp_path / "rng.pt"
    torch.save(state, path)
    loaded = torch.load(path, weights_only=True)
    restore_rng_state(loaded)
    assert _draws() == expected


def test_state_holds_no_numpy_or_tuple_values():
    def walk(value):
        assert not isinstance(value, np.ndarray | np.generic | tuple), type(value)
        if isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(capture_rng_state())
