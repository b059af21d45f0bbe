"""Greedy decoding for samples during training and for smoke tests."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def generate_greedy(
    model: nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    max_seq_len: int,
    stop_id: int | None = None,
    forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[int]:
    """Append the argmax token max_new_tokens times; return only the new tokens.

    There is no KV cache: each step re-runs the last max_seq_len tokens, which is fine for a
    few hundred tokens on a small model. Decoding stops early after producing stop_id, which
    is not included in the result. The model runs in eval mode under no_grad, and its
    training mode is restored afterwards, also on error. One host sync per new token.
    ``forward`` maps a window of ids (1, seq) to logits (1, seq, vocab); by default
    ``model(window)``, a vision-language model passes one that also feeds its image.
    """
    if not prompt_ids:
        raise ValueError("generate_greedy needs a non-empty prompt")
    device = next(model.parameters()).device
    logits_of = forward or model
    tokens = list(prompt_ids)
    new_tokens: list[int] = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for _ in range(max_new_tokens):
                window = torch.tensor([tokens[-max_seq_len:]], dtype=torch.long, device=device)
                next_id = int(logits_of(window)[0, -1].argmax())
                if next_id == stop_id:
                    break
                tokens.append(next_id)
                new_tokens.append(next_id)
    finally:
        model.train(was_training)
    return new_tokens
