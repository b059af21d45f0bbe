"""MemoryMappedDataset over a loss-masked corpus: labels only where the mask is on, document
ends from the flags (not from EOS), and unmasked corpora read exactly as before."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from kempnerforge.data.dataset import IGNORE_INDEX, MemoryMappedDataset
from kempnerforge.data.sampling.mixture import MixtureDataset
from kempnerforge.data.tokens.token_flags import ENDS_DOCUMENT, LOSS_ON, masked_targets
from tests.support.chat_files import turns, write_masked_dir
from tests.support.data_files import write_token_dir

EOS = 257  # ByteTokenizer's; here an end of turn inside a conversation
X = IGNORE_INDEX
CHATS = [
    turns(([1, 2], False), ([3, 4, EOS], True)),
    turns(([5], False), ([6, EOS], True), ([7, 8], False), ([9], True)),
]
# tokens: 1 2 3 4 EOS | 5 6 EOS 7 8 9   (| a document end from the flags)


def test_labels_are_ignored_exactly_where_the_mask_is_off(tmp_path):
    path = write_masked_dir(tmp_path / "chat", CHATS)
    sample = MemoryMappedDataset(path, seq_len=10)[0]
    assert sample["input_ids"].tolist() == [1, 2, 3, 4, EOS, 5, 6, EOS, 7, 8]
    # The label after the document's last token (EOS, then 5) opens another document.
    assert sample["labels"].tolist() == [X, 3, 4, EOS, X, 6, EOS, X, X, 9]


def test_document_ids_come_from_the_flags_even_with_eos_inside_a_document(tmp_path):
    path = write_masked_dir(tmp_path / "chat", CHATS)
    sample = MemoryMappedDataset(path, seq_len=10)[0]
    # The EOS at position 7 ends a turn, not the conversation: one document to the end.
    assert sample["doc_ids"].tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1]


def test_without_document_masking_a_label_still_never_crosses_a_document_end(tmp_path):
    path = write_masked_dir(tmp_path / "chat", [turns(([1], True), ([2, 3], True))] * 3)
    sample = MemoryMappedDataset(path, seq_len=8, document_masking=False)[0]
    assert sample["doc_ids"].tolist() == [0] * 8
    # tokens 1 2 3 | 1 2 3 | 1 2 3: the first token of each conversation is a target, but
    # not predicted from the one before.
    assert sample["labels"].tolist() == [2, 3, X, 2, 3, X, 2, 3]


def test_masked_targets_follow_the_flag_bits():
    window = np.arange(10, 16, dtype=np.int64)
    flags = np.array([0, LOSS_ON, LOSS_ON | ENDS_DOCUMENT, LOSS_ON, 0, LOSS_ON], dtype=np.int64)
    labels, doc_ids = masked_targets(window, flags, document_masking=True)
    assert labels.tolist() == [11, 12, X, X, 15]
    assert doc_ids.tolist() == [0, 0, 0, 1, 1]


def test_every_supervised_label_is_a_mask_on_token_once(tmp_path):
    """Over every window, the labels that count are the mask-on tokens after the first, none
    of which starts a document here: assistant_tokens of them."""
    chats = [turns(([1, 2, 3], False), ([4, 5, EOS], True), ([6], False))] * 7
    path = write_masked_dir(tmp_path / "chat", chats)  # 49 tokens: 6 windows of 8, + 1
    ds = MemoryMappedDataset(path, seq_len=8)
    supervised = sum(int((ds[i]["labels"] != X).sum()) for i in range(len(ds)))
    assert supervised == ds.meta["assistant_tokens"] == 21


# Batches of this unmasked corpus as the reader gave them before masked corpora existed.
_UNMASKED_SHA256 = {
    True: "4bef3611dcebc92ff9cc51cdfa83b7c141c909b2f8c939220453eea87255a5b2",
    False: "a14461e22dc1dea919dd03bf1836e22a9b4e3a3d7b7a700ac5e42ad86ac7fd26",
}


@pytest.mark.parametrize("document_masking", [True, False])
def test_an_unmasked_corpus_reads_byte_identically_to_before(tmp_path, document_masking):
    rng = np.random.default_rng(7)
    docs = [rng.integers(0, 257, size=int(rng.integers(1, 40))).tolist() for _ in range(60)]
    ds = MemoryMappedDataset(write_token_dir(tmp_path / "c", docs), 16, document_masking)
    assert len(ds) == 79
    digest = hashlib.sha256()
    for i in range(len(ds)):
        for key in ("input_ids", "labels", "doc_ids"):
            digest.update(ds[i][key].numpy().tobytes())
    assert digest.hexdigest() == _UNMASKED_SHA256[document_masking]


def test_a_mixture_gives_each_source_its_own_labels(tmp_path):
    chat = MemoryMappedDataset(write_masked_dir(tmp_path / "chat", CHATS), seq_len=10)
    text = MemoryMappedDataset(
        write_token_dir(tmp_path / "text", [[1, 2], [3, 4, 5, 6, 7, 8, 9]]), seq_len=10
    )
    mixture = MixtureDataset([chat, text], ["chat", "text"])
    batch = mixture.__getitems__([1, 0])
    assert batch[0]["dataset_idx"].item() == 1
    # The text source: every label counts but the one after its EOS.
    assert batch[0]["labels"].tolist() == [2, EOS, X, 4, 5, 6, 7, 8, 9, EOS]
    assert batch[0]["doc_ids"].tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]
    assert batch[1]["labels"].tolist() == chat[0]["labels"].tolist()
    assert batch[1]["doc_ids"].tolist() == chat[0]["doc_ids"].tolist()
    assert all(value.dtype == torch.int64 for sample in batch for value in sample.values())


def test_a_recorded_bad_window_reads_its_stand_in_with_the_stand_ins_mask(tmp_path):
    """A bad-window record on a chat corpus substitutes the whole sample: ids, labels and
    document ids of the next good window, every other window unchanged."""
    path = write_masked_dir(tmp_path / "chat", CHATS * 4)
    clean = MemoryMappedDataset(path, seq_len=4)
    skipping = MemoryMappedDataset(path, seq_len=4)
    skipping.skip_windows = frozenset({2})
    for key in ("input_ids", "labels", "doc_ids"):
        assert torch.equal(skipping[2][key], clean[3][key])
        for window in (0, 1, 3, len(clean) - 1):
            assert torch.equal(skipping[window][key], clean[window][key])
