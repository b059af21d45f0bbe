"""ModelFamily: family_of picks TEXT or VISION_LANGUAGE once, and each family's choices
(build, data, step body, eval forward, sample, size, tokens, freeze, checkpoint keys,
refusals) are its own."""

from __future__ import annotations

import argparse

import pytest
import torch

from kempnerforge.commands.capture import add_capture_arguments, run_capture
from kempnerforge.config.job import JobConfig
from kempnerforge.config.loader import load_config
from kempnerforge.core.errors import ConfigError
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.model.heads.head_loss import HeadLossSpec
from kempnerforge.model.transformer import Transformer, flops_per_token
from kempnerforge.model.vision.vlm import VisionLanguageModel
from kempnerforge.training.families import (
    COMMANDS,
    TEXT,
    VISION_LANGUAGE,
    ModelFamily,
    family_of,
)
from kempnerforge.training.forward import vlm_batch_loss
from kempnerforge.training.freeze import NO_FREEZE
from kempnerforge.training.loss import cross_entropy_sum
from kempnerforge.training.session import StepResult
from kempnerforge.training.steps import text_step, vlm_step
from tests.support.tiny import TINY_MODEL

VLM = ["--vision_encoder.type=random", "--vlm.max_text_len=8", "--vlm.synthetic_samples=16"]
MOE = ["--model.num_experts=4", "--model.moe_top_k=2", "--model.moe_expert_hidden_dim=16"]


def _config(*overrides: str) -> JobConfig:
    config = load_config(None, [*TINY_MODEL, "--train.seq_len=32", *overrides])
    config.validate(1)
    return config


def test_family_of_is_vision_language_only_for_a_vlm_table():
    assert family_of(_config()) is TEXT
    assert family_of(_config(*MOE)) is TEXT  # MoE is a property of the text model
    assert family_of(_config(*VLM)) is VISION_LANGUAGE
    assert family_of(_config(*VLM, *MOE)) is VISION_LANGUAGE


def test_each_family_names_its_step_body_and_eval_forward():
    assert TEXT.step is text_step
    assert VISION_LANGUAGE.step is vlm_step
    assert VISION_LANGUAGE.batch_loss(_config(*VLM)) is vlm_batch_loss
    config = _config("--data.document_masking=false")
    torch.manual_seed(0)
    model = Transformer(config.model)
    ids = torch.randint(0, config.model.vocab_size, (2, 8))
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1)}
    got = TEXT.batch_loss(config)(model, batch, batch, HeadLossSpec(0, 0.0))
    torch.testing.assert_close(got, cross_entropy_sum(model(ids), batch["labels"]))


def test_each_family_builds_its_own_model_and_data(token_dirs):
    train, evald = token_dirs
    text, vlm = _config(f"--data.path={train}", f"--data.eval_path={evald}"), _config(*VLM)
    with torch.device("meta"):
        assert type(TEXT.build_model(text)) is Transformer
        assert type(VISION_LANGUAGE.build_model(vlm)) is VisionLanguageModel
    runtime = RuntimeContext()
    token_batch = next(iter(TEXT.build_data(text, runtime, True).dataloader))
    assert token_batch["input_ids"].shape[-1] == text.train.seq_len
    assert "pixel_values" not in token_batch
    image_batch = next(iter(VISION_LANGUAGE.build_data(vlm, runtime, True).dataloader))
    assert image_batch["pixel_values"].dim() == 4
    assert image_batch["input_ids"].shape[-1] == vlm.vlm.max_text_len
    eval_only = VISION_LANGUAGE.build_data(vlm, runtime, False)
    assert eval_only.dataloader is None and eval_only.eval_datasets


def test_a_text_family_counts_every_parameter_and_the_active_flops():
    config = _config(*MOE)
    with torch.device("meta"):
        model = TEXT.build_model(config)
    summary = TEXT.summarize(config, model)
    assert summary.num_params == config.model.num_params() == model.num_params()
    assert summary.flops_per_token == flops_per_token(config.model, config.train.seq_len)
    assert summary.flops_per_token < 6 * summary.num_params  # 2 of 4 experts are active
    assert (summary.token, summary.groups) == ("token", {})


def test_a_vision_language_family_counts_per_text_token_by_group():
    config = _config(*VLM)
    with torch.device("meta"):
        model = VISION_LANGUAGE.build_model(config)
    assert isinstance(model, VisionLanguageModel)
    summary = VISION_LANGUAGE.summarize(config, model)
    assert summary.num_params == model.num_params() == sum(summary.groups.values())
    assert set(summary.groups) == {"encoder", "adapter", "decoder"}
    assert summary.flops_per_token == model.flops_per_text_token(8)
    assert summary.token.startswith("text token")


def test_tokens_per_step_are_every_position_or_the_supervised_text_tokens():
    train = _config("--train.batch_size=3", "--train.grad_accum_steps=2").train
    result = StepResult(loss=1.0, grad_norm=1.0, text_tokens=77)
    assert TEXT.tokens_per_step(train, 4, result) == 3 * 32 * 2 * 4
    assert VISION_LANGUAGE.tokens_per_step(train, 4, result) == 77
    assert VISION_LANGUAGE.tokens_per_step(train, 4, StepResult(1.0, 1.0)) is None


def test_only_a_vision_language_model_has_freeze_groups_and_checkpoint_keys():
    text = _config()
    assert TEXT.freeze_schedule(text) is NO_FREEZE
    assert TEXT.checkpoint_extra(text, 3) == {}
    vlm = _config(
        *VLM,
        '--vlm.freeze=[{module="encoder", frozen=true}]',
        '--vlm.freeze_schedule=[{start_step=2, specs=[{module="encoder", frozen=false}]}]',
    )
    schedule = VISION_LANGUAGE.freeze_schedule(vlm)
    assert schedule.groups == ("encoder", "adapter", "decoder")
    assert [s.start_step for s in schedule.stages] == [2]
    assert schedule.state_at(1)["encoder"] and not schedule.state_at(2)["encoder"]
    assert VISION_LANGUAGE.checkpoint_extra(vlm, 1) == {"vlm_freeze": schedule.meta_at(1)}


def test_the_text_family_supports_every_command():
    assert [TEXT.refusal(c) for c in COMMANDS] == [None] * len(COMMANDS)


def test_a_vision_language_model_is_refused_by_generate_capture_and_export():
    refusals = {c: VISION_LANGUAGE.refusal(c) for c in COMMANDS}
    assert refusals["train"] is None and refusals["eval"] is None
    lead = "takes text models, not a vision-language model ([vlm]): "
    assert (
        refusals["generate"] == f"kempnerforge generate {lead}it continues text prompts; a "
        "vision-language model's caption sample is printed at the end of training"
    )
    assert refusals["capture"] == (
        f"kempnerforge capture {lead}it runs token windows, not image-text pairs, through the model"
    )
    export = refusals["export"]
    assert export is not None and export.startswith(f"kempnerforge export {lead}")
    assert "Hugging Face" in export


def test_capture_refuses_a_vision_language_config_for_the_familys_reason(tmp_path):
    parser = argparse.ArgumentParser()
    add_capture_arguments(parser)
    config = tmp_path / "config.toml"
    config.write_text("")
    args = parser.parse_args(
        ["--checkpoint", str(tmp_path), "--layers", "norm", "--config", str(config)]
    )
    with pytest.raises(ConfigError) as info:
        run_capture(args, VLM)
    assert str(VISION_LANGUAGE.refusal("capture")) in str(info.value)


def test_a_command_no_family_knows_is_a_bug_not_a_refusal():
    with pytest.raises(ValueError, match="no command 'exprot'"):
        TEXT.refusal("exprot")


def test_families_are_frozen_values():
    assert isinstance(TEXT, ModelFamily)
    with pytest.raises(AttributeError):
        TEXT.step = vlm_step  # type: ignore[misc]
