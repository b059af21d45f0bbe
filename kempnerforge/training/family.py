"""ModelFamily: everything that differs between a text model (dense or MoE) and a
vision-language model, one value per family, picked once per job by family_of.

The build, eval, the end-of-run sample, the metrics, the checkpoint and the commands ask
the job's family instead of testing the model type themselves. MoE is a property of the
text model, not a family: its router terms and per-step hooks (model/router_step.py) do nothing
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
from kempnerforge.data.pipeline import NO_IMAGE_TEXT_EVAL_DATA, NO_TOKEN_EVAL_DATA, DataPipeline
from kempnerforge.data.pipeline_build import build_data_pipeline, build_image_text_pipeline
from kempnerforge.data.tokenizer import Tokenizer
from kempnerforge.distributed.context_parallel import slice_batch
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.model import generate_greedy
from kempnerforge.model.transformer import Transformer, build_model
from kempnerforge.model.transformer import flops_per_token as model_flops_per_token
from kempnerforge.model.vlm import VisionLanguageModel, build_vlm
from kempnerforge.training.forward import (
    BatchLoss,
    text_batch_loss_fn,
    vlm_batch_loss,
    vlm_window_logits,
)
from kempnerforge.training.freeze import NO_FREEZE, FreezeSchedule
from kempnerforge.training.session import StepResult, TrainingSession
from kempnerforge.training.steps import text_step, vlm_step

FamilyModel = Transformer | VisionLanguageModel
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
    """One model family's choices; TEXT and VISION_LANGUAGE are the two instances."""

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


# --- Text models (dense or MoE) --------------------------------------------------------


def build_text_model(config: JobConfig) -> Transformer:
    """The decoder of model.*."""
    return build_model(config.model)


def build_token_data(config: JobConfig, runtime: RuntimeContext, with_train: bool) -> DataPipeline:
    """Token windows of data.*, and the eval sets (eval.sets, or the held-out split)."""
    tc = config.train
    data = build_data_pipeline(
        config.data,
        seq_len=tc.seq_len,
        batch_size=tc.batch_size,
        seed=tc.seed,
        dp_rank=runtime.dp_rank,
        dp_size=runtime.dp_size,
        model_vocab_size=config.model.vocab_size,
        with_train=with_train,
        eval_sets=config.eval.sets,
    )
    return sliced_for_context_parallel(data, runtime)


def sliced_for_context_parallel(data: DataPipeline, runtime: RuntimeContext) -> DataPipeline:
    """``data`` with its batches cut to this rank's slice of every sequence when the job
    runs context parallelism (the whole batch otherwise): what its step bodies and eval read."""
    if runtime.cp_size > 1:
        data.batch_slice = functools.partial(
            slice_batch, runtime=runtime, prefix_len=data.prefix_len
        )
    return data


def summarize_text_model(config: JobConfig, model: torch.nn.Module) -> ModelSummary:
    """Every parameter the config builds (all experts of an MoE model), from the config, so
    a sharded or pipelined rank logs the whole model; FLOPs per token at train.seq_len
    count an MoE block's active experts only."""
    del model
    return ModelSummary(
        num_params=config.model.num_params(),
        flops_per_token=model_flops_per_token(config.model, config.train.seq_len),
    )


def text_tokens_per_step(train: TrainConfig, dp_size: int, result: StepResult) -> int:
    """Every position of every sequence of the step, over the data-parallel ranks."""
    del result
    return train.batch_size * train.seq_len * train.grad_accum_steps * dp_size


def prompt_ids(tokenizer: Tokenizer, prompt: str, bos_per_document: bool) -> list[int]:
    """The prompt's ids, after a BOS when the training documents started with one, so the
    model continues a document the way it saw documents begin."""
    ids = tokenizer.encode(prompt)
    return [tokenizer.bos_id, *ids] if bos_per_document else ids


def continue_prompt(
    model: torch.nn.Module, data: DataPipeline, config: JobConfig, device: torch.device
) -> str | None:
    """A greedy continuation of train.sample_prompt, train.sample_tokens long; None when
    either is empty."""
    del device  # generate_greedy decodes on the device the model is on
    tc = config.train
    if not tc.sample_prompt or tc.sample_tokens == 0:
        return None
    tokenizer = data.tokenizer
    new_ids = generate_greedy(
        model,
        prompt_ids(tokenizer, tc.sample_prompt, data.bos_per_document),
        max_new_tokens=tc.sample_tokens,
        max_seq_len=tc.seq_len,
        stop_id=tokenizer.eos_id,
    )
    return tc.sample_prompt + tokenizer.decode(new_ids)


# --- Vision-language models ------------------------------------------------------------


def build_vision_language_model(config: JobConfig) -> VisionLanguageModel:
    """Encoder, adapter and decoder of [vision_encoder], [adapter], [vlm] and model.*."""
    return build_vlm(
        config.model, config.vision_encoder, config.adapter, config.vlm, config.vision_spec()
    )


def build_image_text_data(
    config: JobConfig, runtime: RuntimeContext, with_train: bool
) -> DataPipeline:
    """Image-text pairs of vlm.data and vlm.eval_data (or synthetic ones); batches are
    sliced for context parallelism after the joint decoder's image tokens."""
    assert config.vlm is not None
    tc, spec = config.train, config.vision_spec()
    data = build_image_text_pipeline(
        config.data,
        config.vlm,
        spec,
        batch_size=tc.batch_size,
        seed=tc.seed,
        dp_rank=runtime.dp_rank,
        dp_size=runtime.dp_size,
        model_vocab_size=config.model.vocab_size,
        with_train=with_train,
        prefix_len=config.decoder_positions(spec) - config.vlm.max_text_len,
    )
    return sliced_for_context_parallel(data, runtime)


def summarize_vision_language_model(config: JobConfig, model: torch.nn.Module) -> ModelSummary:
    """The model's parameters by group, and approximate FLOPs per supervised text token
    (VisionLanguageModel.flops_per_text_token)."""
    assert isinstance(model, VisionLanguageModel) and config.vlm is not None
    return ModelSummary(
        num_params=model.num_params(),
        flops_per_token=model.flops_per_text_token(config.vlm.max_text_len),
        token="text token (approximate)",
        groups=model.group_sizes(),
    )


def text_tokens_of(train: TrainConfig, dp_size: int, result: StepResult) -> int | None:
    """The step's supervised text tokens over every rank, as its step body counted them
    (image positions and padding are not trained on)."""
    del train, dp_size
    return result.text_tokens


def caption_sample(
    model: torch.nn.Module, data: DataPipeline, config: JobConfig, device: torch.device
) -> str | None:
    """A greedy caption of the first held-out image (the first training image without
    eval data), after BOS and train.sample_prompt, with the reference caption; None when
    train.sample_tokens is 0 or there is no image."""
    assert config.vlm is not None
    dataset = data.eval_dataset or data.dataset
    if config.train.sample_tokens == 0 or dataset is None or len(dataset) == 0:
        return None
    tokenizer = data.tokenizer
    sample = dataset[0]
    pixels = sample["pixel_values"][None].to(device)
    prompt = [tokenizer.bos_id, *tokenizer.encode(config.train.sample_prompt)]
    room = config.vlm.max_text_len - len(prompt)
    new_ids = generate_greedy(
        model,
        prompt,
        max_new_tokens=max(0, min(config.train.sample_tokens, room)),
        max_seq_len=config.vlm.max_text_len,
        stop_id=tokenizer.eos_id,
        forward=vlm_window_logits(model, pixels),
    )
    labels = [int(t) for t in sample["labels"] if int(t) >= 0 and int(t) != tokenizer.eos_id]
    caption = config.train.sample_prompt + tokenizer.decode(new_ids)
    return f"caption of image 0: {caption!r}\nreference:          {tokenizer.decode(labels)!r}"


def vlm_freeze_schedule(config: JobConfig) -> FreezeSchedule:
    """vlm.freeze at step 0, then the stages of vlm.freeze_schedule, over the groups the
    arch has (vlm.freeze_groups)."""
    assert config.vlm is not None
    vlm = config.vlm
    return FreezeSchedule(
        groups=tuple(vlm.freeze_groups),
        base=tuple(vlm.freeze),
        stages=tuple(vlm.freeze_schedule),
        config_field="vlm.freeze_schedule",
    )


def vlm_checkpoint_extra(config: JobConfig, step: int) -> dict[str, Any]:
    """``vlm_freeze``: the freeze state after the last stage at or before ``step``."""
    return {"vlm_freeze": vlm_freeze_schedule(config).meta_at(step)}


def fill_text_unsaved(model: Transformer) -> None:
    """What a text checkpoint does not hold: the tied head, the RoPE tables."""
    model.tie_head()
    model.reset_buffers()


# --- The families, and the one choice between them ------------------------------------

TEXT = ModelFamily(
    name="text",
    build_model=build_text_model,
    build_data=build_token_data,
    step=text_step,
    batch_loss=lambda config: text_batch_loss_fn(config.data.document_masking),
    sample=continue_prompt,
    summarize=summarize_text_model,
    tokens_per_step=text_tokens_per_step,
    freeze_schedule=lambda config: NO_FREEZE,
    checkpoint_extra=lambda config, step: {},
    no_eval_data=NO_TOKEN_EVAL_DATA,
    fill_unsaved=fill_text_unsaved,
)

VISION_LANGUAGE = ModelFamily(
    name="vision-language",
    build_model=build_vision_language_model,
    build_data=build_image_text_data,
    step=vlm_step,
    batch_loss=lambda config: vlm_batch_loss,
    sample=caption_sample,
    summarize=summarize_vision_language_model,
    tokens_per_step=text_tokens_of,
    freeze_schedule=vlm_freeze_schedule,
    checkpoint_extra=vlm_checkpoint_extra,
    # A pretrained tower's encoder fills its own buffers (position ids) as it initialises;
    # the load then overwrites every weight.
    no_eval_data=NO_IMAGE_TEXT_EVAL_DATA,
    fill_unsaved=lambda model: model.init_weights(),
    refusals={
        command: f"kempnerforge {command} takes text models, not a vision-language model "
        f"([vlm]): {reason}"
        for command, reason in (
            (
                "generate",
                "it continues text prompts; a vision-language model's caption sample is "
                "printed at the end of training",
            ),
            ("capture", "it runs token windows, not image-text pairs, through the model"),
            (
                "export",
                "a Hugging Face causal language model has no place for the vision encoder, "
                "the adapter and the cross-attention blocks",
            ),
        )
    },
)


def family_of(config: JobConfig) -> ModelFamily:
    """The model family of this job: a [vlm] table makes it vision-language."""
    return VISION_LANGUAGE if config.is_vlm else TEXT


def build_job_data(
    config: JobConfig, runtime: RuntimeContext, *, with_train: bool = True
) -> DataPipeline:
    """This rank's data, as the job's model family reads it: image-text pairs for a [vlm]
    job, token windows otherwise."""
    return family_of(config).build_data(config, runtime, with_train)
