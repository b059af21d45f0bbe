"""held_spans, the one rule for which positions a context-parallel rank holds (a slice, or
under ring attention zigzag chunks), and the vision-language model's check that its
input_ids follow it."""

from __future__ import annotations

import pytest
import torch

from kempnerforge.config.loader import load_config
from kempnerforge.model.attention.sequence_split import (
    SequenceSplit,
    held_parts,
    held_spans,
    set_sequence_split,
)
from kempnerforge.model.vision.vlm import build_vlm
from tests.support.tiny import TINY_MODEL


@pytest.mark.parametrize(
    ("prefix_len", "text_len", "size", "ring"),
    [
        (0, 32, 4, 1),
        (16, 40, 2, 1),
        (16, 16, 2, 1),
        (16, 8, 2, 1),
        (9, 7, 4, 1),
        (3, 45, 8, 1),
        (0, 32, 4, 4),
        (16, 32, 4, 2),
        (9, 7, 4, 2),
        (3, 45, 8, 2),
        (0, 48, 6, 3),
    ],
)
def test_the_ranks_hold_the_image_then_the_text_once_in_order_in_equal_parts(
    prefix_len, text_len, size, ring
) -> None:
    """Each rank holds seq_len / size positions in increasing order, its image tokens
    before its text; together the ranks hold every position once."""
    seq_len = prefix_len + text_len
    every = []
    for rank in range(size):
        image = held_parts(rank, size, seq_len, 0, prefix_len, ring)
        text = held_parts(rank, size, seq_len, prefix_len, seq_len, ring)
        mine = [i for part in image for i in range(prefix_len)[part]]
        mine += [prefix_len + i for part in text for i in range(text_len)[part]]
        assert len(mine) == seq_len // size
        assert mine == sorted(mine)
        every += mine
    assert sorted(every) == list(range(seq_len))
    if ring == 1:
        assert every == list(range(seq_len))  # contiguous slices in rank order


def test_a_ring_rank_holds_an_early_and_a_late_chunk_its_ulysses_ranks_split_in_order():
    """32 positions, 8 chunks of 4 for a ring of 4; with 8 ranks (2 Ulysses ranks per
    ring rank) each takes one of its ring rank's two chunks."""
    assert [held_spans(r, 4, 32, 4) for r in range(4)] == [
        [(0, 4), (28, 32)],
        [(4, 8), (24, 28)],
        [(8, 12), (20, 24)],
        [(12, 16), (16, 20)],
    ]
    assert [held_spans(r, 8, 32, 4) for r in range(2)] == [[(0, 4)], [(28, 32)]]
    # A ring of 2 (chunks of 8) of 4 Ulysses ranks: ring rank 0's chunks 0 and 3 in fours.
    assert [held_spans(r, 8, 32, 2) for r in range(4)] == [
        [(0, 4)],
        [(4, 8)],
        [(24, 28)],
        [(28, 32)],
    ]
    # Shares that straddle the two chunks: 3 Ulysses ranks of 4 positions over 2 chunks of 6.
    assert [held_spans(r, 6, 24, 2) for r in range(3)] == [[(0, 4)], [(4, 6), (18, 20)], [(20, 24)]]


def test_a_split_vlm_refuses_input_ids_that_are_not_its_part_of_the_caption() -> None:
    """16 image tokens + 8 text positions over 2 ranks: rank 1 holds 4 image tokens and
    the 8 text ids, so a whole 8-id caption fits it and anything else is named."""
    job = load_config(None, [*TINY_MODEL, "--vision_encoder.type=random", "--vlm.max_text_len=8"])
    model = build_vlm(job.model, job.vision_encoder, job.adapter, job.vlm)
    # The group is not read before the decoder runs: the check comes first.
    set_sequence_split(model, SequenceSplit(None, 1, 2))  # type: ignore[arg-type]
    assert model.held_image_positions(8) == [slice(12, 16)]
    with pytest.raises(ValueError, match="input_ids has 4 positions; under context parallelism"):
        model(torch.zeros(1, 3, 32, 32), torch.zeros(1, 4, dtype=torch.long))
