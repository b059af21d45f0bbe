"""The end-of-run sample: a greedy continuation of train.sample_prompt."""

from __future__ import annotations

from kempnerforge.data.tokenizer import Tokenizer
from kempnerforge.model import generate_greedy
from kempnerforge.optim.optimizer import optimizer_eval_mode
from kempnerforge.training.forward import vlm_window_logits
from kempnerforge.training.session import TrainingSession


def prompt_ids(tokenizer: Tokenizer, prompt: str, bos_per_document: bool) -> list[int]:
    """The prompt's ids, after a BOS when the training documents started with one, so the
    model continues a document the way it saw documents begin."""
    ids = tokenizer.encode(prompt)
    return [tokenizer.bos_id, *ids] if bos_per_document else ids


def sample_text(session: TrainingSession) -> str | None:
    """Greedily continue the configured prompt; None when sampling is off or pipelined.

    Collective when the model is sharded (FSDP gathers, tensor-parallel layers reduce):
    every rank calls it and decodes the same tokens. A pipelined model has no whole-model
    forward on one rank, so there is no sample.
    """
    tc = session.config.train
    if session.config.is_vlm and tc.sample_tokens > 0:
        return caption_sample(session)
    if not tc.sample_prompt or tc.sample_tokens == 0 or session.pipeline is not None:
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


def caption_sample(session: TrainingSession) -> str | None:
    """A vision-language model's greedy caption of the first held-out image (the first
    training image without eval data), after BOS and train.sample_prompt, with the
    reference caption; None without data."""
    config, tokenizer = session.config, session.data.tokenizer
    assert config.vlm is not None
    dataset = session.data.eval_dataset or session.data.dataset
    if dataset is None or len(dataset) == 0:
        return None
    sample = dataset[0]
    device = session.runtime.device
    pixels = sample["pixel_values"][None].to(device)
    prompt = [tokenizer.bos_id, *tokenizer.encode(config.train.sample_prompt)]
    room = config.vlm.max_text_len - len(prompt)
    with optimizer_eval_mode(session.optimizer):
        new_ids = generate_greedy(
            session.model,
            prompt,
            max_new_tokens=max(0, min(config.train.sample_tokens, room)),
            max_seq_len=config.vlm.max_text_len,
            stop_id=tokenizer.eos_id,
            forward=vlm_window_logits(session.model, pixels),
        )
    labels = [int(t) for t in sample["labels"] if int(t) >= 0 and int(t) != tokenizer.eos_id]
    caption = config.train.sample_prompt + tokenizer.decode(new_ids)
    return f"caption of image 0: {caption!r}\nreference:          {tokenizer.decode(labels)!r}"


def print_sample(session: TrainingSession) -> None:
    """Every rank samples (see sample_text); rank 0 prints."""
    text = sample_text(session)
    if text is not None and session.runtime.is_main:
        rule = "-" * 60
        print(f"sample (greedy, {session.config.train.sample_tokens} tokens):\n{rule}")
        print(text)
        print(rule)
