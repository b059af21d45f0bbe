"""Finding what the assistant says in a rendered conversation: the character range of each
trained assistant turn, from where the generation prompt ends through the template's own
end-of-turn text.

A turn is first found by rendering prefixes of the conversation, as a model meets it: what
``render(messages[:i+1])`` adds to ``render(messages[:i], add_generation_prompt=True)``. Some
templates make that impossible for some turns: a turn that opens the conversation has no
prompt to render, Mistral v0.3 moves the system prompt into the last user turn, Qwen3 writes
an empty reasoning block only into the last assistant turn. Such a turn is found in the
whole render instead, by what changes when its content changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kempnerforge.core.errors import DataError
from kempnerforge.data.chat.template import ChatTemplate

if TYPE_CHECKING:
    from kempnerforge.data.chat.conversation import Conversation

# The content a turn is rendered with to see where its own content stands: no template trims
# or splits it, and no real content starts or ends with it.
_PROBE_CONTENT = "\x00"


class ConversationRefused(DataError):
    """A conversation prepare-data cannot write: its chat template refuses it, or an
    assistant turn cannot be found in its render. The message names where it came from."""


def assistant_spans(
    template: ChatTemplate, conversation: Conversation, end_of_turn: str | None = None
) -> tuple[str, list[range]]:
    """The rendered conversation and the character ranges of its trained assistant turns.

    A turn's range starts where the generation prompt ends and ends after
    ``end_of_turn`` (the template's own end-of-turn text: <|eot_id|>, <|im_end|>, ...),
    so what a template writes after it (a newline, a trailing EOS) is left out; without
    ``end_of_turn`` it ends before the turn's trailing whitespace. Raises
    ConversationRefused when the template refuses the conversation or a turn cannot be
    found.
    """
    messages, where = conversation.messages, conversation.where
    try:
        full = template.render(messages)
    except DataError as exc:
        raise ConversationRefused(f"{where}: {exc}") from None
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < conversation.num_prompt_messages:
            continue
        span = _turn_after_prompt(template, messages, i, full, end_of_turn)
        if span is None:
            span = _turn_by_content(template, messages, i, full, end_of_turn, where)
        spans.append(span)
    return full, spans


def turn_end(turn: str, end_of_turn: str | None) -> int:
    """Where a turn's text ends: after its last ``end_of_turn``, else before its trailing
    whitespace."""
    found = turn.rfind(end_of_turn) if end_of_turn else -1
    return found + len(end_of_turn) if end_of_turn and found >= 0 else len(turn.rstrip())


def _turn_after_prompt(
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    i: int,
    full: str,
    end_of_turn: str | None,
) -> range | None:
    """Turn i as what it adds to the render of the messages before it with the generation
    prompt; None when that prompt render is not where the whole render begins."""
    if i == 0:
        return None  # nothing precedes it, so there is no prompt to render
    try:
        before = template.render(messages[:i], add_generation_prompt=True)
        through = template.render(messages[: i + 1])
    except DataError:
        return None  # a template may refuse a prefix it accepts within the whole
    if not (through.startswith(before) and full.startswith(before)):
        return None
    turn = through[len(before) :]
    end = turn_end(turn, end_of_turn)
    if full.startswith(turn[:end], len(before)):
        return range(len(before), len(before) + end)
    if end_of_turn is None:
        return None
    # Rendered otherwise once later messages follow (Qwen3 drops the empty reasoning block
    # of every assistant turn but the last): it ends at its end-of-turn in the whole render.
    found = full.find(end_of_turn, len(before))
    return None if found < 0 else range(len(before), found + len(end_of_turn))


def _turn_by_content(
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    i: int,
    full: str,
    end_of_turn: str | None,
    where: str,
) -> range:
    """Turn i found in the whole render: the text that changes when its content is
    replaced is the content as the template writes it, and the turn ends after the
    end-of-turn that follows it."""
    message = messages[i]
    unseen = (
        f"{where}: message {i}, an assistant turn, cannot be found in the render of the chat "
        f"template of {template.where}: the messages before it render differently on their "
        "own (or it opens the conversation)"
    )
    if "content" not in message:
        raise ConversationRefused(f"{unseen}, and it has no content to find it by")
    probe = [*messages[:i], {**message, "content": _PROBE_CONTENT}, *messages[i + 1 :]]
    try:
        other = template.render(probe)
    except DataError as exc:
        raise ConversationRefused(f"{unseen}, and with its content changed {exc}") from None
    if other == full:
        raise ConversationRefused(f"{unseen}, and the template does not write its content")
    start = _common_prefix_len(full, other)
    stop = len(full) - _common_suffix_len(full, other, min(len(full), len(other)) - start)
    found = full.find(end_of_turn, stop) if end_of_turn else -1
    if end_of_turn and found >= 0:
        stop = found + len(end_of_turn)
    return range(start, stop)


def _common_prefix_len(first: str, second: str) -> int:
    """The length of the longest common prefix (by bisection, comparisons done in C)."""
    low, high = 0, min(len(first), len(second))
    while low < high:
        middle = (low + high + 1) // 2
        if first[:middle] == second[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _common_suffix_len(first: str, second: str, limit: int) -> int:
    """The length of the longest common suffix, at most ``limit``."""
    low, high = 0, max(limit, 0)
    while low < high:
        middle = (low + high + 1) // 2
        if first[len(first) - middle :] == second[len(second) - middle :]:
            low = middle
        else:
            high = middle - 1
    return low
