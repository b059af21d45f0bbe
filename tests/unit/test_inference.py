"""Loading a checkpoint for inference: every form --checkpoint takes, through each command;
the config found beside it or recorded in it; the one refusal of a model family; one check
of the checkpoint per command."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kempnerforge.checkpoint import integrity
from kempnerforge.checkpoint.disk_format import MARKER
from kempnerforge.checkpoint.manager import CheckpointManager
from kempnerforge.cli import main
from kempnerforge.config.job import JobConfig
from kempnerforge.config.loader import config_to_dict, load_config, save_config
from kempnerforge.core.errors import ConfigError
from kempnerforge.model import build_model
from kempnerforge.training.families import family_of
from kempnerforge.training.inference.loading import (
    load_for_inference,
    open_for_inference,
)

GENERATE = ["--prompt", "alpha ", "--max-new-tokens", "4", "--temperature", "0"]


def save_step(config: JobConfig, step: int, *, record_config: bool = True) -> torch.nn.Module:
    """Save a checkpoint of a freshly drawn model (weights seeded by ``step``, so every
    checkpoint holds other weights) as training would; return the model."""
    torch.manual_seed(step)
    model = build_model(config.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    extra: dict = {"step": step}
    if record_config:
        extra["config"] = config_to_dict(config)
    CheckpointManager(config.checkpoint, config.checkpoint_dir).save(
        step, model=model, optimizer=optimizer, scheduler=scheduler, train_state={"extra": extra}
    )
    return model


@pytest.fixture
def run(tiny_overrides) -> Path:
    """A run directory as training leaves it: config.toml, and complete checkpoints at
    steps 3 and 6, `latest` naming step_6."""
    config = load_config(None, tiny_overrides)
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True)
    save_config(config, str(run_dir / "config.toml"))
    for step in (3, 6):
        save_step(config, step)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_6"
    return run_dir


def generate(checkpoint: Path | str, capsys, *extra: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["generate", "--checkpoint", str(checkpoint), *GENERATE, *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def used(err: str) -> str:
    """The one line that says which checkpoint and config a command used."""
    (line,) = [line for line in err.splitlines() if "training.inference.loading:" in line]
    return line.split("training.inference.loading: ", 1)[1]


# --- The forms of --checkpoint -------------------------------------------------------------


@pytest.mark.parametrize(
    ("form", "step", "chosen_in"),
    [
        ("checkpoints/step_3", 3, None),
        ("checkpoints/latest", 6, "checkpoints"),
        ("checkpoints", 6, "checkpoints"),
        ("", 6, "checkpoints"),
    ],
    ids=["step-dir", "latest-file", "checkpoints-dir", "run-dir"],
)
def test_generate_takes_each_form_and_names_the_checkpoint_it_used(
    run, capsys, form, step, chosen_in
):
    code, out, err = generate(run / form, capsys)
    assert code == 0, err
    assert out.startswith("alpha ")
    expected = f"generate: step {step} of {run / 'checkpoints' / f'step_{step}'}"
    if chosen_in is not None:
        expected += f" (the newest complete checkpoint in {run / chosen_in})"
    assert used(err) == f"{expected}; config: {run / 'config.toml'}"


@pytest.mark.parametrize(
    ("cwd", "given"),
    [("checkpoints/step_6", "."), ("checkpoints", "latest"), ("checkpoints/step_6", "../..")],
)
def test_relative_paths_find_the_runs_config(run, capsys, monkeypatch, cwd, given):
    monkeypatch.chdir(run / cwd)
    code, _, err = generate(given, capsys)
    assert code == 0, err
    assert used(err).startswith("generate: step 6 of ")
    assert used(err).endswith(f"; config: {run / 'config.toml'}")


def test_eval_of_a_run_directory_evaluates_its_newest_checkpoint(run, capsys):
    code = main(["eval", str(run / "config.toml"), "--checkpoint", str(run), "--steps=1"])
    err = capsys.readouterr().err
    assert code == 0, err
    report = json.loads((run / "checkpoints" / "step_6" / "eval.json").read_text())
    assert report["step"] == 6
    assert report["checkpoint"] == str(run / "checkpoints" / "step_6")
    assert used(err).startswith(f"eval: step 6 of {run / 'checkpoints' / 'step_6'} (the newest")


def test_capture_from_the_latest_file_writes_beside_the_checkpoint_it_names(run, capsys):
    latest = run / "checkpoints" / "latest"
    code = main(["capture", "--checkpoint", str(latest), "--layers", "norm", "--batches", "1"])
    err = capsys.readouterr().err
    assert code == 0, err
    written = run / "checkpoints" / "step_6" / "activations.safetensors"
    with safe_open(str(written), "pt") as f:
        assert f.metadata()["checkpoint"] == str(run / "checkpoints" / "step_6")
    assert used(err).startswith("capture: step 6 of")


def test_export_of_a_checkpoints_directory_exports_its_newest_checkpoint(run, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(run / "checkpoints"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    step_6 = run / "checkpoints" / "step_6"
    assert printed[0] == f"wrote {out} (LlamaForCausalLM) from {step_6}, step 6"
    assert printed[1] == f"config: {run / 'config.toml'}"


def test_a_broken_newest_checkpoint_is_skipped_and_named(run, capsys):
    (run / "checkpoints" / "step_6" / MARKER).unlink()
    code, _, err = generate(run, capsys)
    assert code == 0, err
    checkpoints = run / "checkpoints"
    assert used(err).startswith(
        f"generate: step 3 of {checkpoints / 'step_3'} (the newest complete checkpoint in "
        f"{checkpoints}; skipped step_6 ({MARKER} is missing"
    )


def test_a_path_that_holds_no_complete_checkpoint_is_one_line_naming_it(run, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    refused = {
        tmp_path / "gone": "does not exist; pass a checkpoint",
        empty: "holds no checkpoint; pass a checkpoint",
        a_file: "is not a directory; pass a checkpoint",
    }
    for path, problem in refused.items():
        code, _, err = generate(path, capsys)
        assert code == 1
        assert err.startswith(f"kempnerforge: checkpoint error: {path}: {problem}"), err
        assert len(err.splitlines()) == 1
    for step in (3, 6):
        (run / "checkpoints" / f"step_{step}" / MARKER).unlink()
    code, _, err = generate(run, capsys)
    assert code == 1
    line = err.strip().splitlines()[-1]
    assert line.startswith(
        f"kempnerforge: checkpoint error: {run / 'checkpoints'}: holds no complete checkpoint "
        f"(skipped step_6 ({MARKER} is missing"
    )
    assert "step_3 (" in line and "resume_from" not in line


# --- The config ---------------------------------------------------------------------------


def test_without_config_toml_the_checkpoints_recorded_config_is_used(run, capsys):
    (run / "config.toml").unlink()
    code, out, err = generate(run, capsys)
    assert code == 0, err
    assert out.startswith("alpha ")
    step_6 = run / "checkpoints" / "step_6"
    assert used(err).endswith(f"; config: the config recorded in {step_6}")


def test_a_checkpoint_recording_no_config_asks_for_one(tiny_overrides, capsys):
    config = load_config(None, tiny_overrides)
    save_step(config, 2, record_config=False)
    code, _, err = generate(config.checkpoint_dir, capsys)
    assert code == 2
    run_config = Path(config.run_dir).absolute() / "config.toml"
    assert err.startswith("kempnerforge: error: --config = '': expected the TOML config")
    assert f"{run_config} does not exist and " in err


# --- One refusal per model family, one process -------------------------------------------

VLM = ["--vision_encoder.type=random", "--vlm.max_text_len=8"]


@pytest.mark.parametrize(
    ("command", "args", "reason"),
    [
        ("generate", GENERATE, "it continues text prompts"),
        ("capture", ["--layers", "norm"], "it runs token windows, not image-text pairs"),
        ("export", ["--out", "hf"], "a Hugging Face causal language model has no place"),
    ],
)
def test_every_command_but_eval_refuses_a_vision_language_model_in_one_line(
    tmp_path, capsys, command, args, reason
):
    config = tmp_path / "vlm.toml"
    config.write_text("")
    checkpoint = tmp_path / "checkpoints" / "step_1"  # refused before it is read
    checkpoint.mkdir(parents=True)
    argv = [command, "--checkpoint", str(checkpoint), "--config", str(config), *args, *VLM]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"kempnerforge: error: {config}: kempnerforge {command} takes text models, not a "
        f"vision-language model ([vlm]): {reason}"
    )
    assert len(err.splitlines()) == 1
    assert family_of(load_config(None, VLM)).refusal("eval") is None
    assert family_of(load_config(None, [])).refusal(command) is None


def test_a_launch_of_several_processes_is_refused(run, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"WORLD_SIZE = 2: expected 1: kempnerforge export"):
        open_for_inference("export", str(run))


# --- The load -----------------------------------------------------------------------------


def test_the_load_holds_the_chosen_checkpoints_weights_and_reads_its_files_once(run, monkeypatch):
    config = load_config(str(run / "config.toml"))
    expected = {k: v.clone() for k, v in save_step(config, 9).state_dict().items()}
    checksummed: Counter[str] = Counter()
    real = integrity.checksum_of_file

    def counting(f):
        checksummed[str(Path(f.name).relative_to(run / "checkpoints"))] += 1
        return real(f)

    monkeypatch.setattr(integrity, "checksum_of_file", counting)
    job = open_for_inference("generate", str(run))
    model = load_for_inference(job)
    assert (job.step, job.checkpoint) == (9, run / "checkpoints" / "step_9")
    assert job.config_source == str(run / "config.toml")
    assert not model.training
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
    # Finding the checkpoint and loading it check each of its files once, and no other.
    assert checksummed and set(checksummed.values()) == {1}, checksummed
    assert all(name.startswith("step_9/") for name in checksummed), checksummed
