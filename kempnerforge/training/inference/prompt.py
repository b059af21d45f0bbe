"""The token ids `kempnerforge generate` starts from: its prompt after a BOS when the
training documents began with one, and how many new tokens the model's context leaves."""

from __future__ import annotations

from kempnerforge.config.data import DataConfig
from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError, DataError
from kempnerforge.core.logging import get_logger
from kempnerforge.data.tokenizer import Tokenizer
from kempnerforge.data.tokens import read_parts
from kempnerforge.training.inference.sample import prompt_ids

logger = get_logger(__name__)


def data_starts_with_bos(data: DataConfig) -> bool | None:
    """Whether the training documents started with BOS, as the end-of-run sample decides
    it: every training source prepared with --bos (its meta.json), or data.builtin_bos for
    the built-in corpus. None when a source's meta.json cannot be read. A sharded source
    reads as its shards' common metadata."""
    paths = [source.path for source in data.datasets] or ([data.path] if data.path else [])
    if not paths:
        return data.builtin_bos
    try:
        return all(bool(read_parts(path)[0]["bos_per_document"]) for path in paths)
    except DataError:
        return None


def generation_prompt(
    tokenizer: Tokenizer,
    model: ModelConfig,
    data: DataConfig,
    prompt: str,
    *,
    bos: bool | None,
    max_new_tokens: int,
) -> tuple[list[int], int]:
    """The ids of ``prompt`` and the new tokens to generate at most.

    BOS comes first when ``bos``, or when it is None and the training data began its
    documents with one (data_starts_with_bos; unknown: none, with a warning). The new
    tokens are cut, with a warning, to what model.max_seq_len leaves after the prompt. A
    ConfigError when the tokenizer's vocabulary passes model.vocab_size, or the prompt
    leaves no room.
    """
    check_vocabulary(tokenizer, model, data)
    if bos is None:
        bos = data_starts_with_bos(data)
        if bos is None:
            logger.warning(
                "cannot read the training data's meta.json to tell whether its documents "
                "start with BOS; prompting without one (pass --bos to add it)"
            )
            bos = False
    ids = prompt_ids(tokenizer, prompt, bos)
    return ids, fit_new_tokens(ids, model, max_new_tokens, "--prompt")


def check_vocabulary(tokenizer: Tokenizer, model: ModelConfig, data: DataConfig) -> None:
    """ConfigError when the tokenizer's ids pass model.vocab_size."""
    if tokenizer.vocab_size > model.vocab_size:
        raise ConfigError(
            "model.vocab_size",
            model.vocab_size,
            f">= the tokenizer's vocabulary size {tokenizer.vocab_size}",
            f"data.tokenizer = {data.tokenizer!r}",
        )


def fit_new_tokens(ids: list[int], model: ModelConfig, max_new_tokens: int, argument: str) -> int:
    """How many new tokens to generate after the prompt ``ids``: max_new_tokens, cut with a
    warning to what model.max_seq_len leaves; a ConfigError naming ``argument`` (the flag
    the prompt came from) when the prompt leaves no room."""
    limit = model.max_seq_len
    room = limit - len(ids)
    if room < 1:
        raise ConfigError(
            argument,
            f"{len(ids)} tokens",
            f"fewer than model.max_seq_len = {limit} tokens",
            "the prompt and its continuation must fit the model's context",
        )
    if max_new_tokens > room:
        logger.warning(
            "generating %d tokens, not %d: the prompt (%d tokens) and its continuation must "
            "fit model.max_seq_len = %d",
            room,
            max_new_tokens,
            len(ids),
            limit,
        )
    return min(max_new_tokens, room)
