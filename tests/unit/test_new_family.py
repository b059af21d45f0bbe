"""A new model family is one file and one registration: a bigram model (an embedding table
read as next-token logits) registered in this file alone trains through the whole build,
step and loop, with no edit to distributed/, the build or the loop."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from kempnerforge.config.job import JobConfig
from kempnerforge.config.loader import load_config
from kempnerforge.core.errors import ConfigError
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.model.contract import DecoderStack, FamilyModel
from kempnerforge.training.build import build_session
from kempnerforge.training.families import (
    TEXT,
    VISION_LANGUAGE,
    ModelSummary,
    family_of,
    register_family,
    unregister_family,
)
from kempnerforge.training.freeze import NO_FREEZE
from kempnerforge.training.loop import run_training_loop
from tests.support.metrics_rows import train_rows


@dataclasses.dataclass
class BigramConfig:
    """The toy family's own section: [bigram]."""

    init_std: float = 0.02


@dataclasses.dataclass
class BigramJobConfig(JobConfig):
    """A job with the toy family's section beside the built-in ones."""

    bigram: BigramConfig | None = None


class Bigram(FamilyModel):
    """Logits of the next token from the current token alone: no decoder blocks."""

    def __init__(self, vocab_size: int, init_std: float) -> None:
        super().__init__()
        self.init_std = init_std
        self.table = nn.Embedding(vocab_size, vocab_size)
        self.init_weights(seed=0)

    def decoder_stacks(self) -> list[DecoderStack]:
        return []

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        if self.table.weight.is_meta:
            return
        generator = torch.Generator().manual_seed(0 if seed is None else seed)
        weight = torch.randn(self.table.weight.shape, generator=generator) * self.init_std
        self.table.weight.copy_(weight)

    def forward(self, input_ids: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        del doc_ids
        return self.table(input_ids)


def _bigram_of(config: JobConfig) -> BigramConfig:
    section = getattr(config, "bigram", None)
    assert isinstance(section, BigramConfig)
    return section


BIGRAM = dataclasses.replace(
    TEXT,
    name="bigram",
    section="bigram",
    build_model=lambda config: Bigram(config.model.vocab_size, _bigram_of(config).init_std),
    summarize=lambda config, model: ModelSummary(
        num_params=sum(p.numel() for p in model.parameters()), flops_per_token=0.0
    ),
    sample=lambda model, data, config, device: None,
    freeze_schedule=lambda config: NO_FREEZE,
    fill_unsaved=lambda model: None,
    refusals={"generate": "a bigram model has no KV cache", "export": "no HF class"},
)


@pytest.fixture
def bigram_family():
    register_family(BIGRAM)
    yield BIGRAM
    unregister_family(BIGRAM)


def _bigram_job(overrides: list[str]) -> BigramJobConfig:
    base = load_config(None, [*overrides, "--train.loss_chunk_tokens=0"])
    sections = {f.name: getattr(base, f.name) for f in dataclasses.fields(JobConfig)}
    config = BigramJobConfig(**sections, bigram=BigramConfig(init_std=0.05))
    config.validate(1)
    return config


def test_a_registered_family_is_picked_by_its_section_and_trains(bigram_family, tiny_overrides):
    config = _bigram_job([*tiny_overrides, "--train.max_steps=2"])
    assert family_of(config) is bigram_family
    assert family_of(dataclasses.replace(config, bigram=None)) is TEXT

    session = build_session(config, RuntimeContext())
    assert isinstance(session.model, Bigram)
    before = session.model.table.weight.detach().clone()
    step, _ = run_training_loop(session)

    assert step == 2
    session.tracker.close()
    rows = train_rows(config.run_dir)
    losses = [row["loss"] for row in rows]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    # A bigram model at init predicts nearly uniformly over the byte vocabulary.
    assert losses[0] == pytest.approx(math.log(config.model.vocab_size), rel=0.05)
    assert not torch.equal(before, session.model.table.weight.detach())


def test_a_family_needs_a_section_and_a_name_of_its_own():
    with pytest.raises(ValueError, match="names no config section"):
        register_family(dataclasses.replace(TEXT, name="another"))
    with pytest.raises(ValueError, match="clashes"):
        register_family(dataclasses.replace(VISION_LANGUAGE, name="vision-language-2"))


def test_two_families_sections_in_one_job_are_refused(bigram_family, tiny_overrides):
    vlm = load_config(
        None,
        [
            *tiny_overrides,
            "--vision_encoder.type=random",
            "--vlm.max_text_len=8",
            "--vlm.synthetic_samples=16",
        ],
    )
    sections = {f.name: getattr(vlm, f.name) for f in dataclasses.fields(JobConfig)}
    both = BigramJobConfig(**sections, bigram=BigramConfig())
    with pytest.raises(ConfigError, match=r"bigram = .*no \[bigram\] table beside \[vlm\]"):
        family_of(both)
