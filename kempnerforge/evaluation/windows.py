"""Scoring requests packed into full model windows.

A request is a token sequence whose tail is scored: the model reads ``tokens[:-1]`` and
the log-likelihood of each token from ``first_scored`` on is summed into the request's
slot. Requests are packed in order into rows of ``seq_len`` positions, each its own
document (document masking: no request attends to another), so a row costs one forward
whatever the requests' lengths, and the windows depend only on the requests and
``seq_len``: the same in every layout and at every batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kempnerforge.data.dataset import IGNORE_INDEX


@dataclass(frozen=True)
class Request:
    """Tokens to read and the position of the first one scored (at least 1: a scored token
    needs a token before it). ``slot`` is where its log-likelihood is summed."""

    tokens: list[int]
    first_scored: int
    slot: int


@dataclass
class Windows:
    """Rows of packed requests: input_ids, labels (IGNORE_INDEX where nothing is scored),
    doc_ids (one per request in a row, the padding its own) and slots (-1 where nothing is
    scored), each (rows, seq_len), int64; ``truncated`` requests lost tokens at the left."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    doc_ids: torch.Tensor
    slots: torch.Tensor
    truncated: int

    @property
    def rows(self) -> int:
        return self.input_ids.size(0)

    @classmethod
    def empty(cls) -> Windows:
        """No rows: a task's windows before its requests are packed."""
        none = torch.empty(0, 0, dtype=torch.long)
        return cls(none, none, none, none, truncated=0)


def fit_to_window(request: Request, seq_len: int) -> tuple[Request, bool]:
    """The request cut from the left to seq_len + 1 tokens (seq_len positions), and whether
    it was cut. Context goes first; a scored part longer than the window loses its head too."""
    extra = len(request.tokens) - 1 - seq_len
    if extra <= 0:
        return request, False
    first = max(1, request.first_scored - extra)
    return Request(request.tokens[extra:], first, request.slot), True


def pack_requests(
    requests: list[Request], seq_len: int, pad_id: int, packed: bool = True
) -> Windows:
    """Requests in order into rows of seq_len positions: a request goes into the current row
    when it fits there, else it starts a new one. ``packed`` False gives each request a row
    of its own (for a model that takes no document ids: a request at the start of its row
    sees only itself, the padding after it being later positions)."""
    rows: list[list[tuple[Request, int]]] = []  # (request, its start position)
    used = seq_len  # forces a first row
    truncated = 0
    for request in requests:
        request, cut = fit_to_window(request, seq_len)
        truncated += cut
        positions = len(request.tokens) - 1
        if used + positions > seq_len or (not packed and used):
            rows.append([])
            used = 0
        rows[-1].append((request, used))
        used += positions
    shape = (len(rows), seq_len)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    doc_ids = torch.zeros(shape, dtype=torch.long)
    slots = torch.full(shape, -1, dtype=torch.long)
    for r, row in enumerate(rows):
        end = 0
        for doc, (request, start) in enumerate(row):
            tokens = torch.tensor(request.tokens, dtype=torch.long)
            end = start + tokens.numel() - 1
            input_ids[r, start:end] = tokens[:-1]
            doc_ids[r, start:end] = doc
            scored = slice(start + request.first_scored - 1, end)
            labels[r, scored] = tokens[request.first_scored :]
            slots[r, scored] = request.slot
        doc_ids[r, end:] = len(row)  # the padding: a document of its own
    return Windows(input_ids, labels, doc_ids, slots, truncated)


def rolling_requests(tokens: list[int], seq_len: int, slot: int) -> list[Request]:
    """A document's tokens (its start token first) as requests that score every token
    after the first exactly once: the first window scores up to seq_len of them, each later
    one the next seq_len // 2 with the seq_len - seq_len // 2 tokens before them as context."""
    requests = [Request(tokens[: seq_len + 1], 1, slot)]
    scored_to = min(seq_len + 1, len(tokens))
    stride = max(1, seq_len // 2)
    while scored_to < len(tokens):
        end = min(scored_to + stride, len(tokens))
        start = max(0, end - seq_len - 1)
        requests.append(Request(tokens[start:end], scored_to - start, slot))
        scored_to = end
    return requests
