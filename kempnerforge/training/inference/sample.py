"""The end-of-run sample: the model family's (a prompt's continuation, an image's caption),
printed by rank 0."""

from __future__ import annotations

from kempnerforge.model.attention import whole_sequences
from kempnerforge.optim.optimizer import optimizer_eval_mode
from kempnerforge.training.families import family_of, prompt_ids
from kempnerforge.training.layout import layout_of
from kempnerforge.training.session import TrainingSession

__all__ = ["print_sample", "prompt_ids", "sample_text"]


def sample_text(session: TrainingSession) -> str | None:
    """The model family's greedy sample (ModelFamily.sample), at the optimizer's evaluation
    point; None when sampling is off or no rank holds the whole model.

    Collective when the model is sharded (FSDP gathers, tensor-parallel layers reduce):
    every rank calls it and decodes the same tokens. A pipelined model has no whole-model
    forward on one rank (ModelLayout.forward_refusal), so there is no sample.
    """
    config = session.config
    if layout_of(config.distributed).forward_refusal is not None:
        return None
    # Context-parallel ranks decode whole windows side by side: a growing window does not
    # split evenly, and every rank must run the same forwards for FSDP's gathers anyway.
    with optimizer_eval_mode(session.optimizer), whole_sequences(session.model):
        return family_of(config).sample(session.model, session.data, config, session.runtime.device)


def print_sample(session: TrainingSession) -> None:
    """Every rank samples (see sample_text); rank 0 prints."""
    text = sample_text(session)
    if text is not None and session.runtime.is_main:
        rule = "-" * 60
        print(f"sample (greedy, {session.config.train.sample_tokens} tokens):\n{rule}")
        print(text)
        print(rule)
