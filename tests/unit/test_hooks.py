"""HookRunner dispatch and failure isolation, load_hooks, and the example hook."""

from __future__ import annotations

import logging
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kempnerforge.core.errors import ConfigError
from kempnerforge.training.hooks import (
    MAX_HOOK_FAILURES,
    HookRunner,
    StepContext,
    TrainingHook,
    load_hooks,
)
from tests.support.logs import package_records

REPO_ROOT = Path(__file__).resolve().parents[2]
ALLOWED = "expected an import path 'package.module:ClassName' naming a TrainingHook subclass"


@pytest.fixture
def logs():
    """Records of the kempnerforge loggers, whatever configure_logging did before."""
    with package_records(logging.DEBUG) as records:
        yield records


def make_ctx(step: int, loss: float = 3.0) -> StepContext:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return StepContext(step, loss, 0.5, 1e-3, 100 * step, model, optimizer)


class Recorder(TrainingHook):
    def __init__(self, name: str, calls: list) -> None:
        self.name = name
        self.calls = calls

    def on_train_begin(self, config) -> None:
        self.calls.append((self.name, "on_train_begin", config))

    def on_step_end(self, ctx: StepContext) -> None:
        self.calls.append((self.name, "on_step_end", ctx.step))

    def on_eval_end(self, step: int, metrics: dict[str, float]) -> None:
        self.calls.append((self.name, "on_eval_end", step, metrics))

    def on_checkpoint_save(self, step: int, path: str) -> None:
        self.calls.append((self.name, "on_checkpoint_save", step, path))

    def on_train_end(self, step: int, tokens_seen: int) -> None:
        self.calls.append((self.name, "on_train_end", step, tokens_seen))


class Exploding(TrainingHook):
    def __init__(self) -> None:
        self.num_calls = 0

    def on_step_end(self, ctx: StepContext) -> None:
        self.num_calls += 1
        raise RuntimeError("boom")


def test_every_event_reaches_every_hook_in_order():
    calls: list = []
    runner = HookRunner([Recorder("a", calls), Recorder("b", calls)])
    runner.on_train_begin("cfg")
    runner.on_step_end(make_ctx(1))
    runner.on_eval_end(1, {"eval_loss": 2.0})
    runner.on_checkpoint_save(1, "ckpt/step_1")
    runner.on_train_end(1, 100)
    assert calls == [
        ("a", "on_train_begin", "cfg"),
        ("b", "on_train_begin", "cfg"),
        ("a", "on_step_end", 1),
        ("b", "on_step_end", 1),
        ("a", "on_eval_end", 1, {"eval_loss": 2.0}),
        ("b", "on_eval_end", 1, {"eval_loss": 2.0}),
        ("a", "on_checkpoint_save", 1, "ckpt/step_1"),
        ("b", "on_checkpoint_save", 1, "ckpt/step_1"),
        ("a", "on_train_end", 1, 100),
        ("b", "on_train_end", 1, 100),
    ]


def test_base_hook_events_do_nothing():
    runner = HookRunner([TrainingHook()])
    runner.on_train_begin(None)
    runner.on_step_end(make_ctx(1))
    runner.on_eval_end(1, {})
    runner.on_checkpoint_save(1, "x")
    runner.on_train_end(1, 1)
    assert len(runner) == 1
    assert len(HookRunner()) == 0


def test_a_raising_hook_is_logged_and_the_others_still_run(logs):
    calls: list = []
    runner = HookRunner([Exploding(), Recorder("after", calls)])
    runner.on_step_end(make_ctx(7))
    assert calls == [("after", "on_step_end", 7)]
    (record,) = logs
    assert record.levelno == logging.ERROR
    assert record.getMessage() == "hook Exploding failed in on_step_end at step 7"
    assert record.exc_info is not None and isinstance(record.exc_info[1], RuntimeError)


def test_a_hook_failing_at_train_begin_is_reported_without_a_step(logs):
    class BadBegin(TrainingHook):
        def on_train_begin(self, config) -> None:
            raise KeyError("wandb_project")

    HookRunner([BadBegin()]).on_train_begin(None)
    assert logs[0].getMessage().endswith("BadBegin failed in on_train_begin before the first step")


def test_a_hook_is_disabled_after_three_failures(logs):
    exploding = Exploding()
    calls: list = []
    runner = HookRunner([exploding, Recorder("ok", calls)])
    for n in range(1, 6):
        runner.on_step_end(make_ctx(n))
    assert exploding.num_calls == MAX_HOOK_FAILURES == 3
    assert [c[2] for c in calls] == [1, 2, 3, 4, 5]
    assert [r.levelname for r in logs] == ["ERROR", "ERROR", "ERROR", "WARNING"]
    assert logs[-1].getMessage() == (
        "hook Exploding disabled after 3 failures; training continues without it"
    )
    assert len(runner) == 1 and runner.hooks[0].calls is calls


def test_keyboard_interrupt_in_a_hook_is_not_swallowed():
    class Interrupting(TrainingHook):
        def on_train_end(self, step: int, tokens_seen: int) -> None:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        HookRunner([Interrupting()]).on_train_end(1, 1)


@pytest.fixture
def hook_module(tmp_path, monkeypatch):
    """A user module 'user_hooks_mod' on sys.path, removed from sys.modules afterwards."""
    (tmp_path / "user_hooks_mod.py").write_text(
        textwrap.dedent(
            """
            from kempnerforge.training.hooks import TrainingHook

            class GoodHook(TrainingHook):
                pass

            class Holder:
                class Inner(TrainingHook):
                    pass

            class NotAHook:
                pass

            def make_hook():
                return GoodHook()

            class NeedsArgs(TrainingHook):
                def __init__(self, url):
                    self.url = url
            """
        )
    )
    (tmp_path / "broken_hooks_mod.py").write_text("import not_installed_dep_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_hooks_mod"
    for name in ("user_hooks_mod", "broken_hooks_mod"):
        sys.modules.pop(name, None)


def test_load_hooks_builds_each_class_in_order(hook_module):
    hooks = load_hooks(["user_hooks_mod:GoodHook", "user_hooks_mod:Holder.Inner"])
    assert [type(h).__qualname__ for h in hooks] == ["GoodHook", "Holder.Inner"]
    assert load_hooks([]) == []


def load_error(path: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_hooks([path])
    assert info.value.field == "train.hooks" and info.value.value == path
    return str(info.value)


def test_missing_module_names_the_import_error(hook_module):
    assert load_error("no_such_hooks_mod:Hook") == (
        f"train.hooks = 'no_such_hooks_mod:Hook': {ALLOWED} (cannot import 'no_such_hooks_mod':"
        " ModuleNotFoundError: No module named 'no_such_hooks_mod';"
        f" is its directory the working directory ({os.getcwd()}) or on PYTHONPATH?)"
    )


def test_a_hook_module_in_the_working_directory_imports_without_pythonpath(tmp_path, monkeypatch):
    # The installed `kempnerforge` script does not put the working directory on sys.path.
    (tmp_path / "cwd_hooks_mod.py").write_text(
        "from kempnerforge.training.hooks import TrainingHook\n"
        "class Hook(TrainingHook):\n    pass\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    [hook] = load_hooks(["cwd_hooks_mod:Hook"])
    assert type(hook).__name__ == "Hook"
    sys.modules.pop("cwd_hooks_mod", None)


def test_module_failing_to_import_names_its_missing_dependency(hook_module):
    assert load_error("broken_hooks_mod:Hook").endswith(
        "(cannot import 'broken_hooks_mod': ModuleNotFoundError:"
        " No module named 'not_installed_dep_xyz')"
    )


def test_missing_attribute_suggests_the_closest_name(hook_module):
    assert load_error("user_hooks_mod:GodHook").endswith(
        "(no attribute 'GodHook' in 'user_hooks_mod'; did you mean 'GoodHook'?)"
    )
    assert load_error("user_hooks_mod:Holder.Iner").endswith(
        "(no attribute 'Iner' in 'user_hooks_mod.Holder'; did you mean 'Inner'?)"
    )


def test_a_class_that_is_not_a_hook_is_rejected(hook_module):
    assert load_error("user_hooks_mod:NotAHook").endswith(
        "(NotAHook is not a TrainingHook subclass (it is a class NotAHook))"
    )
    assert load_error("user_hooks_mod:make_hook").endswith(
        "(make_hook is not a TrainingHook subclass (it is a function))"
    )


def test_a_hook_needing_arguments_is_rejected(hook_module):
    message = load_error("user_hooks_mod:NeedsArgs")
    assert "(NeedsArgs() failed: TypeError: " in message
    assert message.endswith("; hooks are built with no arguments)")


def test_a_path_without_a_colon_is_rejected():
    assert load_error("user_hooks_mod.GoodHook").endswith("(expected exactly one ':')")


def test_example_loss_spike_alert_warns_on_a_spike(monkeypatch, logs):
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    (hook,) = load_hooks(["examples.loss_spike_alert:LossSpikeAlert"])
    runner = HookRunner([hook])
    runner.on_step_end(make_ctx(1, loss=9.0))  # high, but inside the warmup
    for n in range(2, 11):
        runner.on_step_end(make_ctx(n, loss=3.0))
    assert logs == []
    runner.on_step_end(make_ctx(11, loss=float("nan")))  # left to the NaN detector
    runner.on_step_end(make_ctx(12, loss=5.0))  # below 2x the mean of 3.6
    assert logs == []
    runner.on_step_end(make_ctx(13, loss=8.0))
    (record,) = logs
    assert record.levelno == logging.WARNING
    assert record.getMessage() == "loss spike at step 13: 8.0000 is 2.2x the running mean 3.6280"
