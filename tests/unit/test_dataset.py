"""MemoryMappedDataset: windows, document ids and label masking, and refusing bad files."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from kempnerforge.core.errors import DataError
from kempnerforge.data.dataset import IGNORE_INDEX, MemoryMappedDataset
from kempnerforge.data.tokens import token_ids
from kempnerforge.data.tokens.token_file import read_meta
from tests.support.data_files import write_token_dir

EOS = 257  # ByteTokenizer's


@pytest.fixture
def counting_dir(tmp_path) -> str:
    """One document of ids 0..20 (then EOS): 22 tokens."""
    return write_token_dir(tmp_path / "count", [list(range(21))])


def test_windows_shift_labels_by_one_at_stride_seq_len(counting_dir):
    ds = MemoryMappedDataset(counting_dir, seq_len=4, document_masking=False)
    tokens = [*range(21), EOS]
    assert len(ds) == (22 - 1) // 4 == 5
    for i in range(len(ds)):
        sample = ds[i]
        window = tokens[i * 4 : i * 4 + 5]
        assert sample["input_ids"].tolist() == window[:-1]
        assert sample["labels"].tolist() == window[1:]
        for value in sample.values():
            assert value.dtype == torch.int64 and value.shape == (4,)
    # Every token but the first is a label exactly once, up to the dropped tail.
    labels = torch.cat([ds[i]["labels"] for i in range(len(ds))]).tolist()
    assert labels == tokens[1:21]


def test_window_count_when_tokens_fill_windows_exactly(tmp_path):
    path = write_token_dir(tmp_path / "d", [list(range(8))])  # 9 tokens = 2 windows of 4 + 1
    ds = MemoryMappedDataset(path, seq_len=4)
    assert len(ds) == 2
    assert ds[1]["labels"].tolist()[-1] == EOS


def test_out_of_range_index_raises_index_error(counting_dir):
    ds = MemoryMappedDataset(counting_dir, seq_len=4)
    with pytest.raises(IndexError):
        ds[5]
    with pytest.raises(IndexError):
        ds[-1]


def test_doc_ids_and_label_masking_at_document_boundaries(tmp_path):
    path = write_token_dir(tmp_path / "d", [[1, 2], [3], [4, 5, 6]])
    # tokens: 1 2 EOS 3 EOS 4 5 6 EOS
    sample = MemoryMappedDataset(path, seq_len=8)[0]
    assert sample["input_ids"].tolist() == [1, 2, EOS, 3, EOS, 4, 5, 6]
    assert sample["doc_ids"].tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    # After an EOS comes another document: that label is not predicted.
    assert sample["labels"].tolist() == [2, EOS, IGNORE_INDEX, EOS, IGNORE_INDEX, 5, 6, EOS]


def test_doc_ids_restart_at_each_window(tmp_path):
    path = write_token_dir(tmp_path / "d", [[1, 2, 3], [4, 5, 6, 7]])
    # tokens: 1 2 3 EOS 4 5 6 7 EOS; second window starts at 4 (a new document)
    ds = MemoryMappedDataset(path, seq_len=4)
    assert ds[0]["doc_ids"].tolist() == [0, 0, 0, 0]
    # The window's last input is an EOS: its label opens the next document, so it is masked.
    assert ds[0]["labels"].tolist() == [2, 3, EOS, IGNORE_INDEX]
    assert ds[1]["input_ids"].tolist() == [4, 5, 6, 7]
    assert ds[1]["doc_ids"].tolist() == [0, 0, 0, 0]


def test_without_document_masking_the_window_is_one_sequence(tmp_path):
    path = write_token_dir(tmp_path / "d", [[1, 2], [3]])
    sample = MemoryMappedDataset(path, seq_len=4, document_masking=False)[0]
    assert sample["labels"].tolist() == [2, EOS, 3, EOS]
    assert sample["doc_ids"].tolist() == [0, 0, 0, 0]


def test_fewer_tokens_than_one_window_is_a_data_error(tmp_path):
    path = write_token_dir(tmp_path / "short", [[1, 2]])  # 3 tokens
    with pytest.raises(DataError, match=r"short: 3 tokens, fewer than one window .* = 4"):
        MemoryMappedDataset(path, seq_len=3)
    assert len(MemoryMappedDataset(path, seq_len=2)) == 1


def test_truncated_tokens_file_names_it_with_both_sizes(counting_dir):
    tokens = f"{counting_dir}/tokens.bin"
    with open(tokens, "r+b") as f:
        f.truncate(30)
    with pytest.raises(DataError, match=r"tokens\.bin is 30 bytes but .* 22 tokens of uint16 = 44"):
        MemoryMappedDataset(counting_dir, seq_len=4)


def test_wrong_dtype_in_meta_is_a_data_error(counting_dir):
    meta_path = Path(counting_dir) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["dtype"] = "uint32"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"is 44 bytes but .* 22 tokens of uint32 = 88 bytes"):
        MemoryMappedDataset(counting_dir, seq_len=4)
    meta["dtype"] = "float32"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"meta\.json: dtype 'float32' is not one of"):
        MemoryMappedDataset(counting_dir, seq_len=4)


def test_missing_or_unreadable_meta_names_the_directory(tmp_path, counting_dir):
    with pytest.raises(DataError, match=r"empty has no meta\.json: .*prepare-data"):
        (tmp_path / "empty").mkdir()
        MemoryMappedDataset(str(tmp_path / "empty"), seq_len=4)
    with pytest.raises(DataError, match=r"nowhere is not a directory"):
        MemoryMappedDataset(str(tmp_path / "nowhere"), seq_len=4)
    (Path(counting_dir) / "meta.json").write_text("{not json")
    with pytest.raises(DataError, match=r"meta\.json: cannot be read as JSON"):
        MemoryMappedDataset(counting_dir, seq_len=4)
    (Path(counting_dir) / "meta.json").write_text('{"dtype": "uint16"}')
    with pytest.raises(DataError, match=r"meta\.json: missing format_version, vocab_size"):
        MemoryMappedDataset(counting_dir, seq_len=4)


def test_missing_tokens_file_is_a_data_error(counting_dir):
    (Path(counting_dir) / "tokens.bin").unlink()
    with pytest.raises(DataError, match=r"tokens\.bin is missing"):
        MemoryMappedDataset(counting_dir, seq_len=4)


def test_tokenizer_mismatch_says_which_tokenizer_prepared_it(counting_dir):
    with pytest.raises(DataError, match=r"prepared with tokenizer 'byte', but this job uses 'hf:"):
        MemoryMappedDataset(counting_dir, seq_len=4, expected_tokenizer="hf:0123456789abcdef")
    MemoryMappedDataset(counting_dir, seq_len=4, expected_tokenizer="byte")


def test_vocabulary_larger_than_the_model_is_a_data_error(counting_dir):
    with pytest.raises(DataError, match=r"259-token vocabulary, more than .* vocab_size 256"):
        MemoryMappedDataset(counting_dir, seq_len=4, model_vocab_size=256)
    MemoryMappedDataset(counting_dir, seq_len=4, model_vocab_size=259)


def test_pickles_without_the_memory_map(counting_dir):
    ds = MemoryMappedDataset(counting_dir, seq_len=4)
    first = ds[3]
    assert [type(m) for m in ds._stream._maps.values()] == [np.memmap]
    clone = pickle.loads(pickle.dumps(ds))
    assert not clone._stream._maps  # reopened lazily in the worker
    assert all(torch.equal(clone[3][k], first[k]) for k in first)
    assert clone.meta == ds.meta and len(clone) == len(ds)


def test_uint32_files_are_read_with_their_dtype(tmp_path):
    class Wide:
        vocab_size, bos_id, eos_id, pad_id, identity = 70_000, 1, 69_999, 2, "wide"

    path = write_token_dir(tmp_path / "w", [[65_000, 66_000, 3]], tokenizer=Wide())
    sample = MemoryMappedDataset(path, seq_len=3)[0]
    assert sample["input_ids"].tolist() == [65_000, 66_000, 3]
    assert sample["labels"].tolist() == [66_000, 3, 69_999]


HINT = "run `kempnerforge prepare-data --input ... --output DIR` and point at DIR again"


def _set_token(data_dir: str, offset: int, token_id: int, dtype: str = "<u2") -> Path:
    """Overwrite one id of tokens.bin in place; returns the file."""
    tokens = Path(data_dir) / "tokens.bin"
    ids = np.fromfile(tokens, dtype=dtype)
    ids[offset] = token_id
    ids.tofile(tokens)
    return tokens


def _rewrite_meta(data_dir: str, **changes) -> Path:
    meta_path = Path(data_dir) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta.update(changes)
    meta_path.write_text(json.dumps(meta))
    return meta_path


def test_an_id_beyond_the_model_vocabulary_is_refused_when_opened(counting_dir):
    tokens = _set_token(counting_dir, 17, 600)
    _rewrite_meta(counting_dir, max_token_id=600)  # as a writer of such ids records it
    with pytest.raises(DataError) as info:
        MemoryMappedDataset(counting_dir, seq_len=4, model_vocab_size=512)
    assert str(info.value) == (
        f"{tokens}: the token at offset 17 is id 600, not below meta.json's vocab_size 259 "
        "and model.vocab_size 512: the file is corrupt or was not written as the uint16 ids "
        "of tokenizer byte that meta.json names; run prepare-data again with this job's "
        "tokenizer"
    )


def test_an_id_beyond_meta_vocab_size_is_corruption_even_without_a_model(counting_dir):
    tokens = _set_token(counting_dir, 3, 259)
    _rewrite_meta(counting_dir, max_token_id=259)
    with pytest.raises(DataError) as info:
        MemoryMappedDataset(counting_dir, seq_len=4)
    assert str(info.value) == (
        f"{tokens}: the token at offset 3 is id 259, not below meta.json's vocab_size 259: "
        "the file is corrupt or was not written as the uint16 ids of tokenizer byte that "
        "meta.json names; run prepare-data again with this job's tokenizer"
    )


def test_an_id_only_the_model_lacks_says_to_raise_its_vocabulary(counting_dir):
    # Unreachable through MemoryMappedDataset, which refuses a larger data vocabulary first.
    tokens = Path(counting_dir) / "tokens.bin"
    with pytest.raises(DataError) as info:
        token_ids.check_token_ids(counting_dir, read_meta(counting_dir), model_vocab_size=10)
    assert str(info.value) == (
        f"{tokens}: the token at offset 10 is id 10, not below model.vocab_size 10; raise "
        "model.vocab_size to at least 259 or prepare the data again with this job's tokenizer"
    )


def test_the_id_scan_reports_the_first_bad_id_across_chunks(counting_dir, monkeypatch):
    monkeypatch.setattr(token_ids, "_SCAN_TOKENS", 4)  # 22 tokens: six chunks
    _set_token(counting_dir, 13, 1000)
    _set_token(counting_dir, 9, 300)
    meta = read_meta(counting_dir)
    tokens = Path(counting_dir) / "tokens.bin"
    assert token_ids.first_id_at_least(tokens, meta, 259) == (9, 300)
    assert token_ids.first_id_at_least(tokens, meta, 301) == (13, 1000)
    assert token_ids.first_id_at_least(tokens, meta, 1001) is None


def test_the_id_scan_is_skipped_when_the_dtype_cannot_exceed_the_vocabulary(tmp_path):
    class Full16:
        vocab_size, bos_id, eos_id, pad_id, identity = 65_536, 1, 65_535, 2, "full16"

    path = write_token_dir(tmp_path / "f", [[65_534, 3, 4, 5]], tokenizer=Full16())
    meta = read_meta(path)
    assert meta["dtype"] == "uint16"
    assert token_ids.first_id_at_least(Path(path) / "tokens.bin", meta, 65_536) is None
    assert len(MemoryMappedDataset(path, seq_len=2, model_vocab_size=65_536)) == 2


def test_a_dtype_that_lies_is_caught_by_the_id_scan_or_the_window_check(counting_dir):
    # 22 uint16 ids read as 11 uint32 ids: the sizes agree, the ids do not.
    meta_path = _rewrite_meta(counting_dir, dtype="uint32", num_tokens=11)
    expected = (
        f"{Path(counting_dir) / 'tokens.bin'}: the token at offset 0 is id 65536, not below "
        "meta.json's vocab_size 259 and model.vocab_size 259: the file is corrupt or was not "
        "written as the uint32 ids of tokenizer byte that meta.json names; run prepare-data "
        "again with this job's tokenizer"
    )
    # The recorded largest id (of the uint16 ids) passes; the first window read does not.
    ds = MemoryMappedDataset(counting_dir, seq_len=4, model_vocab_size=259)
    with pytest.raises(DataError) as info:
        ds[0]
    assert str(info.value) == expected
    # A hand-made meta.json without the largest id: the scan on opening finds it.
    meta = json.loads(meta_path.read_text())
    del meta["max_token_id"]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(DataError) as info:
        MemoryMappedDataset(counting_dir, seq_len=4, model_vocab_size=259)
    assert str(info.value) == expected


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("num_tokens", "many", "num_tokens 'many' is not an integer >= 0"),
        ("num_tokens", -22, "num_tokens -22 is not an integer >= 0"),
        ("num_tokens", 22.0, "num_tokens 22.0 is not an integer >= 0"),
        ("num_documents", None, "num_documents None is not an integer >= 0"),
        ("sources", True, "sources True is not an integer >= 0"),
        ("vocab_size", -1, "vocab_size -1 is not an integer in [1, 2**32]"),
        ("vocab_size", "259", "vocab_size '259' is not an integer in [1, 2**32]"),
        ("vocab_size", 2**40, "vocab_size 1099511627776 is not an integer in [1, 2**32]"),
        ("eos_id", 3.5, "eos_id 3.5 is not an id of the vocabulary, [0, 259)"),
        ("eos_id", 259, "eos_id 259 is not an id of the vocabulary, [0, 259)"),
        ("bos_id", -1, "bos_id -1 is not an id of the vocabulary, [0, 259)"),
        ("tokenizer", 7, "tokenizer 7 is not a non-empty string"),
        ("tokenizer", "", "tokenizer '' is not a non-empty string"),
        ("content_sha256", ["x"], "content_sha256 ['x'] is not a non-empty string"),
        ("dtype", ["uint16"], "dtype ['uint16'] is not one of uint16, uint32"),
        ("format_version", "1", "format_version '1', this version reads 1"),
        ("bos_per_document", "yes", "bos_per_document 'yes' is not true or false"),
        ("max_token_id", "257", "max_token_id '257' is not an integer in [-1, 2**32)"),
        ("max_token_id", -2, "max_token_id -2 is not an integer in [-1, 2**32)"),
        ("max_token_id", 2**32, "max_token_id 4294967296 is not an integer in [-1, 2**32)"),
        (
            "max_token_id",
            -1,
            "max_token_id -1 does not fit num_tokens 22 (it is -1 exactly when there are no "
            "tokens)",
        ),
        (
            "dtype",
            ["uint16"] * 20,
            "dtype ['uint16', 'uint16', 'uint16', 'uint1... is not one of uint16, uint32",
        ),
    ],
)
def test_a_meta_field_of_the_wrong_type_or_range_is_named(counting_dir, key, value, problem):
    meta_path = _rewrite_meta(counting_dir, **{key: value})
    with pytest.raises(DataError) as info:
        MemoryMappedDataset(counting_dir, seq_len=4)
    assert str(info.value) == f"{meta_path}: {problem}; {HINT}"
