"""A conversation's tokens and loss mask: the rendered conversation tokenized whole, once,
without added special tokens (so the ids equal ``apply_chat_template(tokenize=True)``'s),
and a token on when it overlaps a trained assistant turn (turns.assistant_spans).
"""

from __future__ import annotations

import numpy as np

from kempnerforge.core.errors import DataError
from kempnerforge.data.chat.conversation import Conversation
from kempnerforge.data.chat.template import BYTE_SPECIAL_TOKENS, ChatTemplate
from kempnerforge.data.chat.turns import ConversationRefused, assistant_spans
from kempnerforge.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

Encoded = tuple[np.ndarray, np.ndarray]
"""A conversation's token ids and its loss mask (bool, one per token)."""

# The reply of the one-turn conversation the end-of-turn probe renders: text no template
# rewrites.
TURN_SENTINEL = "kempnerforge reply 7351"


def encode_conversation(
    tokenizer: Tokenizer, template: ChatTemplate, conversation: Conversation
) -> Encoded:
    """Token ids of the rendered conversation and its loss mask (True on every token of a
    trained assistant turn). Raises ConversationRefused when it cannot be written."""
    encoded = encode_conversations(tokenizer, template, [conversation])[0]
    if isinstance(encoded, ConversationRefused):
        raise encoded
    return encoded


def encode_conversations(
    tokenizer: Tokenizer, template: ChatTemplate, conversations: list[Conversation]
) -> list[Encoded | ConversationRefused]:
    """encode_conversation of each conversation, or the ConversationRefused saying why it
    cannot be written. The renders are tokenized together: a tokenizer.json encodes a batch
    on all cores, where one text at a time keeps one busy."""
    end_of_turn = end_of_turn_text(tokenizer, template)
    rendered: list[tuple[str, list[range]] | ConversationRefused] = []
    for conversation in conversations:
        try:
            rendered.append(assistant_spans(template, conversation, end_of_turn))
        except ConversationRefused as exc:
            rendered.append(exc)
    texts = [r[0] for r in rendered if not isinstance(r, ConversationRefused)]
    if type(tokenizer) is HFTokenizer:
        encoded = iter(
            (np.asarray(ids, dtype=np.int64), np.asarray(offsets, dtype=np.int64).reshape(-1, 2))
            for ids, offsets in tokenizer.encode_batch_with_offsets(texts)
        )
        stripping = tokenizer.stripping_tokens()
    else:
        encoded = iter(encode_with_offsets(tokenizer, text) for text in texts)
        stripping = {}
    results: list[Encoded | ConversationRefused] = []
    for item in rendered:
        if isinstance(item, ConversationRefused):
            results.append(item)
            continue
        ids, offsets = next(encoded)
        results.append((ids, _loss_mask(item, ids, offsets, stripping)))
    return results


def _loss_mask(
    rendered: tuple[str, list[range]],
    ids: np.ndarray,
    offsets: np.ndarray,
    stripping: dict[int, tuple[int, bool, bool]],
) -> np.ndarray:
    """On for every token whose own text overlaps a span: a token that takes the whitespace
    beside it (rstrip, as Phi-3's ``<|assistant|>``) counts by its own text only, so the
    header before an answer that starts with spaces stays off."""
    text, spans = rendered
    starts, ends = offsets[:, 0], offsets[:, 1]
    if stripping:
        starts, ends = starts.copy(), ends.copy()
        for position in np.flatnonzero(np.isin(ids, list(stripping))).tolist():
            length, lstrip, rstrip = stripping[int(ids[position])]
            start, end = int(starts[position]), int(ends[position])
            if lstrip:  # its own text follows the whitespace it took
                piece = text[start:end]
                start += len(piece) - len(piece.lstrip())
            if lstrip or rstrip:
                starts[position], ends[position] = start, start + length
    mask = np.zeros(len(ids), dtype=bool)
    for span in spans:
        mask |= (ends > span.start) & (starts < span.stop)
    return mask


def end_of_turn_ids(tokenizer: Tokenizer, template: ChatTemplate) -> set[int]:
    """The ids that end an assistant's turn, at which generation stops: the tokenizer's EOS,
    the template's eos_token when it is one special token, and the special token the
    template writes after an assistant's content (ChatML's <|im_end|>, Llama 3's <|eot_id|>).
    """
    stops = {tokenizer.eos_id}
    eos_text = template.variables.get("eos_token")
    if eos_text:
        ids, _ = encode_with_offsets(tokenizer, eos_text)
        if len(ids) == 1 and tokenizer.decode([int(ids[0])]) == "":
            stops.add(int(ids[0]))
    found = _end_of_turn_token(tokenizer, template)
    if found is not None:
        stops.add(found[0])
    return stops


def end_of_turn_text(tokenizer: Tokenizer, template: ChatTemplate) -> str | None:
    """The text of the special token the template writes after an assistant's content
    (<|eot_id|>, <|im_end|>, <end_of_turn>, <|end|>, </s>, ...); None when it ends turns
    with ordinary text."""
    found = _end_of_turn_token(tokenizer, template)
    return None if found is None else found[1]


def _end_of_turn_token(tokenizer: Tokenizer, template: ChatTemplate) -> tuple[int, str] | None:
    """(id, text) of the first special token after the reply of a rendered user turn and
    sentinel reply, as tokenized whole: whitespace is skipped, a special token (one that
    decodes to nothing) ends the turn. Ordinary text first, or a template that refuses the
    conversation or rewrites the reply, gives None."""
    messages = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": TURN_SENTINEL},
    ]
    try:
        text = template.render(messages)
    except DataError:
        return None
    found = text.find(TURN_SENTINEL)
    if found < 0:
        return None
    reply_end = found + len(TURN_SENTINEL)
    ids, offsets = encode_with_offsets(tokenizer, text)
    for token, (start, end) in zip(ids.tolist(), offsets.tolist(), strict=True):
        if end <= reply_end:
            continue
        if start < reply_end:  # a token that merges the reply with what follows: text
            return None
        if tokenizer.decode([token]) == "":
            own = tokenizer.token_text(token) if isinstance(tokenizer, HFTokenizer) else None
            return token, own or text[start:end]
        if text[start:end].strip():
            return None
    return None


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
