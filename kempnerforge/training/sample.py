"""The end-of-run sample: a greedy continuation of train.sample_prompt."""

from __future__ import annotations

from kempnerforge.data.tokenizer import Tokenizer
from kempnerforge.model import generate_greedy
from kempnerforge.training.optimizer import optimizer_eval_mode
from kempnerforge.training.session import TrainingSession


def prompt_ids(tokenizer: Tokenizer, prompt: str, bos_per_document: bool) -> list[int]:
    """The prompt's ids, after a BOS when the training documents started with one, so the
    model continues a document the way it saw documents begin."""
    ids = tokenizer.encode(prompt)
    return [tokenizer.bos_id, *ids] if bos_per_document else ids


def sample_text(session: TrainingSession) -> str | None:
    """Greedily continue the configured prompt; None when sampling is off."""
    tc = session.config.train
    if not tc.sample_prompt or tc.sample_tokens == 0:
        return None
    tokenizer = session.data.tokenizer
    with optimizer_eval_mode(session.optimizer):
        new_ids = generate_greedy(
            session.model,
            prompt_ids(tokenizer, tc.sample_prompt, session.data.bos_per_document),
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
