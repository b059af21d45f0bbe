"""The run's config is found from any of its checkpoints, however the checkpoint is named."""

from __future__ import annotations

from kempnerforge.config.run_config import (
    RUN_CONFIG_FILE,
    run_config_beside,
    run_config_of_checkpoints,
)


def test_a_checkpoint_path_leads_to_its_run_directorys_config(tmp_path):
    checkpoint = tmp_path / "runs" / "demo" / "checkpoints" / "step_5"
    assert run_config_beside(checkpoint) == tmp_path / "runs" / "demo" / RUN_CONFIG_FILE
    assert run_config_beside(str(checkpoint)) == run_config_beside(checkpoint)


def test_a_relative_checkpoint_name_resolves_from_the_working_directory(tmp_path, monkeypatch):
    checkpoints = tmp_path / "runs" / "demo" / "checkpoints"
    checkpoints.mkdir(parents=True)
    monkeypatch.chdir(checkpoints)
    # Taken literally, "step_5".parent.parent is "." again: the run would never be found.
    assert run_config_beside("step_5") == tmp_path / "runs" / "demo" / RUN_CONFIG_FILE


def test_dot_and_dotdot_are_resolved_before_the_run_is_found(tmp_path, monkeypatch):
    step = tmp_path / "runs" / "demo" / "checkpoints" / "step_5"
    step.mkdir(parents=True)
    monkeypatch.chdir(step)
    expected = tmp_path / "runs" / "demo" / RUN_CONFIG_FILE
    assert run_config_beside(".") == expected
    assert run_config_of_checkpoints("..") == expected
    assert run_config_beside("../step_5") == expected
