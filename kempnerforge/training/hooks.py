"""Training hooks: user code the loop calls at fixed events, named by import path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kempnerforge.config.imports import import_named
from kempnerforge.core.errors import ConfigError
from kempnerforge.core.logging import get_logger

if TYPE_CHECKING:
    from kempnerforge.config.job import JobConfig
    from kempnerforge.metrics.tracker import MetricsTracker

logger = get_logger(__name__)

MAX_HOOK_FAILURES = 3
"""A hook that raises this many times in one run is disabled for the rest of it."""


@dataclass(frozen=True)
class StepContext:
    """What a hook sees after an optimizer step (scalars are host floats, already synced)."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens_seen: int
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer


class TrainingHook:
    """Base class for hooks; override the events you need, the rest do nothing.

    Hooks observe, never steer: they may read the model and optimizer, log, write files or
    send alerts, but must not change parameters, optimizer state, the step or the data; the
    loop does not read anything back from them. An exception raised by a hook is reported
    and training goes on (see HookRunner). A hook is built with no arguments, so settings
    are constructor defaults or read from the environment.
    """

    def on_train_begin(self, config: JobConfig) -> None:
        """Before the first step (also after a resume); `config` is the validated job."""

    def on_gradients(self, ctx: StepContext) -> None:
        """After a good step's backward (gradients reduced and clipped), before the
        optimizer update and zero_grad: the one moment the gradients exist, for gradient
        statistics. ``ctx.step`` is the step being taken and the parameters are still
        those before its update. Called only for steps that update (not for skipped
        non-finite ones). Read the gradients; never change them."""

    def on_step_end(self, ctx: StepContext) -> None:
        """After every optimizer step that was taken (skipped NaN steps are not reported)."""

    def on_eval_end(self, step: int, metrics: dict[str, float]) -> None:
        """After an evaluation at `step`, with the logged metrics (eval_loss, eval_ppl, ...)."""

    def on_checkpoint_save(self, step: int, path: str) -> None:
        """After the checkpoint of `step` was committed; `path` is its complete directory
        (in async mode this comes once the background write is durable, steps later)."""

    def on_train_end(self, step: int, tokens_seen: int) -> None:
        """After the last step, with the final step and token count."""


class HookRunner:
    """Calls every hook, in order, at each event; a failing hook cannot stop training.

    An exception (not a KeyboardInterrupt or SystemExit) is logged at ERROR with the
    hook's class, the event, the step and the traceback, and the remaining hooks still run.
    After MAX_HOOK_FAILURES failures in total a hook is disabled with a warning.
    """

    def __init__(self, hooks: list[TrainingHook] | None = None) -> None:
        self._hooks = list(hooks or [])
        self._failures = [0] * len(self._hooks)

    @property
    def hooks(self) -> list[TrainingHook]:
        """The hooks still enabled, in call order."""
        return [
            h for h, n in zip(self._hooks, self._failures, strict=True) if n < MAX_HOOK_FAILURES
        ]

    def add(self, hook: TrainingHook) -> None:
        """Register one more hook, dispatched after the ones already held."""
        self._hooks.append(hook)
        self._failures.append(0)

    def __len__(self) -> int:
        return len(self.hooks)

    def on_train_begin(self, config: JobConfig) -> None:
        self._dispatch("on_train_begin", None, config)

    def on_gradients(self, ctx: StepContext) -> None:
        self._dispatch("on_gradients", ctx.step, ctx)

    def on_step_end(self, ctx: StepContext) -> None:
        self._dispatch("on_step_end", ctx.step, ctx)

    def on_eval_end(self, step: int, metrics: dict[str, float]) -> None:
        self._dispatch("on_eval_end", step, step, metrics)

    def on_checkpoint_save(self, step: int, path: str) -> None:
        self._dispatch("on_checkpoint_save", step, step, path)

    def on_train_end(self, step: int, tokens_seen: int) -> None:
        self._dispatch("on_train_end", step, step, tokens_seen)

    def _dispatch(self, event: str, step: int | None, *args: Any) -> None:
        for i, hook in enumerate(self._hooks):
            if self._failures[i] >= MAX_HOOK_FAILURES:
                continue
            try:
                getattr(hook, event)(*args)
            except Exception:
                self._failures[i] += 1
                name = type(hook).__qualname__
                where = "before the first step" if step is None else f"at step {step}"
                logger.error("hook %s failed in %s %s", name, event, where, exc_info=True)
                if self._failures[i] >= MAX_HOOK_FAILURES:
                    logger.warning(
                        "hook %s disabled after %d failures; training continues without it",
                        name,
                        MAX_HOOK_FAILURES,
                    )


def announce_commit(
    hooks: HookRunner,
    tracker: MetricsTracker,
    in_async_mode: bool,
    step: int,
    path: str,
    seconds: float,
) -> None:
    """A checkpoint is durable under its final name (the checkpoint manager's on_commit):
    only now are the hooks told, so a hook that copies or uploads ``path`` always finds it
    complete. In async mode, where that is steps after the save started, a
    ``checkpoint_committed`` event marks the moment; a sync save is committed when its
    ``checkpoint`` event is written."""
    if in_async_mode:
        tracker.log_event(step, "checkpoint_committed", path=path, seconds=round(seconds, 3))
    hooks.on_checkpoint_save(step, path)


_ALLOWED = "an import path 'package.module:ClassName' naming a TrainingHook subclass"


def load_hooks(paths: list[str]) -> list[TrainingHook]:
    """Import each 'package.module:ClassName' and build it with no arguments.

    Raises ConfigError("train.hooks", path, ...) when the module cannot be imported, the
    name is missing from it, it is not a TrainingHook subclass, or building it fails.
    """
    hooks = []
    for path in paths:
        cls = hook_class(path)
        try:
            hooks.append(cls())
        except Exception as e:
            attr = path.partition(":")[2]
            hint = f"{attr}() failed: {type(e).__name__}: {e}; hooks are built with no arguments"
            raise ConfigError("train.hooks", path, _ALLOWED, hint) from e
    return hooks


def hook_class(path: str) -> type[TrainingHook]:
    """The TrainingHook subclass 'package.module:ClassName' names, imported but not built.

    Modules are looked up the way ``python -m`` does, the working directory first, so a
    hook file next to where the run is launched imports with the installed command too.
    Raises the ConfigError load_hooks documents.
    """
    obj = import_named("train.hooks", path, _ALLOWED)
    if not (isinstance(obj, type) and issubclass(obj, TrainingHook)):
        what = f"class {obj.__name__}" if isinstance(obj, type) else type(obj).__name__
        hint = f"{path.partition(':')[2]} is not a TrainingHook subclass (it is a {what})"
        raise ConfigError("train.hooks", path, _ALLOWED, hint)
    return obj
