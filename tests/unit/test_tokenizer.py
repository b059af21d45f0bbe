"""Tokenizers: byte-level round trips, a local tokenizer.json, and load_tokenizer's errors."""

from __future__ import annotations

import hashlib
import json
import sys

import pytest

from kempnerforge.core.errors import ConfigError, DataError
from kempnerforge.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    encode_to_arrays,
    load_tokenizer,
)
from tests.support.data_files import HF_TRAINING_TEXT, make_hf_tokenizer

TEXTS = ["", "plain ascii", "h\u00e9llo w\u00f6rld", "\u65e5\u672c\u8a9e \U0001f600\n\t"]


def test_byte_tokenizer_round_trips_non_ascii_text():
    tok = ByteTokenizer()
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text


def test_byte_tokenizer_specials_and_identity():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (259, 256, 257, 258)
    assert tok.identity == "byte"


def test_byte_decode_skips_special_ids_and_replaces_invalid_utf8():
    tok = ByteTokenizer()
    ids = [tok.bos_id, *tok.encode("ab"), tok.eos_id, 0xC3, tok.pad_id, 300, *tok.encode("c")]
    # 0xC3 alone is a truncated two-byte sequence: replaced, not an exception.
    assert tok.decode(ids) == "ab\ufffdc"


def test_hf_tokenizer_loads_local_file_and_round_trips(tmp_path):
    path = make_hf_tokenizer(tmp_path / "tokenizer.json")
    tok = HFTokenizer(path)
    assert isinstance(tok, Tokenizer)
    for text in [*HF_TRAINING_TEXT, "unseen words \u00fcber", ""]:
        ids = tok.encode(text)
        assert tok.eos_id not in ids  # no special tokens added
        assert tok.decode(ids) == text
    assert tok.decode([tok.eos_id, *tok.encode("x"), tok.pad_id]) == "x"


def test_hf_tokenizer_specials_identity_and_vocab(tmp_path):
    path = make_hf_tokenizer(tmp_path / "tokenizer.json")
    tok = HFTokenizer(path)
    digest = hashlib.sha256((tmp_path / "tokenizer.json").read_bytes()).hexdigest()
    assert tok.identity == "hf:" + digest[:16]
    vocab = json.loads((tmp_path / "tokenizer.json").read_text())["model"]["vocab"]
    assert tok.eos_id == vocab["<|endoftext|>"]
    assert tok.pad_id == vocab["<pad>"]
    assert tok.bos_id == vocab["<s>"]
    assert tok.vocab_size == len(vocab)


def test_hf_tokenizer_without_bos_and_pad_uses_eos(tmp_path):
    tok = HFTokenizer(make_hf_tokenizer(tmp_path / "t.json", specials=("</s>",)))
    assert tok.bos_id == tok.eos_id == tok.pad_id


def test_hf_tokenizer_without_eos_names_the_file(tmp_path):
    path = make_hf_tokenizer(tmp_path / "noeos.json", specials=("<pad>",))
    with pytest.raises(DataError, match=r"noeos\.json: no end-of-document token"):
        HFTokenizer(path)


def test_hf_tokenizer_malformed_file_names_the_file(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text('{"not": "a tokenizer"}')
    with pytest.raises(DataError, match=r"broken\.json: not a valid Hugging Face tokenizer"):
        HFTokenizer(str(bad))


def test_missing_tokenizers_package_says_how_to_install(tmp_path, monkeypatch):
    path = make_hf_tokenizer(tmp_path / "tokenizer.json")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import now raises ImportError
    with pytest.raises(DataError, match=r"pip install kempnerforge\[hf\]"):
        HFTokenizer(path)


def test_load_tokenizer_byte_file_and_directory(tmp_path):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    path = make_hf_tokenizer(tmp_path / "model" / "tokenizer.json")
    assert load_tokenizer(path).identity == load_tokenizer(str(tmp_path / "model")).identity


def test_load_tokenizer_missing_path_is_a_config_error(tmp_path):
    missing = str(tmp_path / "nope.json")
    with pytest.raises(ConfigError) as info:
        load_tokenizer(missing)
    assert info.value.field == "data.tokenizer"
    assert "does not exist" in str(info.value)


def test_encode_to_arrays_matches_encode(tmp_path):
    hf = HFTokenizer(make_hf_tokenizer(tmp_path / "tokenizer.json"))
    for tok in (ByteTokenizer(), hf):
        arrays = encode_to_arrays(tok, TEXTS)
        assert [a.tolist() for a in arrays] == [tok.encode(t) for t in TEXTS]
