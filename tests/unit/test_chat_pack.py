"""Conversations packed into whole training windows: none crosses a window boundary, pads are
never supervised nor attended across, long ones are cut or dropped and counted, and training
warns when its windows do not match the packing."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from kempnerforge.cli import main
from kempnerforge.config.data import DataConfig
from kempnerforge.data.chat.packing import (
    MAX_OPEN_WINDOWS,
    ConversationPacker,
    Packing,
    packing_mismatch,
)
from kempnerforge.data.dataset import IGNORE_INDEX, MemoryMappedDataset
from kempnerforge.data.pipeline_build import _dataset_opener
from kempnerforge.data.tokenizer import ByteTokenizer
from kempnerforge.data.tokens.token_file import TokenFileWriter, read_meta
from tests.support.chat_files import write_conversations
from tests.support.data_files import prepared_ids

PAD = ByteTokenizer.pad_id

Conversation = tuple[np.ndarray, np.ndarray]


def _conversations(seed: int, count: int, longest: int) -> list[Conversation]:
    """Random conversations (ids below 256, never the pad id) with random masks, some of
    whose first token is on, as a completion that opens its document would be."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, longest + 1, size=count)
    return [(rng.integers(0, 256, size=n), rng.random(n) < 0.5) for n in lengths]


def _pack(tmp_path, conversations, seq_len, policy="cut", name="out"):
    out = tmp_path / name
    with TokenFileWriter(str(out), ByteTokenizer()) as writer:
        packer = ConversationPacker(writer, Packing(seq_len, policy))
        for tokens, mask in conversations:
            packer.add_document(tokens, mask)
        meta = writer.finish(1, packer.finish())
    return out, meta


def _kept(conversations: list[Conversation], seq_len: int, policy: str) -> list[Conversation]:
    """What packing keeps of each conversation, by the documented rule."""
    kept = []
    for tokens, mask in conversations:
        if len(tokens) > seq_len:
            if policy == "drop" or not mask[1:seq_len].any():
                continue
            tokens, mask = tokens[:seq_len], mask[:seq_len]
        kept.append((tokens, mask))
    return kept


def _check_whole_windows(data_dir, seq_len: int, kept: list[Conversation]) -> None:
    """Each window's documents (by its doc_ids) are whole kept conversations or pad runs,
    labelled by their own mask, nothing across a document end; every kept conversation is
    found exactly once."""
    dataset = MemoryMappedDataset(str(data_dir), seq_len)
    assert dataset.num_tokens == len(dataset) * seq_len + 1
    remaining = sorted((t.tolist(), m.tolist()) for t, m in kept)
    found = []
    for index in range(len(dataset)):
        sample = {k: v.numpy() for k, v in dataset[index].items()}
        ids, labels = sample["input_ids"], sample["labels"]
        assert labels[-1] == IGNORE_INDEX  # the next window's first token is never a target
        bounds = np.flatnonzero(np.diff(sample["doc_ids"])) + 1
        for positions in np.split(np.arange(seq_len), bounds):
            tokens = ids[positions]
            if (tokens == PAD).all():
                assert (labels[positions] == IGNORE_INDEX).all()
                continue
            match = [m for t, m in remaining if t == tokens.tolist()]
            assert match, f"window {index} holds a piece of a conversation"
            mask = np.array(match[0])
            want = np.where(mask[1:], tokens[1:], IGNORE_INDEX).tolist() + [IGNORE_INDEX]
            assert labels[positions].tolist() == want
            found.append((tokens.tolist(), match[0]))
    assert sorted(found) == remaining


@pytest.mark.parametrize("policy", ["cut", "drop"])
def test_every_window_holds_whole_conversations(tmp_path, policy):
    seq_len = 32
    conversations = _conversations(0, 60, 40)
    out, meta = _pack(tmp_path, conversations, seq_len, policy)
    kept = _kept(conversations, seq_len, policy)
    _check_whole_windows(out, seq_len, kept)
    long = sum(len(t) > seq_len for t, _ in conversations)
    cut = len(kept) - sum(len(t) <= seq_len for t, _ in conversations)
    assert meta["packed_seq_len"] == seq_len and meta["num_documents"] == len(kept)
    assert (meta["conversations_cut"], meta["conversations_dropped"]) == (cut, long - cut)
    assert meta["pad_tokens"] == meta["num_tokens"] - sum(len(t) for t, _ in kept)
    assert meta["max_document_tokens"] <= seq_len
    assert read_meta(str(out))["pad_tokens"] == meta["pad_tokens"]


def test_a_cut_that_keeps_no_assistant_token_drops_the_conversation(tmp_path):
    on_late = np.zeros(12, dtype=bool)
    on_late[10:] = True
    on_early = np.zeros(12, dtype=bool)
    on_early[3] = True
    first_only = np.zeros(12, dtype=bool)
    first_only[0] = True  # the first token is never a label: nothing trained is left
    conversations = [
        (np.arange(12), on_late),
        (np.arange(12), on_early),
        (np.arange(12), first_only),
    ]
    _, meta = _pack(tmp_path, conversations, 8)
    assert (meta["conversations_cut"], meta["conversations_dropped"]) == (1, 2)
    assert meta["num_documents"] == 1 and meta["num_tokens"] == 8 + 1


def test_a_conversation_of_exactly_seq_len_tokens_fills_one_window(tmp_path):
    # The next conversation's first token is on: the label of the full window's last position
    # (that token, read as the window's N+1-th) must still be ignored.
    full = (np.arange(1, 9), np.ones(8, dtype=bool))
    after = (np.array([50, 51, 52]), np.ones(3, dtype=bool))
    out, meta = _pack(tmp_path, [full, after], 8)
    assert (meta["conversations_cut"], meta["pad_tokens"]) == (0, 5 + 1)
    dataset = MemoryMappedDataset(str(out), 8)
    first = dataset[0]
    assert first["input_ids"].tolist() == list(range(1, 9))
    assert first["labels"].tolist() == list(range(2, 9)) + [IGNORE_INDEX]
    assert first["doc_ids"].tolist() == [0] * 8
    assert dataset[1]["labels"].tolist() == [51, 52] + [IGNORE_INDEX] * 6


class _Recorder:
    """A writer that records what packing writes: a conversation's length, or ('pad', n)."""

    def __init__(self) -> None:
        self.written: list[int | tuple[str, int]] = []

    def add_document(self, tokens, loss_mask) -> None:
        self.written.append(len(tokens))

    def add_padding(self, num_tokens: int) -> None:
        self.written.append(("pad", num_tokens))


def _record(lengths: list[int], seq_len: int) -> list[int | tuple[str, int]]:
    recorder = _Recorder()
    packer = ConversationPacker(recorder, Packing(seq_len))  # type: ignore[arg-type]
    for n in lengths:
        packer.add_document(np.zeros(n, dtype=np.int64), np.ones(n, dtype=bool))
    packer.finish()
    return recorder.written


def test_first_fit_writes_full_windows_at_once_and_the_rest_in_opening_order():
    # 6 opens window A, 6 opens B, 3 fits A (9), 4 fills B, which is written at once.
    assert _record([6, 6, 3, 4], 10) == [6, 4, 6, 3, ("pad", 1), ("pad", 1)]


def test_with_every_window_open_the_fullest_is_written_first():
    lengths = [2] + [9] * (MAX_OPEN_WINDOWS - 1) + [9]
    written = _record(lengths, 10)
    # The last 9 fits nowhere: the first window of 9 (the fullest, oldest of equals) goes.
    assert written[:2] == [9, ("pad", 1)]
    assert written[2:4] == [2, ("pad", 8)]


def _run(argv: list[str]) -> int:
    return main(["prepare-data", "--format", "chat", "--no-progress", *argv])


RECORDS = [
    {"messages": [{"role": "user", "content": "q" * i}, {"role": "assistant", "content": "a" * j}]}
    for i, j in zip(range(1, 40, 3), range(40, 1, -3), strict=True)
]


def test_packing_is_deterministic_across_workers_and_the_held_out_split_is_packed(tmp_path):
    src = write_conversations(tmp_path / "chats.jsonl", RECORDS * 4)
    outputs = []
    for workers in ("1", "2"):
        out, held_out = tmp_path / f"w{workers}", tmp_path / f"e{workers}"
        argv = ["--input", str(src), "--output", str(out), "--seq-len", "96"]
        argv += ["--eval-fraction", "0.2", "--eval-output", str(held_out), "--workers", workers]
        assert _run(argv) == 0
        outputs.append(
            [
                (d / f).read_bytes()
                for d in (out, held_out)
                for f in ("tokens.bin", "token_flags.bin")
            ]
        )
        for directory in (out, held_out):
            meta = read_meta(str(directory))
            assert meta["packed_seq_len"] == 96 and meta["num_tokens"] % 96 == 1
    assert outputs[0] == outputs[1]


def test_shards_are_whole_windows_and_only_the_last_ends_the_stream(tmp_path, capsys):
    files = [
        write_conversations(tmp_path / f"{i}.jsonl", RECORDS[i * 6 : i * 6 + 6]) for i in range(2)
    ]
    out = tmp_path / "sharded"
    for index in ("0", "1"):
        argv = ["--input", *map(str, files), "--output", str(out), "--seq-len", "64"]
        assert _run([*argv, "--shard-index", index, "--num-shards", "2"]) == 0
    assert "packed into windows of 64 with" in capsys.readouterr().out
    shards = sorted(out.glob("shard-*"))
    assert [len(prepared_ids(s)) % 64 for s in shards] == [0, 1]
    dataset = MemoryMappedDataset(str(out), 64)
    metas = [read_meta(str(s)) for s in shards]
    assert dataset.meta["pad_tokens"] == sum(m["pad_tokens"] for m in metas)
    assert dataset.meta["packed_seq_len"] == 64
    for index in range(len(dataset)):
        sample = dataset[index]
        assert sample["labels"][-1] == IGNORE_INDEX


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "--format chat needs --seq-len N"),
        (["--format", "text", "--seq-len", "8"], "--seq-len is about packing conversations"),
        (["--format", "text", "--long-conversations", "drop"], "--long-conversations is about"),
    ],
)
def test_packing_options_are_checked(tmp_path, capsys, argv, message):
    src = write_conversations(tmp_path / "chats.jsonl", RECORDS)
    base = ["prepare-data", "--no-progress", "--input", str(src), "--output", str(tmp_path / "o")]
    if "--format" not in argv:
        base.insert(1, "--format=chat")
    assert main([*base, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_all_conversations_dropped_is_an_error_saying_what_to_do(tmp_path, capsys):
    src = write_conversations(tmp_path / "chats.jsonl", RECORDS)
    argv = ["--input", str(src), "--output", str(tmp_path / "o"), "--seq-len", "8"]
    assert _run([*argv, "--long-conversations", "drop"]) == 2
    assert "conversations are longer than --seq-len 8" in capsys.readouterr().err


@pytest.fixture
def data_warnings():
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("kempnerforge.data.pipeline_build")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def _open(path, seq_len: int) -> MemoryMappedDataset:
    opener = _dataset_opener(DataConfig(), ByteTokenizer(), seq_len, None)
    return opener(str(path), "data.path")


def test_training_warns_once_when_its_windows_do_not_match_the_packing(tmp_path, data_warnings):
    out, _ = _pack(tmp_path, _conversations(1, 40, 30), 32)
    _open(out, 32)
    _open(out, 64)  # each training window holds two packed ones: nothing straddles
    assert data_warnings == []
    _open(out, 24)
    assert [r.getMessage() for r in data_warnings] == [
        f"{out}: conversations were packed into windows of 32 tokens, but train.seq_len is "
        "24, so conversations straddle training windows and their second part is trained "
        "without its beginning; prepare it again with prepare-data --format chat --seq-len 24"
    ]


def test_an_unpacked_masked_corpus_with_long_conversations_warns(tmp_path, data_warnings):
    out = tmp_path / "unpacked"
    with TokenFileWriter(str(out), ByteTokenizer()) as writer:
        for tokens, mask in _conversations(2, 20, 30):
            writer.add_document(tokens, mask)
        meta = writer.finish(1)
    longest = meta["max_document_tokens"]
    _open(out, longest)
    assert data_warnings == []
    _open(out, longest - 1)
    assert len(data_warnings) == 1
    assert f"the longest is {longest} tokens, more than train.seq_len {longest - 1}" in (
        data_warnings[0].getMessage()
    )
    assert packing_mismatch("x", {"loss_mask": False}, 8) is None


def test_an_empty_shard_of_a_packed_corpus_reads_with_its_siblings(tmp_path):
    files = [write_conversations(tmp_path / f"{i}.jsonl", RECORDS[i::2]) for i in range(2)]
    out = tmp_path / "sharded"
    for index in ("0", "1", "2"):  # 2 files in 3 shards: shard 0 gets none
        argv = ["--input", *map(str, files), "--output", str(out), "--seq-len", "64"]
        assert _run([*argv, "--shard-index", index, "--num-shards", "3"]) == 0
    empty = read_meta(str(out / "shard-00000-of-00003"))
    assert (empty["num_tokens"], empty["format"], empty["packed_seq_len"]) == (0, "chat", 64)
    dataset = MemoryMappedDataset(str(out), 64)
    assert dataset.num_tokens == len(dataset) * 64 + 1
