"""ModelLayout: layout_of picks the whole model or pipeline stages once; the build, the step
body, in-loop eval and the end-of-run sample follow the layout's choices."""

from __future__ import annotations

import logging

import torch

from kempnerforge.config.job import JobConfig
from kempnerforge.config.loader import load_config
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.model.transformer import Transformer
from kempnerforge.model.vision.vlm import VisionLanguageModel
from kempnerforge.training import build
from kempnerforge.training.inference.sample import sample_text
from kempnerforge.training.layout import PIPELINE_STAGES, WHOLE_MODEL, layout_of
from kempnerforge.training.steps import pipeline_step
from tests.support.resume import make_session
from tests.support.tiny import TINY_MODEL

PIPELINED = ["--distributed.pp=2", "--model.n_layers=4", "--train.grad_accum_steps=2"]


def _config(*overrides: str) -> JobConfig:
    return load_config(None, [*TINY_MODEL, *overrides])


def test_layout_of_is_pipeline_stages_only_with_pp_above_one():
    assert layout_of(_config().distributed) is WHOLE_MODEL
    assert layout_of(_config(*PIPELINED).distributed) is PIPELINE_STAGES


def test_only_the_pipeline_layout_has_a_step_body_and_lacks_a_whole_model_forward():
    assert WHOLE_MODEL.step is None and WHOLE_MODEL.forward_refusal is None
    assert PIPELINE_STAGES.step is pipeline_step
    assert "distributed.pp > 1" in str(PIPELINE_STAGES.forward_refusal)


def test_the_whole_model_layout_builds_the_familys_model_without_stages():
    runtime = RuntimeContext()
    vlm = ["--vision_encoder.type=random", "--vlm.max_text_len=8"]
    with torch.device("meta"):
        text = WHOLE_MODEL.build_on_meta(_config(), runtime)
        image = WHOLE_MODEL.build_on_meta(_config(*vlm), runtime)
    assert type(text.model) is Transformer and type(image.model) is VisionLanguageModel
    assert text.stage_ids == [] and text.stage_modules == []
    assert WHOLE_MODEL.build_schedule(text, runtime, _config(), torch.nn.MSELoss()) is None


def test_the_pipeline_layout_keeps_only_this_ranks_stage():
    config = _config(*PIPELINED)
    with torch.device("meta"):
        first = PIPELINE_STAGES.build_on_meta(config, RuntimeContext(pp_rank=0, pp_size=2))
        last = PIPELINE_STAGES.build_on_meta(config, RuntimeContext(pp_rank=1, pp_size=2))
    assert (first.stage_ids, last.stage_ids) == ([0], [1])
    assert len(first.stage_modules) == len(last.stage_modules) == 1
    assert sorted(first.model.layers) == ["0", "1"] and sorted(last.model.layers) == ["2", "3"]


def _warn(config: JobConfig) -> None:
    build._warn_what_the_layout_skips(layout_of(config.distributed), config.eval, config.train)


def test_the_build_says_once_what_a_pipelined_run_skips(caplog):
    with caplog.at_level(logging.WARNING, logger="kempnerforge"):
        _warn(_config(*PIPELINED, "--eval.interval=5"))
        _warn(_config(*PIPELINED, "--eval.interval=0", "--train.sample_tokens=0"))
        _warn(_config("--eval.interval=5"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "skipping in-loop eval (eval.interval = 5) and the end-of-run sample "
        "(train.sample_tokens = 120): pipeline stages (distributed.pp > 1) have no "
        "whole-model forward; evaluate or sample a checkpoint with `kempnerforge eval` or "
        "`kempnerforge generate`"
    ]


def test_there_is_no_sample_without_a_whole_model_forward(tiny_overrides):
    session = make_session(
        [*tiny_overrides, "--train.sample_prompt=alpha", "--train.sample_tokens=4"]
    )
    assert str(sample_text(session)).startswith("alpha")
    session.config.distributed.pp = 2  # what the layout reads: a pipelined job's config
    assert sample_text(session) is None
