"""The end-of-run sample: a greedy continuation of train.sample_prompt."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kempnerforge.model import generate_greedy
from kempnerforge.training.optimizer import optimizer_eval_mode

if TYPE_CHECKING:
    from kempnerforge.training.loop import TrainingSession


def sample_text(session: TrainingSession) -> str | None:
    """Greedily continue the configured prompt; None when sampling is off."""
    tc = session.config.train
    if not tc.sample_prompt or tc.sample_tokens == 0:
        return None
    tokenizer = session.data.tokenizer
    with optimizer_eval_mode(session.optimizer):
        new_ids = generate_greedy(
            session.model,
            tokenizer.encode(tc.sample_prompt),
            max_new_tokens=tc.sample_tokens,
            max_seq_len=tc.seq_len,
            stop_id=tokenizer.eos_id,
        )
    return tc.sample_prompt + tokenizer.decode(new_ids)


def print_sample(session: TrainingSession) -> None:
    text = sample_text(session)
    if text is not None:
        rule = "-" * 60
        print(f"sample (greedy, {session.config.train.sample_tokens} tokens):\n{rule}")
        print(text)
        print(rule)
