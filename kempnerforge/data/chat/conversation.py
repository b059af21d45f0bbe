"""Conversations for supervised fine-tuning: checking their messages, and turning one into
tokens plus a loss mask that is on exactly for what the assistant says.

The rendered conversation is tokenized whole, once, without added special tokens, so the ids
equal ``apply_chat_template(tokenize=True)``'s. Each trained assistant turn is found as text by
rendering prefixes of the conversation, and a token is on when it overlaps such a span.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from kempnerforge.core.errors import DataError
from kempnerforge.data.chat.template import BYTE_SPECIAL_TOKENS, ChatTemplate
from kempnerforge.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Conversation:
    """Checked messages, each a dict with a 'role' and a string 'content'.

    Assistant turns before ``num_prompt_messages`` are context, not targets: a
    prompt/completion record trains on its completion only.
    """

    messages: list[dict[str, Any]]
    num_prompt_messages: int = 0
    where: str = "a conversation"
    """The file and line (or row) it came from, for error messages."""

    def key(self) -> bytes:
        """Canonical bytes of the conversation: the held-out split hashes these."""
        return json.dumps(self.messages, sort_keys=True, ensure_ascii=False).encode("utf-8")


def check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """``messages`` if it is a non-empty list of {'role', 'content'} dicts with a known role
    and string content; else DataError naming ``where`` and the message.

    Keys whose value is null are dropped, as transformers drops them: a parquet or dataset
    column of messages holds every key any message has, null where a message lacks it.
    """
    if not isinstance(messages, list) or not messages:
        shown = "an empty list" if messages == [] else type(messages).__name__
        raise DataError(f"{where}: expected a non-empty list of messages, found {shown}")
    checked = []
    for number, message in enumerate(messages):
        at = f"{where}: message {number}"
        if not isinstance(message, dict):
            raise DataError(
                f"{at} is {type(message).__name__}, not an object with role and content"
            )
        message = {key: value for key, value in message.items() if value is not None}
        role = message.get("role")
        if role not in ROLES:
            raise DataError(f"{at} has role {role!r}; expected one of {', '.join(ROLES)}")
        content = message.get("content")
        if not isinstance(content, str):
            found = "missing" if "content" not in message else type(content).__name__
            raise DataError(f"{at} ({role}): content is {found}, not a string")
        checked.append(message)
    return checked


def conversation_of(record: Any, where: str, messages_field: str = "messages") -> Conversation:
    """The conversation of one input record.

    Either ``{messages_field: [messages]}``, or ``{"prompt": ..., "completion": ...}`` where
    both are strings (a user turn and the assistant's answer) or both lists of messages (only
    the completion's assistant turns are trained). A conversation needs an assistant turn to
    train on.
    """
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, found {type(record).__name__}")
    if messages_field in record:
        conversation = Conversation(check_messages(record[messages_field], where), 0, where)
    elif "prompt" in record and "completion" in record:
        conversation = _prompt_completion(record["prompt"], record["completion"], where)
    else:
        keys = ", ".join(sorted(map(str, record))) or "none"
        raise DataError(
            f"{where}: no {messages_field!r} field and no 'prompt' and 'completion' fields "
            f"(keys: {keys}); pass --text-field to name the messages field"
        )
    trained = conversation.messages[conversation.num_prompt_messages :]
    if not any(m["role"] == "assistant" for m in trained):
        raise DataError(
            f"{where}: the conversation has no assistant message to train on; add the "
            "assistant's answer or leave the conversation out"
        )
    return conversation


def _prompt_completion(prompt: Any, completion: Any, where: str) -> Conversation:
    if isinstance(prompt, str) and isinstance(completion, str):
        messages = [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": completion},
        ]
        return Conversation(messages, 1, where)
    if isinstance(prompt, list) and isinstance(completion, list):
        prompt = check_messages(prompt, f"{where}: prompt")
        completion = check_messages(completion, f"{where}: completion")
        return Conversation(prompt + completion, len(prompt), where)
    raise DataError(
        f"{where}: 'prompt' is {type(prompt).__name__} and 'completion' "
        f"{type(completion).__name__}; expected two strings or two lists of messages"
    )


def assistant_spans(template: ChatTemplate, conversation: Conversation) -> tuple[str, list[range]]:
    """The rendered conversation and the character ranges of its trained assistant turns.

    Turn i's range is what ``render(messages[:i+1])`` adds to ``render(messages[:i],
    add_generation_prompt=True)``: its content and end-of-turn text, less trailing whitespace
    (scaffolding). Every such render must be a prefix of the next; a template that rewrites
    earlier turns (some drop the reasoning of all but the last) cannot be split this way.
    """
    messages, where = conversation.messages, conversation.where
    full = _render(template, messages, False, where)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < conversation.num_prompt_messages:
            continue
        before = _render(template, messages[:i], True, where)
        through = _render(template, messages[: i + 1], False, where)
        if not through.startswith(before) or not full.startswith(through):
            raise DataError(
                f"{where}: the chat template of {template.where} renders a conversation "
                f"differently from its first {i + 1} messages (message {i}, an assistant turn, "
                "is not an extension of what comes before it), so the assistant's tokens cannot "
                "be found; use a template whose renders of longer conversations extend shorter ones"
            )
        end = max(len(through.rstrip()), len(before))
        spans.append(range(len(before), end))
    return full, spans


def _render(
    template: ChatTemplate, messages: list[dict[str, Any]], prompt: bool, where: str
) -> str:
    try:
        return template.render(messages, add_generation_prompt=prompt)
    except DataError as exc:
        raise DataError(f"{where}: {exc}") from None


def encode_conversation(
    tokenizer: Tokenizer, template: ChatTemplate, conversation: Conversation
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of the rendered conversation and its loss mask (bool, True on every token
    that overlaps a trained assistant turn's text)."""
    return encode_conversations(tokenizer, template, [conversation])[0]


def encode_conversations(
    tokenizer: Tokenizer, template: ChatTemplate, conversations: list[Conversation]
) -> list[tuple[np.ndarray, np.ndarray]]:
    """encode_conversation of each conversation, the renders tokenized together: a
    tokenizer.json encodes a batch on all cores, where one text at a time keeps one busy."""
    rendered = [assistant_spans(template, conversation) for conversation in conversations]
    texts = [text for text, _ in rendered]
    if type(tokenizer) is HFTokenizer:
        encoded = [
            (np.asarray(ids, dtype=np.int64), np.asarray(offsets, dtype=np.int64).reshape(-1, 2))
            for ids, offsets in tokenizer.encode_batch_with_offsets(texts)
        ]
    else:
        encoded = [encode_with_offsets(tokenizer, text) for text in texts]
    pairs = []
    for (ids, offsets), (_, spans) in zip(encoded, rendered, strict=True):
        mask = np.zeros(len(ids), dtype=bool)
        starts, ends = offsets[:, 0], offsets[:, 1]
        for span in spans:
            mask |= (ends > span.start) & (starts < span.stop)
        pairs.append((ids, mask))
    return pairs


# The reply of the one-turn conversation end_of_turn_ids renders: text no template rewrites.
TURN_SENTINEL = "kempnerforge reply 7351"


def end_of_turn_ids(tokenizer: Tokenizer, template: ChatTemplate) -> set[int]:
    """The ids that end an assistant's turn, at which generation stops: the tokenizer's EOS,
    the template's eos_token when it is one special token, and the special token the
    template writes after an assistant's content (ChatML's <|im_end|>, Llama 3's <|eot_id|>).

    The last is found by rendering a user turn and a sentinel reply and reading the tokens
    after the reply, as tokenized whole: whitespace is skipped, a special token (one that
    decodes to nothing) ends the turn. Ordinary text first, or a template that refuses the
    conversation or rewrites the reply, adds nothing: such turns end with text or EOS.
    """
    stops = {tokenizer.eos_id}
    eos_text = template.variables.get("eos_token")
    if eos_text:
        ids, _ = encode_with_offsets(tokenizer, eos_text)
        if len(ids) == 1 and tokenizer.decode([int(ids[0])]) == "":
            stops.add(int(ids[0]))
    messages = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": TURN_SENTINEL},
    ]
    try:
        text = template.render(messages)
    except DataError:
        return stops
    found = text.find(TURN_SENTINEL)
    if found < 0:
        return stops
    reply_end = found + len(TURN_SENTINEL)
    ids, offsets = encode_with_offsets(tokenizer, text)
    for token, (start, end) in zip(ids.tolist(), offsets.tolist(), strict=True):
        if end <= reply_end:
            continue
        if start < reply_end:  # a token that merges the reply with what follows: text
            break
        if tokenizer.decode([token]) == "":
            stops.add(token)
            break
        if text[start:end].strip():
            break
    return stops


def encode_with_offsets(tokenizer: Tokenizer, text: str) -> tuple[np.ndarray, np.ndarray]:
    """Ids of ``text`` (no special tokens added) and each token's [start, end) characters."""
    if type(tokenizer) is HFTokenizer:
        ids, offsets = tokenizer.encode_with_offsets(text)
        return np.asarray(ids, dtype=np.int64), np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    if type(tokenizer) is ByteTokenizer:
        return _byte_ids_and_offsets(text)
    raise DataError(
        f"tokenizer {tokenizer.identity}: conversations need token offsets, which only the "
        "byte tokenizer and a tokenizer.json give; use one of those"
    )


def _byte_ids_and_offsets(text: str) -> tuple[np.ndarray, np.ndarray]:
    """The byte tokenizer's ids of a rendered conversation: its special-token texts become
    their ids, everything else its UTF-8 bytes, each byte pointing at its character."""
    ids: list[np.ndarray] = []
    offsets: list[np.ndarray] = []
    position = 0
    while position < len(text):
        found = [(text.find(s, position), s) for s in BYTE_SPECIAL_TOKENS]
        found = [(at, s) for at, s in found if at >= 0]
        at, special = min(found) if found else (len(text), "")
        piece = text[position:at]
        points = np.frombuffer(piece.encode("utf-32-le"), dtype=np.uint32)
        widths = 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000)
        chars = np.repeat(np.arange(position, at, dtype=np.int64), widths)
        ids.append(np.frombuffer(piece.encode("utf-8"), dtype=np.uint8).astype(np.int64))
        offsets.append(np.stack([chars, chars + 1], axis=1))
        if special:
            ids.append(np.array([BYTE_SPECIAL_TOKENS[special]], dtype=np.int64))
            offsets.append(np.array([[at, at + len(special)]], dtype=np.int64))
        position = at + len(special)
    if not ids:
        return np.zeros(0, dtype=np.int64), np.zeros((0, 2), dtype=np.int64)
    return np.concatenate(ids), np.concatenate(offsets)
