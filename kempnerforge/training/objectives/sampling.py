"""Sampling completions through the training forward with a key/value cache (GRPO's
rollouts, and the held-out accuracy of bench/grpo_accuracy.py).

Rows decode in batches of decoding.rows_per_forward, each with a cache of its own
(model/attention/decode_cache.py): the prompts run through the forward once, then each
step runs one new token per row, padded to decoding.length_multiple positions (the
tensor-parallel degree: sequence parallelism splits the positions evenly). Under a sharded
layout every forward is collective, so every rank runs the same number of them: one
all-reduce a step says whether any row of any rank is still open.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from kempnerforge.model.attention import DecodeCache, DecodeStep
from kempnerforge.model.generation import sample_token, seeded_generator

Logits = Callable[..., torch.Tensor]
"""The training forward: token ids (rows, length) -> logits (rows, length, vocab); with
``decode=`` a DecodeStep, the step's new tokens through its key/value cache."""


@dataclass(frozen=True)
class Decoding:
    """How completions are drawn: grpo's sampling fields and where a completion stops."""

    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    stop_ids: frozenset[int]
    pad_id: int
    width: int
    """Positions a row may fill: train.seq_len (prompt and completion together)."""
    rows_per_forward: int
    """Rows per forward call (train.batch_size)."""
    length_multiple: int = 1
    """Forwards run windows of a multiple of this many positions (the tensor-parallel
    degree: sequence parallelism splits the positions evenly)."""


def any_rank(open_rows: bool, group: dist.ProcessGroup | None) -> bool:
    """Whether any rank of ``group`` (None: this process alone) still has an open row."""
    if group is None:
        return open_rows
    flag = torch.tensor([int(open_rows)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


@torch.no_grad()
def decode_completions(
    logits_of: Logits,
    prompts: list[list[int]],
    seeds: list[int],
    decoding: Decoding,
    device: torch.device,
    group: dist.ProcessGroup | None,
) -> list[list[int]]:
    """Each prompt's sampled completion: tokens drawn one at a time from the logits of its
    last position, until a stop token (kept, as the completion's last target), the
    completion's max_new_tokens, or the window's end. The rows go through the forward
    decoding.rows_per_forward at a time, each such batch with a key/value cache of its
    own. Every rank calls the forward the same number of times (``group``: the ranks
    whose forwards are collective together). Compiled blocks run eagerly here: each
    decoding step's shapes and cache positions differ."""
    completions: list[list[int]] = []
    size = decoding.rows_per_forward
    with torch.compiler.set_stance("force_eager"):
        for first in range(0, len(prompts), size):
            rows = slice(first, first + size)
            completions += _decode_rows(
                logits_of, prompts[rows], seeds[rows], decoding, device, group
            )
    return completions


def _decode_rows(
    logits_of: Logits,
    prompts: list[list[int]],
    seeds: list[int],
    decoding: Decoding,
    device: torch.device,
    group: dist.ProcessGroup | None,
) -> list[list[int]]:
    """The completions of one forward's rows: every prompt through the cache at once,
    then one token per row and forward until every row of every rank has stopped."""
    rows, width = len(prompts), decoding.width
    lengths = [len(prompt) for prompt in prompts]
    prefill = decoding_span(max(lengths), decoding)
    ids = torch.full((rows, prefill), decoding.pad_id, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = torch.tensor(prompt[:prefill])
    # Slots past the window take the padding's keys (decode_cache.py): no real query reads them.
    cache = DecodeCache(rows, width + decoding.length_multiple)
    logits = _logits(logits_of, ids, DecodeStep.prefill(cache, prefill, device), device)
    last = logits[torch.arange(rows), torch.tensor(lengths).clamp(max=prefill) - 1]
    completions: list[list[int]] = [[] for _ in prompts]
    open_rows = [length < width for length in lengths]
    generators = [seeded_generator(seed) for seed in seeds]
    for drawn in range(decoding.max_new_tokens):
        for row in range(rows):
            if not open_rows[row]:
                continue
            token = sample_token(
                last[row],
                temperature=decoding.temperature,
                top_k=decoding.top_k,
                top_p=decoding.top_p,
                generator=generators[row],
            )
            completions[row].append(token)
            lengths[row] += 1
            open_rows[row] = not (
                token in decoding.stop_ids
                or len(completions[row]) >= decoding.max_new_tokens
                or lengths[row] >= width
            )
        if drawn + 1 == decoding.max_new_tokens or not any_rank(any(open_rows), group):
            break
        ids, step = _next_tokens(cache, completions, lengths, open_rows, decoding, device)
        last = _logits(logits_of, ids, step, device)[:, 0]
    return completions


def _next_tokens(
    cache: DecodeCache,
    completions: list[list[int]],
    lengths: list[int],
    open_rows: list[bool],
    decoding: Decoding,
    device: torch.device,
) -> tuple[torch.Tensor, DecodeStep]:
    """The next forward's tokens (rows, length_multiple) and its DecodeStep: each open
    row's last sampled token at its position, then padding; a stopped row is padding
    only. The padding goes to the slots past the window."""
    rows, new, width = len(lengths), decoding.length_multiple, decoding.width
    ids = torch.full((rows, new), decoding.pad_id, dtype=torch.long)
    positions = torch.zeros((rows, new), dtype=torch.long)
    slots = torch.arange(width, width + new).repeat(rows, 1)
    for row in range(rows):
        if open_rows[row]:
            ids[row, 0] = completions[row][-1]
            positions[row] = lengths[row] - 1
            slots[row, 0] = lengths[row] - 1
    read = 1 + max((lengths[row] - 1 for row in range(rows) if open_rows[row]), default=0)
    step = DecodeStep(cache, positions.to(device), slots.to(device), read)
    return ids, step


def _logits(
    logits_of: Logits, ids: torch.Tensor, step: DecodeStep, device: torch.device
) -> torch.Tensor:
    """The forward's logits (rows, new, vocab) of a decoding step, whole on this rank."""
    logits = logits_of(ids.to(device), decode=step)
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


def decoding_span(longest: int, decoding: Decoding) -> int:
    """The positions a decoding step's forward runs: the longest row, rounded up to the
    length multiple, at most the window."""
    multiple = decoding.length_multiple
    return min(decoding.width, -(-longest // multiple) * multiple)
