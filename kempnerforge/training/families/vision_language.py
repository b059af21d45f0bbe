"""VISION_LANGUAGE: images and text through a vision encoder, an adapter and the text
decoder ([vision_encoder], [adapter], [vlm] and model.*), on image-text pairs."""

from __future__ import annotations

from typing import Any

import torch

from kempnerforge.config.job import JobConfig
from kempnerforge.config.train import TrainConfig
from kempnerforge.config.vlm import VLMConfig
from kempnerforge.data.pipeline import NO_IMAGE_TEXT_EVAL_DATA, DataPipeline
from kempnerforge.data.pipeline_build import build_image_text_pipeline
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.model import generate_greedy
from kempnerforge.model.vision import VisionLanguageModel, build_vlm
from kempnerforge.training.families.family import (
    ModelFamily,
    ModelSummary,
    sliced_for_context_parallel,
)
from kempnerforge.training.forward import vlm_batch_loss, vlm_window_logits
from kempnerforge.training.freeze import FreezeSchedule
from kempnerforge.training.session import StepResult
from kempnerforge.training.steps import vlm_step


def vlm_section(vlm: VLMConfig | None) -> VLMConfig:
    """The job's [vlm] table (JobConfig.vlm); family_of picks this family only for a job
    that has one."""
    assert vlm is not None, "a vision-language job has a [vlm] table"
    return vlm


def build_image_text_data(
    config: JobConfig, runtime: RuntimeContext, with_train: bool
) -> DataPipeline:
    """Image-text pairs of vlm.data and vlm.eval_data (or synthetic ones); batches are
    sliced for context parallelism after the joint decoder's image tokens."""
    vlm, tc, spec = vlm_section(config.vlm), config.train, config.vision_spec()
    data = build_image_text_pipeline(
        config.data,
        vlm,
        spec,
        batch_size=tc.batch_size,
        seed=tc.seed,
        dp_rank=runtime.dp_rank,
        dp_size=runtime.dp_size,
        model_vocab_size=config.model.vocab_size,
        with_train=with_train,
        prefix_len=config.decoder_positions(spec) - vlm.max_text_len,
    )
    return sliced_for_context_parallel(data, runtime)


def summarize_vision_language_model(vlm: VLMConfig, model: torch.nn.Module) -> ModelSummary:
    """The model's parameters by group, and approximate FLOPs per supervised text token
    (VisionLanguageModel.flops_per_text_token)."""
    assert isinstance(model, VisionLanguageModel)
    return ModelSummary(
        num_params=model.num_params(),
        flops_per_token=model.flops_per_text_token(vlm.max_text_len),
        token="text token (approximate)",
        groups=model.group_sizes(),
    )


def text_tokens_of(train: TrainConfig, dp_size: int, result: StepResult) -> int | None:
    """The step's supervised text tokens over every rank, as its step body counted them
    (image positions and padding are not trained on)."""
    del train, dp_size
    return result.text_tokens


def caption_sample(
    model: torch.nn.Module,
    data: DataPipeline,
    train: TrainConfig,
    vlm: VLMConfig,
    device: torch.device,
) -> str | None:
    """A greedy caption of the first held-out image (the first training image without
    eval data), after BOS and train.sample_prompt, with the reference caption; None when
    train.sample_tokens is 0 or there is no image."""
    dataset = data.eval_dataset or data.dataset
    if train.sample_tokens == 0 or dataset is None or len(dataset) == 0:
        return None
    tokenizer = data.tokenizer
    sample = dataset[0]
    pixels = sample["pixel_values"][None].to(device)
    prompt = [tokenizer.bos_id, *tokenizer.encode(train.sample_prompt)]
    room = vlm.max_text_len - len(prompt)
    new_ids = generate_greedy(
        model,
        prompt,
        max_new_tokens=max(0, min(train.sample_tokens, room)),
        max_seq_len=vlm.max_text_len,
        stop_id=tokenizer.eos_id,
        forward=vlm_window_logits(model, pixels),
    )
    labels = [int(t) for t in sample["labels"] if int(t) >= 0 and int(t) != tokenizer.eos_id]
    caption = train.sample_prompt + tokenizer.decode(new_ids)
    return f"caption of image 0: {caption!r}\nreference:          {tokenizer.decode(labels)!r}"


def vlm_freeze_schedule(vlm: VLMConfig) -> FreezeSchedule:
    """vlm.freeze at step 0, then the stages of vlm.freeze_schedule, over the groups the
    arch has (vlm.freeze_groups)."""
    return FreezeSchedule(
        groups=tuple(vlm.freeze_groups),
        base=tuple(vlm.freeze),
        stages=tuple(vlm.freeze_schedule),
        config_field="vlm.freeze_schedule",
    )


def vlm_checkpoint_extra(vlm: VLMConfig, step: int) -> dict[str, Any]:
    """``vlm_freeze``: the freeze state after the last stage at or before ``step``."""
    return {"vlm_freeze": vlm_freeze_schedule(vlm).meta_at(step)}


VISION_LANGUAGE = ModelFamily(
    name="vision-language",
    section="vlm",
    # Encoder, adapter and decoder of [vision_encoder], [adapter], [vlm] and model.*.
    build_model=lambda config: build_vlm(
        config.model, config.vision_encoder, config.adapter, config.vlm, config.vision_spec()
    ),
    build_data=build_image_text_data,
    step=vlm_step,
    batch_loss=lambda config: vlm_batch_loss,
    sample=lambda model, data, config, device: caption_sample(
        model, data, config.train, vlm_section(config.vlm), device
    ),
    summarize=lambda config, model: summarize_vision_language_model(vlm_section(config.vlm), model),
    tokens_per_step=text_tokens_of,
    freeze_schedule=lambda config: vlm_freeze_schedule(vlm_section(config.vlm)),
    checkpoint_extra=lambda config, step: vlm_checkpoint_extra(vlm_section(config.vlm), step),
    no_eval_data=NO_IMAGE_TEXT_EVAL_DATA,
    # A pretrained tower's encoder fills its own buffers (position ids) as it initialises;
    # the load then overwrites every weight.
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
