"""training/preflight.py: what the installed torch cannot run is refused before the build."""

from __future__ import annotations

import pytest

from kempnerforge.config.loader import load_config
from kempnerforge.core.errors import ConfigError
from kempnerforge.training.preflight import check_sequence_split, torch_release


def _config(*overrides: str):
    return load_config(None, ["--distributed.tp=2", *overrides])


def test_a_sequence_tp_does_not_divide_is_refused_on_torch_2_11():
    with pytest.raises(ConfigError) as info:
        check_sequence_split(_config("--train.seq_len=63"), "2.11.0+cu130")
    assert str(info.value).splitlines() == [
        "train.seq_len = 63: expected a multiple of distributed.tp = 2 on torch 2.11.0+cu130 "
        "(sequence parallelism splits each sequence over the tp ranks, and torch before 2.13 "
        "cannot gather one they do not divide; or use torch 2.13 or newer)"
    ]


@pytest.mark.parametrize(
    ("overrides", "version"),
    [
        (["--train.seq_len=64"], "2.11.0"),  # tp divides it
        (["--train.seq_len=63"], "2.13.0+cpu"),  # this torch gathers it
        (["--train.seq_len=63"], "2.14.0a0+git1234"),
        # Pipeline stages get plain tensor parallelism: no sequence split.
        (["--train.seq_len=63", "--distributed.pp=2", "--model.n_layers=2"], "2.11.0"),
    ],
)
def test_what_this_torch_runs_passes(overrides, version):
    check_sequence_split(_config(*overrides), version)


def test_without_tensor_parallelism_any_length_passes():
    check_sequence_split(load_config(None, ["--train.seq_len=63"]), "2.11.0")


@pytest.mark.parametrize(
    ("version", "release"),
    [
        ("2.11.0+cu130", (2, 11)),
        ("2.13.0", (2, 13)),
        ("2.14.0a0+git1234", (2, 14)),
        ("3.0", (3, 0)),
    ],
)
def test_torch_release_reads_major_and_minor(version, release):
    assert torch_release(version) == release
