"""The prompt of `kempnerforge generate --chat`: a conversation read from a JSON file or
string, rendered by the tokenizer's chat template with the assistant's turn opened, and
tokenized as `prepare-data --format chat` tokenizes, with the ids that end the reply."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kempnerforge.config.data import DataConfig
from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError, DataError
from kempnerforge.data.chat import (
    check_messages,
    encode_with_offsets,
    end_of_turn_ids,
    load_chat_template,
)
from kempnerforge.data.tokenizer import Tokenizer
from kempnerforge.training.inference.prompt import check_vocabulary, fit_new_tokens

CHAT_FLAG = "--chat"
SHAPES = 'a JSON list of {role, content} messages or {"messages": [...]}'


@dataclass(frozen=True)
class ChatPrompt:
    """What generate needs for one conversation's reply."""

    ids: list[int]
    """The rendered conversation's ids, ending with the assistant's opened turn."""
    max_new_tokens: int
    """New tokens to generate at most, cut to what model.max_seq_len leaves."""
    stop_ids: set[int]
    """End-of-turn ids and EOS: the reply ends before the first of them."""


def read_conversation(value: str) -> list[dict[str, Any]]:
    """The messages of ``--chat VALUE``: JSON text when it starts with '[' or '{', else the
    path of a JSON file holding it. Either shape of SHAPES; checked as prepare-data checks
    messages. A ConfigError or DataError naming --chat (and the file) otherwise."""
    text = value.strip()
    if text[:1] in ("[", "{"):
        where = CHAT_FLAG
    else:
        path = Path(value).expanduser()
        where = f"{CHAT_FLAG} {path}"
        if not path.is_file():
            raise ConfigError(
                CHAT_FLAG,
                value,
                f"{SHAPES}, or the path of a JSON file holding one",
                "no such file; JSON text must start with '[' or '{'",
            )
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise DataError(f"{where}: cannot read the conversation ({exc})") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: not valid JSON ({exc}); expected {SHAPES}") from None
    if isinstance(record, dict):
        if "messages" not in record:
            keys = ", ".join(sorted(map(str, record))) or "none"
            raise DataError(
                f"{where}: an object without 'messages' (keys: {keys}); expected {SHAPES}"
            )
        record = record["messages"]
    return check_messages(record, where)


def chat_prompt(
    tokenizer: Tokenizer,
    model: ModelConfig,
    data: DataConfig,
    messages: list[dict[str, Any]],
    *,
    max_new_tokens: int,
) -> ChatPrompt:
    """The prompt of ``messages`` under data.tokenizer's chat template.

    Rendered with add_generation_prompt=True and tokenized whole, once, without added
    special tokens (the template writes any BOS), as the training conversations were.
    """
    check_vocabulary(tokenizer, model, data)
    template = load_chat_template(data.tokenizer)
    try:
        text = template.render(messages, add_generation_prompt=True)
    except DataError as exc:
        raise DataError(f"{CHAT_FLAG}: {exc}") from None
    ids = [int(i) for i in encode_with_offsets(tokenizer, text)[0]]
    room = fit_new_tokens(ids, model, max_new_tokens, CHAT_FLAG)
    return ChatPrompt(ids, room, end_of_turn_ids(tokenizer, template))
