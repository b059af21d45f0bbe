"""Conversations for supervised fine-tuning: their records (messages, or prompt and
completion) and the checks that name where a bad one came from."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kempnerforge.core.errors import DataError

ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Conversation:
    """Checked messages, each a dict with a 'role' and a string 'content' (which an
    assistant turn that calls tools may leave out).

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
    and string content; else DataError naming ``where`` and the message. An assistant
    message with 'tool_calls' may have no content, as tool calls often come.

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
        calls_tools = role == "assistant" and "tool_calls" in message
        if not isinstance(content, str) and not (calls_tools and "content" not in message):
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
