"""The directories a run may take, their locks, and the config history of a run directory."""

from __future__ import annotations

import json
import tomllib

import pytest

from kempnerforge.checkpoint.manager import CheckpointManager
from kempnerforge.config.checkpoint import CheckpointConfig
from kempnerforge.config.loader import load_config
from kempnerforge.config.run_config import RUN_CONFIG_FILE as CONFIG_FILE
from kempnerforge.core.errors import ConfigError
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.resilience.run_lock import RunLockError
from kempnerforge.training.build import build_checkpointer
from kempnerforge.training.workspace import (
    CONFIG_HISTORY,
    RUN_MARKER,
    check_directories,
    locked_directories,
    rank0_workspace,
    record_config,
)
from tests.unit.test_checkpoint import _save


def config_for(tmp_path, *overrides):
    return load_config(None, [f"--train.run_dir={tmp_path / 'run'}", *overrides])


def test_a_new_or_empty_directory_is_taken(tmp_path):
    check_directories(config_for(tmp_path))
    (tmp_path / "run").mkdir()
    check_directories(config_for(tmp_path))


def test_a_directory_of_other_files_is_refused_naming_the_field(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "thesis.tex").write_text("years of work")
    (run / "data.csv").write_text("1,2,3")
    with pytest.raises(ConfigError) as info:
        check_directories(config_for(tmp_path))
    message = str(info.value)
    assert message.startswith(f"train.run_dir = '{run}': expected a new or empty directory")
    assert "it already holds 2 other entries (data.csv, thesis.tex)" in message
    assert "train.use_existing_dir=true" in message
    check_directories(config_for(tmp_path, "--train.use_existing_dir=true"))


def test_a_run_directory_a_previous_run_wrote_is_taken(tmp_path):
    config = config_for(tmp_path)
    with rank0_workspace(config, RuntimeContext()):  # claims it: writes the marker
        record_config(config)
    run = tmp_path / "run"
    marker = json.loads((run / RUN_MARKER).read_text())
    assert marker["format_version"] == 1 and marker["name"] == "debug"
    (run / "notes.txt").write_text("mine")
    check_directories(config_for(tmp_path))


@pytest.mark.parametrize("use_existing_dir", [False, True])
def test_a_project_folder_with_its_own_config_and_metrics_is_never_taken_for_a_run(
    tmp_path, use_existing_dir
):
    run = tmp_path / "run"
    run.mkdir()
    (run / CONFIG_FILE).write_text("[project]\nname = 'mine'\n")
    (run / "metrics.jsonl").write_text('{"accuracy": 0.9}\n')
    config = config_for(tmp_path, f"--train.use_existing_dir={str(use_existing_dir).lower()}")
    with pytest.raises(ConfigError) as info:
        check_directories(config)
    assert str(info.value) == (
        f"train.run_dir = '{run}': expected a new or empty directory, or one a run made (it "
        f"holds .kempnerforge-run) (it holds {CONFIG_FILE}, metrics.jsonl but no "
        ".kempnerforge-run, so no run wrote them, and a run would overwrite them "
        "(train.use_existing_dir too): choose another directory or move them away (to "
        "continue a run of an earlier version that wrote them, create an empty "
        ".kempnerforge-run there))"
    )
    with pytest.raises(ConfigError):
        rank0_workspace(config, RuntimeContext()).__enter__()
    assert sorted(p.name for p in run.iterdir()) == [CONFIG_FILE, "metrics.jsonl"]
    assert (run / CONFIG_FILE).read_text() == "[project]\nname = 'mine'\n"


def test_use_existing_dir_takes_a_folder_of_other_files_and_marks_it(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    config = config_for(tmp_path, "--train.use_existing_dir=true")
    with rank0_workspace(config, RuntimeContext()):
        pass
    assert (run / RUN_MARKER).is_file() and (run / "notes.txt").read_text() == "mine"
    check_directories(config_for(tmp_path))  # now a run's, without use_existing_dir


@pytest.mark.parametrize("complete", [True, False])
def test_a_run_an_earlier_version_made_is_taken_when_it_has_a_complete_checkpoint(
    tmp_path, complete
):
    # What an earlier version left: no marker, its config, metrics and checkpoints.
    run = tmp_path / "run"
    run.mkdir()
    (run / CONFIG_FILE).write_text("")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    manager = CheckpointManager(CheckpointConfig(), str(run / "checkpoints"))
    _save(manager, 2)
    if not complete:
        (run / "checkpoints" / "step_2" / "complete.json").unlink()
    config = config_for(tmp_path)
    if not complete:
        with pytest.raises(ConfigError, match="but no .kempnerforge-run, so no run wrote them"):
            check_directories(config)
        return
    with rank0_workspace(config, RuntimeContext()):
        pass
    assert (run / RUN_MARKER).is_file()  # marked now: the next launch needs no guess
    checkpointer = build_checkpointer(config, RuntimeContext())
    assert checkpointer.newest_complete_path() == str(run / "checkpoints" / "step_2")


def test_a_checkpoint_dir_of_other_files_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "results.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"^checkpoint.dir = .*results.json"):
        check_directories(config_for(tmp_path, f"--checkpoint.dir={shared}"))
    (shared / "step_3").mkdir()
    check_directories(config_for(tmp_path, f"--checkpoint.dir={shared}"))


def test_a_run_name_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "run").write_text("not a directory")
    with pytest.raises(ConfigError, match="a file of that name exists"):
        check_directories(config_for(tmp_path))


def test_two_runs_sharing_only_a_checkpoint_dir_cannot_both_start(tmp_path):
    shared = f"--checkpoint.dir={tmp_path / 'ckpt'}"
    first = load_config(None, [f"--train.run_dir={tmp_path / 'a'}", shared])
    second = load_config(None, [f"--train.run_dir={tmp_path / 'b'}", shared])
    with (
        locked_directories(first.run_dir, first.checkpoint_dir),
        pytest.raises(RunLockError) as info,
    ):
        locked_directories(second.run_dir, second.checkpoint_dir).__enter__()
    message = str(info.value)
    assert message.startswith(f"checkpoint directory {tmp_path / 'ckpt'} is in use by pid")
    assert message.endswith("stop that run or choose another checkpoint.dir")
    with locked_directories(second.run_dir, second.checkpoint_dir):  # free once the first is over
        pass


def test_every_launch_keeps_its_config_and_config_toml_is_the_latest(tmp_path):
    first = config_for(tmp_path, "--optimizer.lr=0.001")
    second = config_for(tmp_path, "--optimizer.lr=0.05")
    record_config(first, started=1_700_000_000)
    record_config(second, started=1_700_000_500)
    record_config(second, started=1_700_000_500)  # a second launch within the same second
    run = tmp_path / "run"
    latest = tomllib.loads((run / CONFIG_FILE).read_text())
    assert latest["optimizer"]["lr"] == 0.05
    history = sorted(p.name for p in (run / CONFIG_HISTORY).iterdir())
    assert history == [
        "config-20231114T221320Z.toml",
        "config-20231114T222140Z-2.toml",
        "config-20231114T222140Z.toml",
    ]
    lrs = [
        tomllib.loads((run / CONFIG_HISTORY / name).read_text())["optimizer"]["lr"]
        for name in history
    ]
    assert lrs == [0.001, 0.05, 0.05]
    assert load_config(str(run / CONFIG_HISTORY / history[0])) == first


def test_a_model_too_large_for_the_machine_is_refused_before_it_is_built():
    import torch

    from kempnerforge.training.preflight import check_model_fits, device_memory_bytes

    huge = load_config(None, ["--model.dim=1048576", "--model.n_heads=8"]).model
    memory = device_memory_bytes(torch.device("cpu"))
    assert memory is not None
    with pytest.raises(ConfigError) as info:
        check_model_fits(huge, torch.device("cpu"))
    message = str(info.value)
    assert message.startswith("model.dim = 1048576: expected a model whose 16 bytes per parameter")
    assert f"{memory / 2**30:.1f} GiB" in message and "lower model.dim" in message
    check_model_fits(load_config(None).model, torch.device("cpu"))  # the default fits
