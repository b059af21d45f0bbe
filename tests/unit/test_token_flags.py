"""Writing a loss-masked corpus: token_flags.bin beside tokens.bin, published before
meta.json, on disk, in shards and in a store alike."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kempnerforge.core.errors import DataError
from kempnerforge.data.dataset import MemoryMappedDataset
from kempnerforge.data.tokenizer import ByteTokenizer
from kempnerforge.data.tokens.shards import read_parts, shard_name
from kempnerforge.data.tokens.token_file import TokenFileWriter, is_complete, read_meta
from kempnerforge.data.tokens.token_flags import ENDS_DOCUMENT, FLAGS_FILE, LOSS_ON
from kempnerforge.storage.files import names_in
from tests.support.chat_files import turns, write_masked_dir
from tests.support.data_files import write_token_dir

EOS = 257  # ByteTokenizer's; a chat template's end of turn, inside a document
CHATS = [
    turns(([1, 2], False), ([3, 4, EOS], True)),
    turns(([5], False), ([6, EOS], True), ([7, 8], False), ([9], True)),
]


def test_a_masked_corpus_round_trips_its_tokens_mask_and_document_ends(tmp_path):
    path = write_masked_dir(tmp_path / "chat", CHATS)
    tokens = np.fromfile(tmp_path / "chat" / "tokens.bin", dtype="<u2")
    flags = np.fromfile(tmp_path / "chat" / FLAGS_FILE, dtype=np.uint8)
    # No EOS separator is added: the documents are exactly their ids.
    assert tokens.tolist() == [1, 2, 3, 4, EOS, 5, 6, EOS, 7, 8, 9]
    assert ((flags & LOSS_ON) != 0).tolist() == [i for _, mask in CHATS for i in mask]
    assert np.flatnonzero(flags & ENDS_DOCUMENT).tolist() == [4, 10]
    meta = read_meta(path)
    assert meta["loss_mask"] is True and meta["format"] == "chat"
    assert meta["assistant_tokens"] == 6 and meta["max_document_tokens"] == 6
    assert meta["num_documents"] == 2 and meta["num_tokens"] == 11
    assert len(meta["token_flags_sha256"]) == 64


def test_a_bos_per_document_is_never_a_target(tmp_path):
    path = write_masked_dir(tmp_path / "chat", CHATS[:1], bos_per_document=True)
    flags = np.fromfile(tmp_path / "chat" / FLAGS_FILE, dtype=np.uint8)
    assert flags.tolist() == [0, 0, 0, LOSS_ON, LOSS_ON, LOSS_ON | ENDS_DOCUMENT]
    assert read_meta(path)["max_document_tokens"] == 6


@pytest.mark.parametrize("masked_first", [True, False])
def test_a_writer_takes_a_mask_with_every_document_or_with_none(tmp_path, masked_first):
    ids, mask = np.array([1, 2]), np.array([False, True])
    with pytest.raises(ValueError, match="loss-masked in every document or in none"):  # noqa: SIM117
        with TokenFileWriter(str(tmp_path / "c"), ByteTokenizer()) as writer:
            writer.add_document(ids, mask if masked_first else None)
            writer.add_document(ids, None if masked_first else mask)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == []  # nothing left behind


def test_a_mask_that_is_not_a_bool_per_token_is_refused(tmp_path):
    with TokenFileWriter(str(tmp_path / "c"), ByteTokenizer()) as writer:
        with pytest.raises(ValueError, match=r"document 0: loss_mask is int64 of shape \(2,\)"):
            writer.add_document(np.array([1, 2]), np.array([0, 1]))
        with pytest.raises(ValueError, match=r"expected bool of shape \(2,\)"):
            writer.add_document(np.array([1, 2]), np.array([True]))
        writer.abort()


def test_a_corpus_without_meta_json_is_incomplete_and_an_unmasked_rewrite_drops_the_flags(
    tmp_path,
):
    path = write_masked_dir(tmp_path / "chat", CHATS)
    assert is_complete(path)
    (tmp_path / "chat" / "meta.json").unlink()
    assert not is_complete(path)
    # Rewritten as an unmasked corpus, the old flags must not stay beside the new tokens.
    write_masked_dir(path, CHATS)
    write_token_dir(tmp_path / "chat", [[1, 2, 3]])
    assert sorted(p.name for p in (tmp_path / "chat").iterdir()) == ["meta.json", "tokens.bin"]
    assert read_meta(path)["loss_mask"] is False


def test_a_writer_that_fails_leaves_the_previous_corpus_untouched(tmp_path):
    path = write_masked_dir(tmp_path / "chat", CHATS)
    before = {p.name: p.read_bytes() for p in (tmp_path / "chat").iterdir()}
    with pytest.raises(RuntimeError), TokenFileWriter(path, ByteTokenizer()) as writer:
        writer.add_document(np.array([9, 9]), np.array([True, True]))
        raise RuntimeError("interrupted")
    assert {p.name: p.read_bytes() for p in (tmp_path / "chat").iterdir()} == before


def test_a_truncated_flags_file_is_named(tmp_path):
    path = write_masked_dir(tmp_path / "chat", CHATS)
    flags = tmp_path / "chat" / FLAGS_FILE
    flags.write_bytes(flags.read_bytes()[:-1])
    with pytest.raises(DataError, match=f"{flags} is 10 bytes but meta.json says 11 tokens"):
        MemoryMappedDataset(path, seq_len=4)
    flags.unlink()
    with pytest.raises(DataError, match=f"{flags} is missing although meta.json says"):
        MemoryMappedDataset(path, seq_len=4)


def test_an_old_directory_reads_with_the_defaults_of_a_text_corpus(tmp_path):
    path = write_token_dir(tmp_path / "old", [[1, 2, 3]])
    meta_path = tmp_path / "old" / "meta.json"
    meta = json.loads(meta_path.read_text())
    for key in ("format", "loss_mask", "assistant_tokens", "max_document_tokens"):
        del meta[key]
    meta_path.write_text(json.dumps(meta))
    meta = read_meta(path)
    assert (meta["format"], meta["loss_mask"]) == ("text", False)
    assert meta["assistant_tokens"] is None and meta["max_document_tokens"] is None


def test_a_sharded_masked_corpus_reads_as_one_and_its_shards_must_all_be_masked(tmp_path):
    root = tmp_path / "sharded"
    write_masked_dir(root / shard_name(0, 2), CHATS[:1])
    write_masked_dir(root / shard_name(1, 2), CHATS[1:])
    corpus, parts = read_parts(str(root))
    assert corpus["loss_mask"] is True and len(parts) == 2
    assert corpus["assistant_tokens"] == 6 and corpus["max_document_tokens"] == 6
    whole = write_masked_dir(tmp_path / "whole", CHATS)
    a, b = MemoryMappedDataset(str(root), 5)[1], MemoryMappedDataset(whole, 5)[1]
    assert all(a[k].tolist() == b[k].tolist() for k in a)
    write_token_dir(root / shard_name(1, 2), [[1, 2, 3]])
    with pytest.raises(DataError, match=r"shard-00001-of-00002: loss_mask False, but True in"):
        read_parts(str(root))


def test_a_masked_corpus_written_to_a_store_reads_like_one_on_disk(tmp_path, memory_root):
    url = write_masked_dir(f"{memory_root}/chat", CHATS * 4)
    disk = write_masked_dir(tmp_path / "chat", CHATS * 4)
    assert set(names_in(url)) == {"meta.json", "tokens.bin", FLAGS_FILE}
    assert read_meta(url) == read_meta(disk)
    on_disk, in_store = MemoryMappedDataset(disk, 6), MemoryMappedDataset(url, 6)
    batch = list(range(len(on_disk)))[::-1]
    samples = in_store.__getitems__(batch)  # prefetched with its flags, then read
    for i, sample in zip(batch, samples, strict=True):
        assert all(sample[k].tolist() == on_disk[i][k].tolist() for k in sample), i
