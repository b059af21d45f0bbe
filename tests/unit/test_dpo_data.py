"""Preference data: prepare-data --format preference writes each pair as two windows (chosen,
rejected) whose only targets are the responses, and the pair sampler hands every pair out
once per epoch, each micro-batch its pairs' chosen rows then their rejected rows in the same
order, resuming exactly from its state."""

from __future__ import annotations

import random

import pytest
import torch

from examples.chat_conversations import preference_pair
from kempnerforge.core.errors import DataError
from kempnerforge.data.chat import load_chat_template
from kempnerforge.data.dataset import MemoryMappedDataset
from kempnerforge.data.prepare import write_preference_corpus
from kempnerforge.data.sampling import PairSampler
from kempnerforge.data.tokenizer import load_tokenizer
from kempnerforge.model.heads import IGNORE_INDEX
from tests.support.chat_files import make_chat_tokenizer_dir, write_conversations

SEQ = 160


@pytest.fixture
def prepared(tmp_path):
    """A preference corpus of 20 arithmetic pairs (and the rows it came from)."""
    tokenizer_dir = make_chat_tokenizer_dir(tmp_path / "tok")
    rng = random.Random(0)
    rows = [preference_pair(rng) for _ in range(20)]
    source = write_conversations(tmp_path / "pairs.jsonl", rows)
    tokenizer = load_tokenizer(str(tokenizer_dir))
    meta = write_preference_corpus(
        [str(source)], str(tmp_path / "out"), tokenizer, load_chat_template(str(tokenizer_dir)), SEQ
    )
    dataset = MemoryMappedDataset(str(tmp_path / "out"), SEQ, document_masking=True)
    return rows, meta, dataset, tokenizer


def test_each_pair_is_two_windows_whose_targets_are_the_responses(prepared):
    rows, meta, dataset, tokenizer = prepared
    assert meta["format"] == "preference" and meta["pairs"] == 20 and len(dataset) == 40
    assert meta["pairs_cut"] == meta["pairs_dropped"] == meta["pairs_refused"] == 0
    for pair, row in enumerate(rows):
        chosen, rejected = dataset[2 * pair], dataset[2 * pair + 1]
        for window, side in ((chosen, "chosen"), (rejected, "rejected")):
            targets = window["labels"][window["labels"] != IGNORE_INDEX]
            text = tokenizer.decode(targets.tolist())
            # The targets are the response and its end-of-turn token, nothing of the prompt.
            assert text.startswith(row[side][0]["content"]), (text, row[side])
            assert row["prompt"][0]["content"] not in text
        # Both windows start with the same prompt.
        first_target = int((chosen["labels"] != IGNORE_INDEX).nonzero()[0])
        assert torch.equal(chosen["input_ids"][:first_target], rejected["input_ids"][:first_target])


def test_a_pair_longer_than_a_window_is_cut_or_dropped_and_counted(tmp_path):
    tokenizer_dir = make_chat_tokenizer_dir(tmp_path / "tok")
    long = {"prompt": "q", "chosen": "a" * 400, "rejected": "b"}
    source = write_conversations(tmp_path / "pairs.jsonl", [long, {**long, "chosen": "c"}])
    tokenizer, template = load_tokenizer(str(tokenizer_dir)), load_chat_template(str(tokenizer_dir))
    cut = write_preference_corpus([str(source)], str(tmp_path / "cut"), tokenizer, template, SEQ)
    assert (cut["pairs"], cut["pairs_cut"], cut["pairs_dropped"]) == (2, 1, 0)
    dropped = write_preference_corpus(
        [str(source)], str(tmp_path / "drop"), tokenizer, template, SEQ, long_conversations="drop"
    )
    assert (dropped["pairs"], dropped["pairs_cut"], dropped["pairs_dropped"]) == (1, 0, 1)
    with pytest.raises(DataError, match="missing rejected"):
        bad = write_conversations(tmp_path / "bad.jsonl", [{"prompt": "q", "chosen": "a"}])
        write_preference_corpus([str(bad)], str(tmp_path / "bad"), tokenizer, template, SEQ)


def _epoch(sampler: PairSampler) -> list[int]:
    return list(iter(sampler))


@pytest.mark.parametrize(("batch_size", "dp_size"), [(2, 1), (4, 2), (6, 3)])
def test_pairs_are_drawn_once_per_epoch_and_stay_in_one_micro_batch(batch_size, dp_size):
    num_pairs = 37
    samplers = [PairSampler(2 * num_pairs, batch_size, r, dp_size, seed=5) for r in range(dp_size)]
    per_batch = batch_size // 2
    seen: list[int] = []
    for sampler in samplers:
        windows = _epoch(sampler)
        assert len(windows) == sampler.samples_per_rank and len(windows) % batch_size == 0
        for start in range(0, len(windows), batch_size):
            batch = windows[start : start + batch_size]
            chosen, rejected = batch[:per_batch], batch[per_batch:]
            assert all(w % 2 == 0 for w in chosen)
            assert [w + 1 for w in chosen] == rejected  # pair i in rows i and B + i
            seen += [w // 2 for w in chosen]
        # The base class's global numbering names the same windows (fault attribution).
        assert windows == [
            sampler.global_index(0, sampler.dp_rank + p * dp_size) for p in range(len(windows))
        ]
    assert len(seen) == len(set(seen))  # no pair twice in an epoch
    assert len(seen) == num_pairs // dp_size // per_batch * per_batch * dp_size
    # The next epoch is another order of the same pairs.
    first_epoch = _epoch(PairSampler(2 * num_pairs, batch_size, 0, dp_size, seed=5))
    second = _epoch(samplers[0])
    assert samplers[0].epoch == 2 and second != first_epoch


def test_a_resumed_pair_sampler_continues_where_it_stopped():
    sampler = PairSampler(80, 4, 0, 1, seed=1)
    iterator = iter(sampler)
    first = [next(iterator) for _ in range(12)]
    state = sampler.state_dict()
    rest = list(iterator)
    resumed = PairSampler(80, 4, 0, 1, seed=1)
    resumed.load_state_dict(state)
    assert list(iter(resumed)) == rest
    assert sorted(first + rest) == list(range(80))
