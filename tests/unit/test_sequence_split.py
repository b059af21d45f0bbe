"""held_span, the one rule for which positions a context-parallel rank holds, and the
vision-language model's check that its input_ids follow it."""

from __future__ import annotations

import pytest
import torch

from kempnerforge.config.loader import load_config
from kempnerforge.model.attention.sequence_split import SequenceSplit, held_span, set_sequence_split
from kempnerforge.model.vision.vlm import build_vlm
from tests.support.tiny import TINY_MODEL


@pytest.mark.parametrize(
    ("prefix_len", "text_len", "size"),
    [(0, 32, 4), (16, 40, 2), (16, 16, 2), (16, 8, 2), (9, 7, 4), (3, 45, 8)],
)
def test_the_ranks_hold_the_image_then_the_text_once_in_order_in_equal_parts(
    prefix_len, text_len, size
) -> None:
    seq_len = prefix_len + text_len
    every = []
    for rank in range(size):
        image = held_span(rank, size, seq_len, 0, prefix_len)
        text = held_span(rank, size, seq_len, prefix_len, seq_len)
        mine = [*range(prefix_len)[image], *(prefix_len + i for i in range(text_len)[text])]
        assert len(mine) == seq_len // size
        every += mine
    assert every == list(range(seq_len))


def test_a_split_vlm_refuses_input_ids_that_are_not_its_part_of_the_caption() -> None:
    """16 image tokens + 8 text positions over 2 ranks: rank 1 holds 4 image tokens and
    the 8 text ids, so a whole 8-id caption fits it and anything else is named."""
    job = load_config(None, [*TINY_MODEL, "--vision_encoder.type=random", "--vlm.max_text_len=8"])
    model = build_vlm(job.model, job.vision_encoder, job.adapter, job.vlm)
    # The group is not read before the decoder runs: the check comes first.
    set_sequence_split(model, SequenceSplit(None, 1, 2))  # type: ignore[arg-type]
    assert model.held_image_positions(8) == slice(12, 16)
    with pytest.raises(ValueError, match="input_ids has 4 positions; under context parallelism"):
        model(torch.zeros(1, 3, 32, 32), torch.zeros(1, 4, dtype=torch.long))
