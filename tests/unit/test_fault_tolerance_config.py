"""[fault_tolerance]: its checks, the global batch it fixes, the directories of a group."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from kempnerforge.config.loader import config_to_dict, load_config
from kempnerforge.core.errors import ConfigError
from kempnerforge.training.resume_guard import check_config_changes, global_batch

FT = ["--fault_tolerance.enabled=true", "--fault_tolerance.lighthouse=http://localhost:29510"]
needs_torchft = pytest.mark.skipif(
    importlib.util.find_spec("torchft") is None,
    reason="validating enabled replica groups needs torchft (the ft extra)",
)


def test_off_by_default_keeps_the_run_directory_and_the_global_batch():
    config = load_config(None, ["--train.name=x", "--train.batch_size=4"])
    assert not config.fault_tolerance.enabled
    assert config.run_dir == os.path.join("runs", "x")
    assert config.checkpoint_dir == os.path.join("runs", "x", "checkpoints")
    assert config.num_replica_groups == 1


@needs_torchft
def test_each_group_has_its_own_run_directory_and_shares_the_checkpoints(monkeypatch):
    monkeypatch.setenv("KEMPNERFORGE_REPLICA_GROUP", "1")
    config = load_config(None, ["--train.name=x", *FT, "--fault_tolerance.num_replica_groups=2"])
    config.validate(1)
    assert config.run_dir == os.path.join("runs", "x", "replica_1")
    assert config.checkpoint_dir == os.path.join("runs", "x", "checkpoints")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--fault_tolerance.num_replica_groups=0"], "fault_tolerance.num_replica_groups = 0"),
        (
            ["--fault_tolerance.num_replica_groups=2", "--fault_tolerance.min_replica_groups=3"],
            "fault_tolerance.min_replica_groups = 3: expected <= fault_tolerance.num_",
        ),
        (
            ["--fault_tolerance.num_replica_groups=2", "--fault_tolerance.replica_group=2"],
            "fault_tolerance.replica_group = 2: expected -1, or 0 to 1",
        ),
        (["--fault_tolerance.timeout_s=0"], "fault_tolerance.timeout_s = 0"),
    ],
)
def test_bad_values_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(None, overrides)


def test_enabled_without_a_group_id_or_lighthouse_names_what_to_set(monkeypatch):
    monkeypatch.delenv("KEMPNERFORGE_REPLICA_GROUP", raising=False)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    config = load_config(None, ["--fault_tolerance.enabled=true"])
    with pytest.raises(ConfigError, match="KEMPNERFORGE_REPLICA_GROUP set to one"):
        config.validate(1)
    monkeypatch.setenv("KEMPNERFORGE_REPLICA_GROUP", "0")
    with pytest.raises(ConfigError, match="fault_tolerance.lighthouse = ''.*TORCHFT_LIGHTHOUSE"):
        config.validate(1)


def test_enabled_without_torchft_names_the_ft_extra(monkeypatch):
    monkeypatch.setenv("KEMPNERFORGE_REPLICA_GROUP", "0")
    monkeypatch.setitem(sys.modules, "torchft", None)  # as where the extra is not installed
    config = load_config(None, FT)
    with pytest.raises(ConfigError, match=r"fault_tolerance.enabled = True: expected false, or "):
        config.validate(1)


def test_pipeline_parallelism_is_refused_with_replica_groups(monkeypatch):
    monkeypatch.setenv("KEMPNERFORGE_REPLICA_GROUP", "0")
    config = load_config(None, [*FT, "--distributed.pp=2", "--model.n_layers=2"])
    with pytest.raises(ConfigError, match="distributed.pp = 2: expected 1 with fault_tolerance"):
        config.validate(2)


@needs_torchft
def test_the_global_batch_counts_every_designed_group(monkeypatch):
    monkeypatch.setenv("KEMPNERFORGE_REPLICA_GROUP", "0")
    base = [*FT, "--fault_tolerance.num_replica_groups=2", "--train.batch_size=4"]
    load_config(None, [*base, "--train.global_batch_size=8"]).validate(1)
    with pytest.raises(ConfigError, match=r"dp \* fault_tolerance.num_replica_groups = 4 \* 1"):
        load_config(None, [*base, "--train.global_batch_size=4"]).validate(1)


def test_a_resume_may_trade_groups_for_accumulation_at_the_same_global_batch(monkeypatch):
    monkeypatch.setenv("KEMPNERFORGE_REPLICA_GROUP", "0")
    saved = load_config(None, [*FT, "--fault_tolerance.num_replica_groups=2"])
    same = load_config(None, [*FT, "--train.grad_accum_steps=2"])
    other = load_config(None, [*FT, "--fault_tolerance.num_replica_groups=3"])
    assert global_batch(config_to_dict(saved), 1) == global_batch(config_to_dict(same), 1)
    check_config_changes(same, config_to_dict(saved), "ckpt")
    with pytest.raises(ConfigError, match="fault_tolerance.num_replica_groups = 3"):
        check_config_changes(other, config_to_dict(saved), "ckpt")
