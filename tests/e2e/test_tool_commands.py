"""The tool commands through the command line on a real checkpoint: capture (the saved
outputs are the model's own, and the example probe reads them), generate and plot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kempnerforge.cli import main
from kempnerforge.config.loader import dump_config
from kempnerforge.training.loop import run_training_loop
from tests.support.resume import make_session

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.fixture
def checkpoint(tiny_overrides) -> tuple[str, object]:
    """A trained tiny run with a checkpoint at step 6 and its config.toml, as the CLI
    leaves them; and its live session."""
    session = make_session([*tiny_overrides, "--checkpoint.interval=6"])
    with session.tracker:
        run_training_loop(session)
    run_dir = Path(session.config.run_dir)
    (run_dir / "config.toml").write_text(dump_config(session.config))
    return str(run_dir / "checkpoints" / "step_6"), session


def test_capture_saves_each_layers_outputs_over_the_batches(checkpoint, tmp_path, capsys):
    path, session = checkpoint
    out = tmp_path / "acts.safetensors"
    layers = "tok_embeddings,layers.0,layers.1.attention,norm"
    args = ["--layers", layers, "--batches", "2", "--batch-size", "3", "--out", str(out)]
    # One sequence per window, so the reference forward below needs no document ids.
    code = main(["capture", "--checkpoint", path, *args, "--data.document_masking=false"])
    assert code == 0
    assert str(out) in capsys.readouterr().out
    saved = load_file(str(out))
    assert set(saved) == {*layers.split(","), "input_ids"}
    ids = saved["input_ids"]
    assert ids.shape == (6, 32)
    # The same outputs as the trained model's own forward over those inputs.
    model = session.model
    model.eval()
    expected: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    hooks = [
        modules[name].register_forward_hook(
            lambda m, a, o, name=name: expected.__setitem__(name, o.detach().float())
        )
        for name in layers.split(",")
    ]
    with torch.no_grad():
        model(ids)
    for hook in hooks:
        hook.remove()
    for name in layers.split(","):
        assert saved[name].shape[:2] == (6, 32)
        torch.testing.assert_close(saved[name], expected[name], atol=1e-5, rtol=0)


def test_an_unknown_layer_is_named_with_the_closest(checkpoint, capsys):
    path, _ = checkpoint
    assert main(["capture", "--checkpoint", path, "--layers", "layers.0,layer.1"]) == 2
    err = capsys.readouterr().err
    assert "--layers = 'layer.1'" in err and "did you mean 'layers.1'" in err


def test_the_example_probe_reads_a_capture(checkpoint, tmp_path):
    path, _ = checkpoint
    out = tmp_path / "acts.safetensors"
    assert (
        main(
            [
                "capture",
                "--checkpoint",
                path,
                "--layers",
                "tok_embeddings,layers.1",
                "--batches",
                "4",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "probe_activations.py"), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "probe accuracy" in done.stdout and "layers.1" in done.stdout


def test_generate_through_the_command_line_continues_the_prompt(checkpoint, capsys):
    path, _ = checkpoint
    args = ["--prompt", "alpha ", "--max-new-tokens", "6", "--temperature", "0"]
    assert main(["generate", "--checkpoint", path, *args]) == 0
    first = capsys.readouterr().out
    assert first.startswith("alpha ")
    # Greedy is deterministic, with or without the cache.
    assert main(["generate", "--checkpoint", path, *args, "--no-cache"]) == 0
    assert capsys.readouterr().out == first


def test_plot_through_the_command_line_writes_the_curves(checkpoint, tmp_path, capsys):
    path, _ = checkpoint
    run_dir = str(Path(path).parents[1])
    assert main(["plot", run_dir, "--out", str(tmp_path / "plots")]) == 0
    written = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert {"loss.png", "lr.png", "grad_norm.png", "tokens_per_sec.png"} <= set(written)
    with pytest.raises(SystemExit) as refused:  # plot takes no config overrides
        main(["plot", run_dir, "--train.max_steps=3"])
    assert refused.value.code == 2
    assert "unrecognized arguments: --train.max_steps=3" in capsys.readouterr().err
