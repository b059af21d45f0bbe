"""ModelFamily: everything that differs between kinds of model (a text model, dense or MoE;
a vision-language model), one value per family, registered once (families/registry.py).

The build, eval, the end-of-run sample, the metrics, the checkpoint and the commands ask
the job's family instead of testing the model type themselves. MoE is a property of the
text model, not a family: its router terms and per-step hooks (model/moe/router_step.py) do nothing
for a model without MoE layers. Pipeline parallelism is the other seam (training/layout.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kempnerforge.config.job import JobConfig
from kempnerforge.config.train import TrainConfig
from kempnerforge.data.pipeline import DataPipeline
from kempnerforge.distributed.context_parallel import slice_batch
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.model.contract import FamilyModel
from kempnerforge.training.forward import BatchLoss
from kempnerforge.training.freeze import FreezeSchedule
from kempnerforge.training.session import StepResult, TrainingSession

StepFn = Callable[[TrainingSession, int], StepResult]
SampleFn = Callable[[torch.nn.Module, DataPipeline, JobConfig, torch.device], str | None]

COMMANDS = ("train", "eval", "generate", "capture", "export")
"""The commands that load a model of a config, so each family says whether it supports them."""


@dataclass(frozen=True)
class ModelSummary:
    """What the build logs about a model, and the FLOPs the MFU is computed from."""

    num_params: int
    """Parameters of the whole model (not this rank's shard), a tied matrix once."""
    flops_per_token: float
    """Training FLOPs per counted token (see ModelFamily.tokens_per_step)."""
    token: str = "token"
    """What one counted token is, for the log line."""
    groups: dict[str, int] = field(default_factory=dict)
    """Parameters per module group, when the model has groups."""


@dataclass(frozen=True)
class ModelFamily:
    """One model family's choices: families/text.py and families/vision_language.py each
    define one; a new family is a file like them plus one line in families/registry.py.

    The callables take the whole job so that every family has the same shape; each
    family's own functions take only the sections they read."""

    name: str
    build_model: Callable[[JobConfig], FamilyModel]
    """The whole model, on the caller's default device (meta in training: build.py)."""
    build_data: Callable[[JobConfig, RuntimeContext, bool], DataPipeline]
    """This rank's data (config, runtime, with_train): the training loader and eval sets."""
    step: StepFn
    """The step body without pipeline parallelism (select_step_fn)."""
    batch_loss: Callable[[JobConfig], BatchLoss]
    """The eval forward: a batch's summed cross-entropy (evaluate_model)."""
    sample: SampleFn
    """The end-of-run sample (model, data, config, device); None when it is off."""
    summarize: Callable[[JobConfig, torch.nn.Module], ModelSummary]
    """Parameter count and FLOPs per token, for the log and the MFU."""
    tokens_per_step: Callable[[TrainConfig, int, StepResult], int | None]
    """Tokens a step trained on over every rank (train config, dp size, the step's
    result); None when the step body did not report the count this family needs."""
    freeze_schedule: Callable[[JobConfig], FreezeSchedule]
    """Its freeze groups and their schedule (training/freeze.py); NO_FREEZE without groups."""
    checkpoint_extra: Callable[[JobConfig, int], dict[str, Any]]
    """Its keys of checkpoint_extra at a step (a resume checks them)."""
    no_eval_data: str
    """The error where eval data is needed and the job has none: what to set."""
    fill_unsaved: Callable[[Any], None]
    """After to_empty, fill what a checkpoint does not hold (tied weights, computed
    buffers), so a weights-only load makes the model whole (training/inference/loading.py)."""
    section: str | None = None
    """The JobConfig field whose table makes a job this family's ('vlm': a [vlm] table);
    None for the text family, which a job without any family's table is."""
    refusals: Mapping[str, str] = field(default_factory=dict)
    """Why a command of COMMANDS does not take this family, by command."""

    def refusal(self, command: str) -> str | None:
        """Why ``command`` does not take a model of this family; None when it does.

        ``command`` is a CLI command name from COMMANDS; any other name is our own bug
        and raises ValueError.
        """
        if command not in COMMANDS:
            raise ValueError(f"no command {command!r}: families answer for {', '.join(COMMANDS)}")
        return self.refusals.get(command)


def sliced_for_context_parallel(data: DataPipeline, runtime: RuntimeContext) -> DataPipeline:
    """``data`` with its batches cut to this rank's slice of every sequence when the job
    runs context parallelism (the whole batch otherwise): what its step bodies and eval read."""
    if runtime.cp_size > 1:
        data.batch_slice = functools.partial(
            slice_batch, runtime=runtime, prefix_len=data.prefix_len
        )
    return data
