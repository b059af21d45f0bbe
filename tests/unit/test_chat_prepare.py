"""prepare-data --format chat: each conversation is one document with its loss mask; the
held-out split, shards and worker processes work as for text."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kempnerforge.cli import main
from kempnerforge.core.errors import DataError
from kempnerforge.data.chat.conversation import conversation_of
from kempnerforge.data.chat.encoding import encode_conversation
from kempnerforge.data.chat.template import byte_chat_template, load_chat_template
from kempnerforge.data.dataset import IGNORE_INDEX, MemoryMappedDataset
from kempnerforge.data.prepare import corpus as prepare
from kempnerforge.data.prepare.corpus import prepare_data
from kempnerforge.data.tokenizer import ByteTokenizer, HFTokenizer
from kempnerforge.data.tokens.token_file import TokenFileWriter, read_meta
from tests.support.chat_files import CONVERSATION, make_chat_tokenizer_dir, write_conversations
from tests.support.data_files import prepared_ids

RECORDS = [
    {"messages": [{"role": "user", "content": f"question {i}"}, CONVERSATION[2 + i % 2 * 3]]}
    for i in range(12)
] + [
    {"prompt": "What is 2+2?", "completion": "4"},
    {"messages": CONVERSATION, "id": 7},
]


@pytest.fixture
def written(monkeypatch):
    """Every (output directory, tokens, loss mask) prepare-data hands its writers, in order."""
    calls: list[tuple[str, np.ndarray, np.ndarray]] = []

    class RecordingWriter(TokenFileWriter):
        def add_document(self, tokens, loss_mask=None):
            calls.append((str(self.output_dir), tokens, loss_mask))
            super().add_document(tokens, loss_mask=loss_mask)

    monkeypatch.setattr(prepare, "TokenFileWriter", RecordingWriter)
    return calls


def _expected(records, tokenizer=None, template=None):
    tokenizer = tokenizer or ByteTokenizer()
    template = template or byte_chat_template()
    conversations = [conversation_of(r, "test") for r in records]
    return [encode_conversation(tokenizer, template, c) for c in conversations]


def _assert_pairs_equal(calls, expected):
    assert len(calls) == len(expected)
    for (_, tokens, mask), (want_tokens, want_mask) in zip(calls, expected, strict=True):
        assert tokens.tolist() == want_tokens.tolist()
        assert mask.dtype == np.bool_ and mask.tolist() == want_mask.tolist()


# Longer than all of RECORDS together: they keep their order, packed into one window.
SEQ_LEN = 4096


def _run(argv: list[str]) -> int:
    seq_len = [] if "--seq-len" in argv else ["--seq-len", str(SEQ_LEN)]
    return main(["prepare-data", "--format", "chat", "--no-progress", *seq_len, *argv])


def test_cli_prepares_one_document_per_conversation_with_its_mask(tmp_path, written, capsys):
    src = write_conversations(tmp_path / "chats.jsonl", RECORDS)
    out = tmp_path / "out"
    assert _run(["--input", str(src), "--output", str(out)]) == 0
    expected = _expected(RECORDS)
    _assert_pairs_equal(written, expected)
    # A conversation's end is in token_flags.bin: no EOS is added after it.
    # Packed: one window of SEQ_LEN tokens, padded, then the one pad token that ends the stream.
    want = np.concatenate([tokens for tokens, _ in expected])
    pads = [ByteTokenizer.pad_id] * (SEQ_LEN + 1 - len(want))
    assert prepared_ids(out).tolist() == want.tolist() + pads
    meta = read_meta(str(out))
    assert meta["format"] == "chat" and meta["num_documents"] == len(RECORDS)
    assert meta["assistant_tokens"] == sum(int(m.sum()) for _, m in expected)
    assert meta["max_document_tokens"] == max(len(t) for t, _ in expected)
    printed = capsys.readouterr().out
    assert f"({meta['assistant_tokens']:,} assistant tokens; the longest" in printed


def test_cli_uses_the_template_of_a_tokenizer_directory(tmp_path, written):
    directory = make_chat_tokenizer_dir(tmp_path / "tok")
    src = write_conversations(tmp_path / "chats.jsonl", RECORDS)
    out = tmp_path / "out"
    assert _run(["--input", str(src), "--output", str(out), "--tokenizer", str(directory)]) == 0
    tokenizer = HFTokenizer(str(directory / "tokenizer.json"))
    _assert_pairs_equal(written, _expected(RECORDS, tokenizer, load_chat_template(str(directory))))
    assert read_meta(str(out))["tokenizer"] == tokenizer.identity


def test_a_renamed_messages_field_is_read(tmp_path, written):
    records = [{"chat": r["messages"]} for r in RECORDS if "messages" in r]
    src = write_conversations(tmp_path / "chats.jsonl", records)
    argv = ["--input", str(src), "--output", str(tmp_path / "out"), "--text-field", "chat"]
    assert _run(argv) == 0
    assert len(written) == len(records)


def test_the_held_out_split_is_disjoint_complete_and_deterministic(tmp_path, written):
    src = write_conversations(tmp_path / "chats.jsonl", RECORDS)
    splits = []
    for run in ("a", "b"):
        written.clear()
        train, held_out = tmp_path / run / "train", tmp_path / run / "eval"
        argv = ["--input", str(src), "--output", str(train), "--eval-output", str(held_out)]
        assert _run([*argv, "--eval-fraction", "0.3"]) == 0
        splits.append([(Path(d).name, t.tolist()) for d, t, _ in written])
        eval_meta = read_meta(str(held_out))
        assert eval_meta["format"] == "chat" and eval_meta["num_documents"] > 0
        assert eval_meta["num_documents"] + read_meta(str(train))["num_documents"] == len(RECORDS)
    assert splits[0] == splits[1]
    # Every conversation once (each split is packed, and written, on its own).
    assert sorted(t for _, t in splits[0]) == sorted(t.tolist() for t, _ in _expected(RECORDS))


def test_shards_together_hold_the_unsharded_corpus(tmp_path, written):
    files = [
        write_conversations(tmp_path / "in" / f"{i}.jsonl", RECORDS[i * 5 : i * 5 + 5])
        for i in range(3)
    ]
    inputs = ["--input", *map(str, files)]
    assert _run([*inputs, "--output", str(tmp_path / "whole")]) == 0
    whole = [(t.tolist(), m.tolist()) for _, t, m in written]
    written.clear()
    for index in range(2):
        shard = ["--shard-index", str(index), "--num-shards", "2"]
        assert _run([*inputs, "--output", str(tmp_path / "sharded"), *shard]) == 0
    assert [(t.tolist(), m.tolist()) for _, t, m in written] == whole
    # Each shard is whole windows; only the last ends the stream with one more pad token.
    assert len(prepared_ids(tmp_path / "sharded")) == 2 * SEQ_LEN + 1


def test_worker_processes_give_the_same_documents_and_masks(tmp_path, written):
    src = write_conversations(tmp_path / "chats.jsonl", RECORDS * 3)
    results = []
    for workers in ("1", "2"):
        written.clear()
        out = tmp_path / f"w{workers}"
        assert _run(["--input", str(src), "--output", str(out), "--workers", workers]) == 0
        results.append([(t.tolist(), m.tolist()) for _, t, m in written])
        assert (out / "tokens.bin").read_bytes() == (tmp_path / "w1" / "tokens.bin").read_bytes()
    assert results[0] == results[1]


def test_parquet_and_saved_dataset_inputs(tmp_path, written):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    chats = [r["messages"] for r in RECORDS if "messages" in r]
    pq.write_table(pa.table({"messages": chats}), tmp_path / "chats.parquet", row_group_size=3)
    pairs = {"prompt": ["q1", "q2"], "completion": ["a1", "a2"]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(pairs)}).save_to_disk(
        str(tmp_path / "pairs")
    )
    inputs = [str(tmp_path / "chats.parquet"), str(tmp_path / "pairs")]
    assert _run(["--input", *inputs, "--output", str(tmp_path / "out")]) == 0
    records = [{"messages": m} for m in chats] + [
        {"prompt": p, "completion": c}
        for p, c in zip(pairs["prompt"], pairs["completion"], strict=True)
    ]
    _assert_pairs_equal(written, _expected(records))


def test_a_parquet_file_without_conversation_columns_names_its_columns(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"t.parquet: no 'messages' column .*\(columns: text\)"):
        prepare_data(
            [str(tmp_path / "t.parquet")],
            str(tmp_path / "o"),
            ByteTokenizer(),
            chat_template=byte_chat_template(),
        )


def test_a_bad_conversation_names_the_file_and_line(tmp_path):
    src = write_conversations(tmp_path / "chats.jsonl", [RECORDS[0], {"messages": []}])
    with pytest.raises(DataError, match=r"chats.jsonl:2: expected a non-empty list of messages"):
        prepare_data(
            [str(src)], str(tmp_path / "o"), ByteTokenizer(), chat_template=byte_chat_template()
        )
    assert not (tmp_path / "o" / "meta.json").exists()


def test_text_files_and_bos_are_refused_in_chat_format(tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("plain text")
    with pytest.raises(DataError, match="notes.txt: a text file holds no conversations"):
        prepare_data(
            [str(text)], str(tmp_path / "o"), ByteTokenizer(), chat_template=byte_chat_template()
        )
    src = write_conversations(tmp_path / "chats.jsonl", RECORDS)
    assert _run(["--input", str(src), "--output", str(tmp_path / "o"), "--bos"]) == 2
    assert "--bos does not go with --format chat" in capsys.readouterr().err


def test_a_tokenizer_without_a_template_stops_before_reading(tmp_path, capsys):
    directory = make_chat_tokenizer_dir(tmp_path / "tok", None)
    src = write_conversations(tmp_path / "chats.jsonl", RECORDS)
    argv = ["--input", str(src), "--output", str(tmp_path / "o"), "--tokenizer", str(directory)]
    assert _run(argv) == 2
    assert "the tokenizer has no chat template" in capsys.readouterr().err


def test_the_text_format_records_no_chat_fields(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("hello")
    meta = prepare_data([str(src)], str(tmp_path / "o"), ByteTokenizer())
    assert (meta["format"], meta["loss_mask"], meta["assistant_tokens"]) == ("text", False, None)
    assert not (tmp_path / "o" / "token_flags.bin").exists()


def test_prepare_data_chat_writes_the_loss_mask_into_the_prepared_format(tmp_path):
    src = write_conversations(tmp_path / "chats.jsonl", RECORDS)
    # Not packed (no --seq-len from the library), so the conversations follow each other.
    prepare_data(
        [str(src)], str(tmp_path / "out"), ByteTokenizer(), chat_template=byte_chat_template()
    )
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    expected = _expected(RECORDS)
    assert meta["format"] == "chat"
    assert meta["assistant_tokens"] == sum(int(m.sum()) for _, m in expected)
    # Read back as training reads it: one window over the whole corpus, a label exactly
    # where the next token is the assistant's and of the same conversation.
    tokens = np.concatenate([t for t, _ in expected])
    mask = np.concatenate([m for _, m in expected])
    starts = np.cumsum([0] + [len(t) for t, _ in expected])[:-1]
    window = MemoryMappedDataset(str(tmp_path / "out"), seq_len=len(tokens) - 1)[0]
    want = np.where(mask[1:], tokens[1:], IGNORE_INDEX)
    want[np.isin(np.arange(1, len(tokens)), starts)] = IGNORE_INDEX
    assert window["labels"].tolist() == want.tolist()
    assert int(window["doc_ids"].max()) == len(expected) - 1


@pytest.mark.parametrize("option", [["--text-suffix", ".md"], ["--skip-non-utf8"]])
def test_whole_file_text_options_are_refused_in_chat_format(tmp_path, capsys, option):
    src = write_conversations(tmp_path / "chats.jsonl", RECORDS)
    assert _run(["--input", str(src), "--output", str(tmp_path / "o"), *option]) == 2
    assert f"{option[0]} is about whole-file text documents" in capsys.readouterr().err
