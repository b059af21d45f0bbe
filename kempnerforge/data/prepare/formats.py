"""prepare-data's input formats: what ``--format NAME`` reads, the options that only it takes,
and its clause of the summary line. The command's choices, its refusals of another format's
options and its summary all come from INPUT_FORMATS, so a new format is a row here beside
its reader (a module of this wing) and its rendering (a wing of its own, as data/chat/ is)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kempnerforge.core.errors import DataError


@dataclass(frozen=True)
class InputFormat:
    """One ``--format`` value."""

    name: str
    about: str
    """What each input document is, for --format's help."""
    default_field: str
    """The jsonl field / column read when --text-field is not given."""
    own_options: dict[str, str] = field(default_factory=dict)
    """Options (their argparse dest) that go with this format only -> what each is about."""
    summary: Callable[[dict[str, Any]], str] = lambda meta: ""
    """The clause this format adds to the summary line, from the written meta.json."""


def _chat_summary(meta: dict[str, Any]) -> str:
    return (
        f" ({meta['assistant_tokens']:,} assistant tokens; the longest conversation "
        f"{meta['max_document_tokens']:,} tokens; packed into windows of "
        f"{meta['packed_seq_len']:,} with {meta['pad_tokens']:,} pad tokens, "
        f"{meta['conversations_cut']:,} conversations cut and "
        f"{meta['conversations_dropped']:,} dropped as longer; "
        f"{meta['conversations_refused']:,} refused by the chat template and skipped)"
    )


TEXT = InputFormat(
    "text",
    "each input document is text",
    default_field="text",
    own_options={
        "text_suffix": "whole-file text documents",
        "skip_non_utf8": "whole-file text documents",
    },
)
CHAT = InputFormat(
    "chat",
    "each is a conversation (messages, or prompt and completion) rendered with the "
    "tokenizer's chat template, with a loss mask on the assistant's tokens",
    default_field="messages",
    own_options={
        "seq_len": "packing conversations into windows",
        "long_conversations": "packing conversations into windows",
        "stop_on_refused": "conversations the chat template refuses",
    },
    summary=_chat_summary,
)


def _preference_summary(meta: dict[str, Any]) -> str:
    return (
        f" ({meta['pairs']:,} pairs, one window of {meta['packed_seq_len']:,} tokens per "
        f"response with {meta['pad_tokens']:,} pad tokens; {meta['pairs_cut']:,} pairs cut and "
        f"{meta['pairs_dropped']:,} dropped as longer; {meta['pairs_refused']:,} refused by "
        "the chat template and skipped)"
    )


PREFERENCE = InputFormat(
    "preference",
    "each is a preference pair (prompt, chosen, rejected: strings or lists of messages), each "
    "response rendered after the prompt with the chat template into a window of its own, a "
    "loss mask on the response",
    default_field="prompt",
    own_options={
        "seq_len": "packing conversations into windows",
        "long_conversations": "packing conversations into windows",
        "stop_on_refused": "conversations the chat template refuses",
    },
    summary=_preference_summary,
)


def _prompts_summary(meta: dict[str, Any]) -> str:
    return (
        f" ({meta['prompts']:,} prompts, one window of {meta['packed_seq_len']:,} tokens each "
        f"with {meta['pad_tokens']:,} pad tokens; {meta['prompts_dropped']:,} dropped as "
        f"longer; {meta['prompts_refused']:,} refused by the chat template and skipped)"
    )


PROMPTS = InputFormat(
    "prompts",
    "each is a prompt (a string or a list of messages) and the reference answer a reward "
    "checks, the prompt rendered with the chat template and the assistant's turn opened, "
    "then the answer as the only targets, in a window of its own",
    default_field="prompt",
    own_options={
        "seq_len": "packing conversations into windows",
        "long_conversations": "packing conversations into windows",
        "stop_on_refused": "conversations the chat template refuses",
    },
    summary=_prompts_summary,
)
INPUT_FORMATS = {f.name: f for f in (TEXT, CHAT, PREFERENCE, PROMPTS)}
"""Every --format value, the default first."""


def check_format_options(name: str, given: dict[str, Any]) -> InputFormat:
    """The format called ``name``, after refusing an option another format owns that is set
    in ``given`` (argparse dest -> value) with a DataError naming both."""
    chosen = INPUT_FORMATS[name]
    for other in INPUT_FORMATS.values():
        if other is chosen:
            continue
        for dest, about in other.own_options.items():
            if given.get(dest) and dest not in chosen.own_options:
                option = "--" + dest.replace("_", "-")
                raise DataError(
                    f"{option} is about {about}; it goes only with --format {other.name} "
                    f"(leave {option} out for --format {name})"
                )
    return chosen
