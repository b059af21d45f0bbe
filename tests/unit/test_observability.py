"""Metric backends (TensorBoard, W&B offline) and the gradient hook event, on real runs."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from kempnerforge.config.metrics import MetricsConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.metrics.backends import TensorBoardBackend, WandbBackend, scalar_values
from kempnerforge.training.hooks import StepContext, TrainingHook, load_hooks
from kempnerforge.training.loop import run_training_loop
from tests.support.metrics_rows import train_rows
from tests.support.resume import make_session
from tests.unit.test_hooks import REPO_ROOT


class GradientProbe(TrainingHook):
    """Checks, at each event, what the gradient event promises."""

    def __init__(self) -> None:
        self.after_step: dict[int, dict[str, torch.Tensor]] = {}
        self.seen: list[int] = []
        self.problems: list[str] = []

    def on_gradients(self, ctx: StepContext) -> None:
        self.seen.append(ctx.step)
        params = dict(ctx.model.named_parameters())
        missing = [n for n, p in params.items() if p.requires_grad and p.grad is None]
        if missing:
            self.problems.append(f"step {ctx.step}: no gradient for {missing[:3]}")
        previous = self.after_step.get(ctx.step - 1)
        if previous is not None:
            moved = [n for n, p in params.items() if not torch.equal(p, previous[n])]
            if moved:
                self.problems.append(f"step {ctx.step}: parameters already updated {moved[:3]}")

    def on_step_end(self, ctx: StepContext) -> None:
        named = ctx.model.named_parameters()
        self.after_step[ctx.step] = {n: p.detach().clone() for n, p in named}
        if any(p.grad is not None for p in ctx.model.parameters()):
            self.problems.append(f"step {ctx.step}: gradients still held after the step")


def test_the_gradient_event_sees_every_gradient_before_the_update(tiny_overrides):
    session = make_session(tiny_overrides)
    probe = GradientProbe()
    session.hooks.add(probe)
    with session.tracker:
        step, _ = run_training_loop(session)
    assert probe.seen == list(range(1, step + 1))
    assert probe.problems == []


def test_the_example_gradient_stats_hook_writes_per_layer_norms(tiny_overrides, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    (hook,) = load_hooks(["examples.gradient_stats:GradientStats"])
    hook.every = 2  # type: ignore[attr-defined]
    session = make_session(tiny_overrides)
    session.hooks.add(hook)
    with session.tracker:
        run_training_loop(session)
    with open(os.path.join(session.config.run_dir, "gradient_stats.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [2, 4, 6]
    groups = set(rows[0]["grad_norm"])
    assert {"tok_embeddings", "layers.0", "layers.1", "norm", "output"} <= groups
    assert all(v > 0 for v in rows[0]["grad_norm"].values())


def test_unknown_or_repeated_backends_are_config_errors():
    with pytest.raises(ConfigError, match=r"metrics\.backends\[0\].*did you mean 'wandb'"):
        MetricsConfig(backends=["wandbb"])
    with pytest.raises(ConfigError, match="each backend at most once"):
        MetricsConfig(backends=["tensorboard", "tensorboard"])


def test_scalar_values_keep_finite_numbers_only():
    row = {"step": 3, "loss": 2.5, "grad_norm": float("nan"), "note": "x", "flag": True, "time": 1}
    assert scalar_values(row) == {"loss": 2.5}


def test_tensorboard_and_offline_wandb_receive_the_logged_rows(tiny_overrides, monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_SILENT", "true")
    session = make_session(
        [
            *tiny_overrides,
            '--metrics.backends=["tensorboard", "wandb"]',
            "--metrics.log_interval=2",
            "--eval.interval=3",
            "--eval.steps=1",
        ]
    )
    with session.tracker:
        run_training_loop(session)
    run_dir = session.config.run_dir
    events = EventAccumulator(os.path.join(run_dir, "tensorboard"))
    events.Reload()
    losses = {e.step: e.value for e in events.Scalars("loss")}
    rows = {r["step"]: r["loss"] for r in train_rows(run_dir)}
    assert losses.keys() == rows.keys()
    for step, loss in rows.items():
        assert losses[step] == pytest.approx(loss, rel=1e-6)
    assert [e.step for e in events.Scalars("eval_loss")] == [3, 6]
    offline = [d for d in os.listdir(os.path.join(run_dir, "wandb")) if d.startswith("offline-run")]
    assert len(offline) == 1
    assert any(
        name.endswith(".wandb") for name in os.listdir(os.path.join(run_dir, "wandb", offline[0]))
    )


@pytest.mark.parametrize(
    ("module", "backend"),
    [("torch.utils.tensorboard", TensorBoardBackend), ("wandb", WandbBackend)],
)
def test_a_backend_without_its_package_names_the_extra(tmp_path, monkeypatch, module, backend):
    monkeypatch.setitem(sys.modules, module, None)
    name = "tensorboard" if backend is TensorBoardBackend else "wandb"
    with pytest.raises(ConfigError, match=rf"metrics\.backends.*kempnerforge\[{name}\]"):
        if backend is TensorBoardBackend:
            backend(str(tmp_path))
        else:
            backend(MetricsConfig(), str(tmp_path), "run", {})


def test_the_command_line_parser_imports_no_torch():
    """`kempnerforge --help` stays fast: building the parser of every command loads no
    torch (each command imports its heavy dependencies when it runs)."""
    import subprocess

    code = (
        "import sys; from kempnerforge.cli import _build_parser; _build_parser(); "
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'kempnerforge' in m)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
