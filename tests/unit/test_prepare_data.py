"""prepare-data: exact round trips, dtype choice, the eval split, errors and crash safety."""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
from pathlib import Path

import pytest

from kempnerforge.commands.prepare_data import add_prepare_data_arguments, run_prepare_data
from kempnerforge.core.errors import DataError
from kempnerforge.data.prepare.corpus import is_eval_document, prepare_data
from kempnerforge.data.tokenizer import ByteTokenizer, HFTokenizer
from kempnerforge.data.tokens import token_file
from kempnerforge.data.tokens.token_file import dtype_name_for_vocab, read_meta
from tests.support.data_files import (
    make_hf_tokenizer,
    prepared_documents,
    prepared_ids,
    write_jsonl,
)

TEXTS = [
    "first document\n",
    "zweites Dokument: \u00e4\u00f6\u00fc",
    "\u65e5\u672c\u8a9e \U0001f600",
]


def _prepare(tmp_path: Path, inputs: list[Path], **kwargs) -> tuple[Path, dict]:
    out = tmp_path / "out"
    meta = prepare_data([str(p) for p in inputs], str(out), ByteTokenizer(), **kwargs)
    return out, meta


@pytest.mark.parametrize("suffix", [".txt", ".txt.gz"])
def test_txt_files_round_trip_one_document_each(tmp_path, suffix):
    paths = []
    for i, text in enumerate(TEXTS):
        path = tmp_path / f"doc{i}{suffix}"
        data = text.encode("utf-8")
        path.write_bytes(gzip.compress(data) if suffix.endswith(".gz") else data)
        paths.append(path)
    out, meta = _prepare(tmp_path, paths)
    assert prepared_documents(out) == TEXTS
    assert meta["num_documents"] == 3 and meta["sources"] == 3


@pytest.mark.parametrize("name", ["docs.jsonl", "docs.jsonl.gz"])
def test_jsonl_round_trips_one_document_per_line(tmp_path, name):
    path = write_jsonl(tmp_path / name, TEXTS)
    out, meta = _prepare(tmp_path, [path])
    assert prepared_documents(out) == TEXTS
    assert meta["num_tokens"] == sum(len(t.encode("utf-8")) + 1 for t in TEXTS)


def test_jsonl_custom_text_field_and_blank_lines(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"body": "a"}\n\n   \n{"body": "b"}\n', encoding="utf-8")
    out, _ = _prepare(tmp_path, [path], text_field="body")
    assert prepared_documents(out) == ["a", "b"]


def test_directory_is_walked_recursively_in_sorted_order(tmp_path):
    src = tmp_path / "src"
    (src / "b").mkdir(parents=True)
    (src / "a").mkdir()
    (src / "b" / "z.txt").write_text("bz")
    (src / "a" / "y.txt").write_text("ay")
    write_jsonl(src / "a" / "x.jsonl.gz", ["ax1", "ax2"])
    (src / "notes.md").write_text("ignored: not a supported extension")
    (src / "c.txt").write_text("c")
    out, meta = _prepare(tmp_path, [src])
    assert prepared_documents(out) == ["ax1", "ax2", "ay", "bz", "c"]
    assert meta["sources"] == 4


def test_metadata_describes_the_token_file(tmp_path):
    out, meta = _prepare(tmp_path, [write_jsonl(tmp_path / "d.jsonl", TEXTS)])
    assert json.loads((out / "meta.json").read_text()) == meta
    assert meta["format_version"] == token_file.FORMAT_VERSION
    assert meta["dtype"] == "uint16"
    assert (meta["vocab_size"], meta["eos_id"], meta["bos_id"]) == (259, 257, 256)
    assert meta["tokenizer"] == "byte"
    assert meta["content_sha256"] == hashlib.sha256((out / "tokens.bin").read_bytes()).hexdigest()
    assert (out / "tokens.bin").stat().st_size == meta["num_tokens"] * 2
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokens.bin"]


def test_streams_in_chunks_with_identical_output(tmp_path, monkeypatch):
    texts = [f"document number {i} " * (i % 7 + 1) for i in range(200)]
    src = write_jsonl(tmp_path / "d.jsonl", texts)
    whole = prepare_data([str(src)], str(tmp_path / "whole"), ByteTokenizer())
    monkeypatch.setattr(token_file, "_FLUSH_TOKENS", 64)  # many small writes
    chunked = prepare_data([str(src)], str(tmp_path / "chunked"), ByteTokenizer())
    assert chunked == whole
    assert prepared_documents(tmp_path / "chunked") == texts


def test_hf_tokenizer_round_trip(tmp_path):
    tok = HFTokenizer(make_hf_tokenizer(tmp_path / "tokenizer.json"))
    src = write_jsonl(tmp_path / "d.jsonl", TEXTS)
    meta = prepare_data([str(src)], str(tmp_path / "out"), tok)
    assert meta["tokenizer"] == tok.identity and meta["eos_id"] == tok.eos_id
    assert prepared_documents(tmp_path / "out", tok) == TEXTS


class _WideTokenizer(ByteTokenizer):
    """Bytes shifted past 65535: a vocabulary that needs uint32."""

    vocab_size = 70_000
    eos_id = 69_999
    identity = "wide"

    def encode(self, text: str) -> list[int]:
        return [66_000 + b for b in text.encode("utf-8")]


def test_dtype_is_chosen_by_vocab_size(tmp_path):
    assert dtype_name_for_vocab(259) == "uint16"
    assert dtype_name_for_vocab(65_536) == "uint16"
    assert dtype_name_for_vocab(65_537) == "uint32"
    src = write_jsonl(tmp_path / "d.jsonl", ["ab"])
    meta = prepare_data([str(src)], str(tmp_path / "out"), _WideTokenizer())
    assert meta["dtype"] == "uint32"
    assert prepared_ids(tmp_path / "out").tolist() == [66_097, 66_098, 69_999]


def test_missing_input_path_names_it(tmp_path):
    with pytest.raises(DataError, match=r"nope\.txt: input path does not exist"):
        _prepare(tmp_path, [tmp_path / "nope.txt"])


def test_no_readable_files_names_the_input(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "readme.md").write_text("x")
    with pytest.raises(DataError, match=r"no readable files found in .*src"):
        _prepare(tmp_path, [tmp_path / "src"])


def test_unsupported_file_type_names_the_file(tmp_path):
    (tmp_path / "data.csv").write_text("x")
    with pytest.raises(DataError, match=r"data\.csv: unsupported file type"):
        _prepare(tmp_path, [tmp_path / "data.csv"])


def test_non_utf8_txt_names_the_file(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt: not valid UTF-8"):
        _prepare(tmp_path, [tmp_path / "latin1.txt"])


def test_non_utf8_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2: not valid UTF-8"):
        _prepare(tmp_path, [path])


def test_invalid_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": broken}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:3: not valid JSON"):
        _prepare(tmp_path, [path])


def test_missing_text_field_names_file_line_and_keys(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ok"}\n{"content": "x", "id": 1}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2: no 'text' field \(keys: content, id\)"):
        _prepare(tmp_path, [path])


def test_non_string_text_field_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": 3}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:1: field 'text' is int"):
        _prepare(tmp_path, [path])


def test_corrupt_gzip_names_the_file(tmp_path):
    (tmp_path / "d.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match=r"d\.jsonl\.gz: not a readable gzip file"):
        _prepare(tmp_path, [tmp_path / "d.jsonl.gz"])


def test_corpus_with_zero_tokens_is_an_error(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match=r"out: the inputs hold no text \(zero tokens\)"):
        _prepare(tmp_path, [tmp_path / "empty.txt"])


def test_failed_prepare_leaves_no_files_and_keeps_the_old_output(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", TEXTS)
    out, before = _prepare(tmp_path, [good])
    old_bytes = (out / "tokens.bin").read_bytes()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(DataError):
        prepare_data([str(good), str(bad)], str(out), ByteTokenizer())
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokens.bin"]
    assert (out / "tokens.bin").read_bytes() == old_bytes
    assert read_meta(str(out)) == before


def test_eval_split_is_disjoint_complete_and_deterministic(tmp_path):
    texts = [f"document {i}: " + "word " * (i % 5) for i in range(300)]
    src = write_jsonl(tmp_path / "d.jsonl", texts)

    def run(name: str) -> tuple[dict, dict]:
        train, held = tmp_path / name / "train", tmp_path / name / "eval"
        meta = prepare_data(
            [str(src)], str(train), ByteTokenizer(), eval_fraction=0.2, eval_output_dir=str(held)
        )
        return meta, read_meta(str(held))

    train_meta, eval_meta = run("a")
    train_docs, eval_docs = (
        prepared_documents(tmp_path / "a" / "train"),
        prepared_documents(tmp_path / "a" / "eval"),
    )
    assert not set(train_docs) & set(eval_docs)
    assert sorted(train_docs + eval_docs) == sorted(texts)
    assert train_meta["num_documents"] + eval_meta["num_documents"] == 300
    assert 30 <= eval_meta["num_documents"] <= 90  # about 20% of 300
    assert [t for t in texts if t in set(eval_docs)] == eval_docs  # order is kept
    assert run("b") == (train_meta, eval_meta)


def test_eval_split_follows_the_text_not_its_position(tmp_path):
    picked = [t for t in (f"doc {i}" for i in range(1000)) if is_eval_document(t.encode(), 0.1)]
    assert 50 <= len(picked) <= 150
    assert is_eval_document(b"anything", 0.0) is False
    assert all(is_eval_document(t.encode(), 0.1) for t in picked)


def test_eval_fraction_needs_a_separate_output(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", TEXTS)
    with pytest.raises(DataError, match="needs an eval output directory"):
        _prepare(tmp_path, [src], eval_fraction=0.5)
    with pytest.raises(DataError, match="must be a different directory"):
        _prepare(tmp_path, [src], eval_fraction=0.5, eval_output_dir=str(tmp_path / "out"))


def test_empty_eval_split_names_the_eval_output(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", ["only one document"])
    with pytest.raises(DataError, match=r"held: eval fraction 1e-09 selected none of 1"):
        _prepare(tmp_path, [src], eval_fraction=1e-9, eval_output_dir=str(tmp_path / "held"))
    assert not (tmp_path / "out" / "meta.json").exists()


def _cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kempnerforge prepare-data")
    add_prepare_data_arguments(parser)
    return parser.parse_args(argv)


def test_cli_prints_a_one_line_summary(tmp_path, capsys):
    src = write_jsonl(tmp_path / "d.jsonl", [f"doc {i}" for i in range(50)])
    out, held = tmp_path / "out", tmp_path / "held"
    args = _cli(
        ["--input", str(src), "--output", str(out), "--eval-fraction", "0.3"]
        + ["--eval-output", str(held)]
    )
    assert run_prepare_data(args, []) == 0
    meta, held_meta = read_meta(str(out)), read_meta(str(held))
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == [
        f"prepared {meta['num_tokens']:,} tokens in {meta['num_documents']:,} documents "
        f"(uint16) into {out}; held out {held_meta['num_tokens']:,} tokens in "
        f"{held_meta['num_documents']:,} documents into {held}"
    ]


def test_cli_uses_the_given_tokenizer_and_field(tmp_path):
    tok_path = make_hf_tokenizer(tmp_path / "tokenizer.json")
    src = write_jsonl(tmp_path / "d.jsonl", TEXTS, field="body")
    args = _cli(["--input", str(src), "--output", str(tmp_path / "out")])
    args.tokenizer, args.text_field = tok_path, "body"
    run_prepare_data(args, [])
    assert read_meta(str(tmp_path / "out"))["tokenizer"] == HFTokenizer(tok_path).identity


def test_cli_eval_output_without_fraction_is_an_error(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", TEXTS)
    args = _cli(["--input", str(src), "--output", "o", "--eval-output", str(tmp_path / "h")])
    with pytest.raises(DataError, match="needs --eval-fraction"):
        run_prepare_data(args, [])


def test_progress_line_goes_to_stderr(tmp_path, capsys):
    src = write_jsonl(tmp_path / "d.jsonl", TEXTS)
    _prepare(tmp_path, [src], show_progress=True)
    err = capsys.readouterr().err
    assert "prepare-data: 1/1 files, 3 documents" in err and "MB/s" in err


WHAT_TO_DO = "name a new or empty directory, or one prepare-data wrote before to rewrite it"


def test_an_output_that_is_a_file_is_refused_before_any_input_is_read(tmp_path):
    taken = tmp_path / "taken.txt"
    taken.write_text("not a directory\n")
    missing = tmp_path / "no-such-input.jsonl"  # reading inputs first would fail on this
    with pytest.raises(DataError) as info:
        run_prepare_data(_cli(["--input", str(missing), "--output", str(taken)]), [])
    assert str(info.value) == f"--output {taken} is a file, not a directory; {WHAT_TO_DO}"
    assert taken.read_text() == "not a directory\n"


def test_an_eval_output_that_is_a_file_is_refused(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", TEXTS)
    taken = tmp_path / "taken.txt"
    taken.write_text("x")
    args = _cli(
        ["--input", str(src), "--output", str(tmp_path / "out"), "--eval-fraction", "0.3"]
        + ["--eval-output", str(taken)]
    )
    with pytest.raises(DataError) as info:
        run_prepare_data(args, [])
    assert str(info.value) == f"--eval-output {taken} is a file, not a directory; {WHAT_TO_DO}"
    assert not (tmp_path / "out").exists()


def test_an_output_below_a_file_names_the_file(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", TEXTS)
    out = tmp_path / "d.jsonl" / "out"
    with pytest.raises(DataError) as info:
        prepare_data([str(src)], str(out), ByteTokenizer())
    assert str(info.value) == (f"--output {out}: {src} is a file, not a directory; {WHAT_TO_DO}")


def test_a_directory_holding_other_files_is_refused_as_output(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", TEXTS)
    busy = tmp_path / "busy"
    busy.mkdir()
    for name in ("notes.txt", "b.py", "a.md", "c.csv"):
        (busy / name).write_text("keep me\n")
    (busy / "meta.json").write_text("{}")
    with pytest.raises(DataError) as info:
        prepare_data([str(src)], str(busy), ByteTokenizer())
    assert str(info.value) == (
        f"--output {busy} is a directory holding other files (a.md, b.py, c.csv and 1 more), "
        f"not a prepared data directory; {WHAT_TO_DO}"
    )
    assert sorted(p.name for p in busy.iterdir()) == [
        "a.md",
        "b.py",
        "c.csv",
        "meta.json",
        "notes.txt",
    ]


def test_an_empty_or_prepared_directory_is_written_into(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", TEXTS)
    out = tmp_path / "out"
    out.mkdir()
    first = prepare_data([str(src)], str(out), ByteTokenizer())
    # A killed run's temporary file is ours too: the directory is still ours to rewrite.
    (out / ".tokens.bin.tmp-12345").write_bytes(b"\x00\x01")
    again = prepare_data([str(src)], str(out), ByteTokenizer())
    assert again == first
    assert prepared_documents(out) == TEXTS
