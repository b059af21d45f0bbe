"""Packing conversations into whole training windows: no conversation crosses a window
boundary, and the rest of a window is padding that no loss reads and no attention crosses.

Training reads window ``i`` as tokens ``[i * N, i * N + N + 1)`` of the stream (N =
train.seq_len): N input positions, the last of which is labelled by the next window's first
token. A packed corpus is a stream of whole windows of N tokens, each holding whole
conversations and then pad tokens, plus one pad token at its very end, so that the last
window has its (N+1)-th token too. Every window's last token ends a document (a
conversation's last token or a pad run's), so its label, the next window's first token, is
never supervised (token_flags.masked_targets ignores every label across a document end).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kempnerforge.data.tokens import TokenFileWriter, is_masked

MAX_OPEN_WINDOWS = 8
"""Windows kept open for first-fit packing. A conversation that does not fit the window being
filled usually fits one of a few others, so a few open windows fill nearly as well as a full
bin-packing pass, while the output stays a function of the input order alone (streamed, no
sort of the corpus) and memory stays at a few windows."""

LONG_CONVERSATIONS = ("cut", "drop")
"""What packing does with a conversation longer than a window: keep its first N tokens, or
leave it out."""


@dataclass(frozen=True)
class Packing:
    """How conversations are packed: the window length, the long-conversation rule, and
    whether this output ends the corpus's stream (the unsharded output, or the last shard),
    which then gets the one trailing pad token the last window reads."""

    seq_len: int
    long_conversations: str = "cut"
    ends_stream: bool = True

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise ValueError(f"packing seq_len must be >= 1, got {self.seq_len}")
        if self.long_conversations not in LONG_CONVERSATIONS:
            raise ValueError(
                f"long_conversations {self.long_conversations!r}: expected one of "
                f"{', '.join(LONG_CONVERSATIONS)}"
            )


@dataclass(eq=False)  # windows are told apart by identity (list.remove), not contents
class _Window:
    documents: list[tuple[np.ndarray, np.ndarray]]
    used: int


class ConversationPacker:
    """Packs (tokens, loss mask) conversations into windows of ``packing.seq_len`` tokens
    written to ``writer``.

    First fit over at most MAX_OPEN_WINDOWS open windows, oldest first; a window that is
    full is written at once; when none fits and all are open, the fullest (the oldest among
    equals) is padded and written. The output depends only on the order of the input.
    """

    def __init__(self, writer: TokenFileWriter, packing: Packing) -> None:
        self.writer = writer
        self.packing = packing
        self.seq_len = packing.seq_len
        self._open: list[_Window] = []
        self.pad_tokens = 0
        self.conversations_cut = 0
        self.conversations_dropped = 0

    def add_document(self, tokens: np.ndarray, loss_mask: np.ndarray) -> None:
        """Place one conversation in a window (cut or dropped first when it is too long)."""
        if len(tokens) > self.seq_len:
            if self.packing.long_conversations == "drop":
                self.conversations_dropped += 1
                return
            tokens, loss_mask = tokens[: self.seq_len], loss_mask[: self.seq_len]
            # A conversation's first token is never a label (what precedes it ends another
            # document), so the cut must keep a later assistant token.
            if not loss_mask[1:].any():
                self.conversations_dropped += 1
                return
            self.conversations_cut += 1
        window = next((w for w in self._open if w.used + len(tokens) <= self.seq_len), None)
        if window is None:
            if len(self._open) == MAX_OPEN_WINDOWS:
                fullest = max(self._open, key=lambda w: w.used)  # max keeps the first of equals
                self._write(fullest)
            window = _Window([], 0)
            self._open.append(window)
        window.documents.append((tokens, loss_mask))
        window.used += len(tokens)
        if window.used == self.seq_len:
            self._write(window)

    def _write(self, window: _Window) -> None:
        self._open.remove(window)
        for tokens, loss_mask in window.documents:
            self.writer.add_document(tokens, loss_mask)
        if window.used < self.seq_len:
            self._pad(self.seq_len - window.used)

    def _pad(self, num_tokens: int) -> None:
        self.writer.add_padding(num_tokens)
        self.pad_tokens += num_tokens

    def finish(self) -> dict[str, Any]:
        """Write the open windows (oldest first) and, when this output ends the stream, the
        trailing pad token; returns the packing's meta.json fields."""
        while self._open:
            self._write(self._open[0])
        if self.packing.ends_stream:
            self._pad(1)
        return {
            "packed_seq_len": self.seq_len,
            "pad_tokens": self.pad_tokens,
            "conversations_cut": self.conversations_cut,
            "conversations_dropped": self.conversations_dropped,
        }


def packing_mismatch(path: str, meta: dict[str, Any], seq_len: int) -> str | None:
    """Why a loss-masked corpus's windows of ``seq_len`` would cut conversations, or None.

    A corpus packed for a length that ``seq_len`` is a multiple of is fine: each training
    window then holds whole packed windows. A corpus packed for another length, or an
    unpacked one holding conversations longer than ``seq_len``, trains some conversations in
    two pieces, the second without its beginning.
    """
    if not is_masked(meta):
        return None
    packed = meta.get("packed_seq_len")
    remedy = f"prepare it again with prepare-data --format chat --seq-len {seq_len}"
    if packed is not None:
        if seq_len % packed == 0:
            return None
        return (
            f"{path}: conversations were packed into windows of {packed} tokens, but "
            f"train.seq_len is {seq_len}, so conversations straddle training windows and "
            f"their second part is trained without its beginning; {remedy}"
        )
    longest = meta.get("max_document_tokens")
    if longest is None or longest <= seq_len:
        return None
    return (
        f"{path}: conversations are not packed into windows and the longest is {longest} "
        f"tokens, more than train.seq_len {seq_len}, so conversations straddle training "
        f"windows and their second part is trained without its beginning; {remedy}"
    )
