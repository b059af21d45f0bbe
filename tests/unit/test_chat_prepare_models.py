"""prepare-data --format chat on tokenizer folders laid out as public models publish them
(tests/support/chat_models.py): the special tokens their files name, conversations that open
with the assistant, and conversations a template refuses, skipped and counted."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from kempnerforge.cli import main
from kempnerforge.core.errors import DataError
from kempnerforge.data.chat.template import load_chat_template
from kempnerforge.data.tokenizer import HFTokenizer, load_tokenizer
from kempnerforge.data.tokens.token_file import read_meta
from tests.support.chat_files import write_conversations
from tests.support.chat_models import (
    CONVERSATIONS,
    SETUPS_BY_NAME,
    make_model_tokenizer_dir,
    training_texts,
)
from tests.support.data_files import prepared_ids

transformers = pytest.importorskip("transformers")
SEQ_LEN = 4096  # one window holds every conversation written here
ASSISTANT_FIRST = dict(CONVERSATIONS)["assistant first"]
SYSTEM = dict(CONVERSATIONS)["system"]
ONE_TURN = dict(CONVERSATIONS)["one turn"]


def _folder(tmp_path, name: str):
    return make_model_tokenizer_dir(SETUPS_BY_NAME[name], tmp_path / name, training_texts())


def _prepare(tmp_path, folder, records, *options: str) -> int:
    src = write_conversations(tmp_path / "chats.jsonl", records)
    argv = ["prepare-data", "--format", "chat", "--no-progress", "--seq-len", str(SEQ_LEN)]
    argv += ["--input", str(src), "--output", str(tmp_path / "out"), "--tokenizer", str(folder)]
    return main([*argv, *options])


def _first_document(tmp_path) -> tuple[list[int], list[bool]]:
    """The first conversation of the prepared directory: its ids and loss bits."""
    ids = prepared_ids(tmp_path / "out")
    flags = np.fromfile(tmp_path / "out" / "token_flags.bin", dtype=np.uint8)
    end = int(np.flatnonzero(flags & 2)[0]) + 1
    return ids[:end].tolist(), (flags[:end] & 1).astype(bool).tolist()


def test_bos_named_only_in_special_tokens_map_opens_the_conversation(tmp_path):
    """Llama 3.1 with bos_token and eos_token in special_tokens_map.json only: transformers
    renders <|begin_of_text|> first, and so does prepare-data."""
    folder = _folder(tmp_path, "llama-3.1-map-only")
    assert "bos_token" not in json.loads((folder / "tokenizer_config.json").read_text())
    assert _prepare(tmp_path, folder, [{"messages": ONE_TURN}]) == 0
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    ids, _ = _first_document(tmp_path)
    assert ids == reference.apply_chat_template(ONE_TURN, tokenize=True, return_dict=False)
    assert ids[0] == reference.convert_tokens_to_ids("<|begin_of_text|>")
    assert read_meta(str(tmp_path / "out"))["eos_id"] == reference.eos_token_id


def test_special_tokens_map_is_read_only_where_transformers_reads_it(tmp_path):
    """A config that lists added_tokens_decoder wins over special_tokens_map.json; one that
    does not is overridden by it."""
    folder = _folder(tmp_path, "llama-3.1")
    other = {"bos_token": "<|end_of_text|>", "eos_token": "<|eom_id|>"}
    (folder / "special_tokens_map.json").write_text(json.dumps(other))
    for lists_added_tokens in (True, False):
        config = json.loads((folder / "tokenizer_config.json").read_text())
        if not lists_added_tokens:
            config.pop("added_tokens_decoder")
            (folder / "tokenizer_config.json").write_text(json.dumps(config))
        reference = transformers.AutoTokenizer.from_pretrained(str(folder))
        tokenizer = load_tokenizer(str(folder))
        variables = load_chat_template(str(folder)).variables
        assert variables["bos_token"] == reference.bos_token
        assert tokenizer.eos_id == reference.eos_token_id
        assert reference.eos_token == ("<|eot_id|>" if lists_added_tokens else "<|eom_id|>")


@pytest.mark.parametrize("name", ["llama-3.1", "qwen2.5", "qwen3"])
def test_a_conversation_that_opens_with_the_assistant_is_prepared(tmp_path, name):
    folder = _folder(tmp_path, name)
    assert _prepare(tmp_path, folder, [{"messages": ASSISTANT_FIRST}]) == 0
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    ids, mask = _first_document(tmp_path)
    assert ids == reference.apply_chat_template(ASSISTANT_FIRST, tokenize=True, return_dict=False)
    on = [token for token, bit in zip(ids, mask, strict=True) if bit]
    end = SETUPS_BY_NAME[name].end_of_turn
    # Both assistant turns are trained, each with its end of turn.
    assert reference.decode(on, skip_special_tokens=False).count(end) == 2
    assert reference.decode(on, skip_special_tokens=False).startswith("Welcome!" + end)


def test_deepseeks_configured_end_token_is_its_eos(tmp_path):
    folder = _folder(tmp_path, "deepseek-v3")
    tokenizer = load_tokenizer(str(folder))
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert tokenizer.eos_id == reference.convert_tokens_to_ids("<｜end▁of▁sentence｜>")
    assert tokenizer.bos_id == reference.convert_tokens_to_ids("<｜begin▁of▁sentence｜>")


def test_a_text_corpus_ends_documents_with_the_configured_eos(tmp_path):
    """Llama 3.1's config names <|eot_id|>, though <|end_of_text|> is in the vocabulary."""
    folder = _folder(tmp_path, "llama-3.1")
    src = tmp_path / "doc.txt"
    src.write_text("the quick brown fox")
    argv = ["prepare-data", "--no-progress", "--input", str(src), "--output", str(tmp_path / "o")]
    assert main([*argv, "--tokenizer", str(folder)]) == 0
    eot = transformers.AutoTokenizer.from_pretrained(str(folder)).convert_tokens_to_ids(
        "<|eot_id|>"
    )
    assert read_meta(str(tmp_path / "o"))["eos_id"] == eot
    assert prepared_ids(tmp_path / "o")[-1] == eot


def test_a_named_token_missing_from_the_vocabulary_is_refused(tmp_path):
    folder = _folder(tmp_path, "smollm2")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|not_a_token|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(
        DataError, match=r"tokenizer_config.json: eos_token '<\|not_a_token\|>' is not"
    ):
        HFTokenizer(str(folder / "tokenizer.json"))


# --- Conversations a template refuses ----------------------------------------------------

# Gemma 2's template refuses a system turn; the rest it renders.
MIXED = [{"messages": ONE_TURN}, {"messages": SYSTEM}, {"messages": ONE_TURN}, {"messages": SYSTEM}]


def test_refused_conversations_are_skipped_and_counted(tmp_path, capsys, caplog):
    folder = _folder(tmp_path, "gemma-2")
    with caplog.at_level(logging.WARNING, logger="kempnerforge"):
        assert _prepare(tmp_path, folder, MIXED) == 0
    meta = read_meta(str(tmp_path / "out"))
    assert meta["num_documents"] == 2 and meta["conversations_refused"] == 2
    assert "2 refused by the chat template and skipped" in capsys.readouterr().out
    assert "chats.jsonl:2: the chat template of" in caplog.text
    assert "System role not supported" in caplog.text
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    ids, _ = _first_document(tmp_path)
    assert ids == reference.apply_chat_template(ONE_TURN, tokenize=True, return_dict=False)


def test_stop_on_refused_stops_at_the_first(tmp_path, capsys):
    folder = _folder(tmp_path, "gemma-2")
    assert _prepare(tmp_path, folder, MIXED, "--stop-on-refused") == 2
    err = capsys.readouterr().err
    assert "chats.jsonl:2: the chat template of" in err and "System role not supported" in err
    assert "--stop-on-refused" in err
    assert not (tmp_path / "out" / "meta.json").exists()


def test_a_file_of_refused_conversations_stops_with_the_first_reason(tmp_path, capsys):
    folder = _folder(tmp_path, "gemma-2")
    assert _prepare(tmp_path, folder, [{"messages": SYSTEM}] * 3) == 2
    err = capsys.readouterr().err
    assert "all 3 conversations were refused; the first: " in err
    assert "chats.jsonl:1: the chat template" in err


def test_refusals_are_counted_per_split_and_alike_for_every_worker_count(tmp_path):
    folder = _folder(tmp_path, "gemma-2")
    records = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(40)
    ] + [
        {"messages": [SYSTEM[0], {"role": "user", "content": f"q{i}"}, SYSTEM[2]]}
        for i in range(20)
    ]
    counts = []
    for workers in ("1", "2"):
        out, held_out = tmp_path / f"w{workers}", tmp_path / f"e{workers}"
        src = write_conversations(tmp_path / "mixed.jsonl", records)
        argv = ["prepare-data", "--format", "chat", "--no-progress", "--seq-len", str(SEQ_LEN)]
        argv += ["--input", str(src), "--output", str(out), "--tokenizer", str(folder)]
        argv += ["--eval-fraction", "0.3", "--eval-output", str(held_out), "--workers", workers]
        assert main(argv) == 0
        train, evaluation = read_meta(str(out)), read_meta(str(held_out))
        assert train["conversations_refused"] + evaluation["conversations_refused"] == 20
        assert train["num_documents"] + evaluation["num_documents"] == 40
        counts.append((train["conversations_refused"], (out / "tokens.bin").read_bytes()))
    assert counts[0] == counts[1]


def test_stop_on_refused_goes_only_with_chat(tmp_path, capsys):
    src = tmp_path / "a.txt"
    src.write_text("hello")
    argv = ["prepare-data", "--input", str(src), "--output", str(tmp_path / "o")]
    assert main([*argv, "--stop-on-refused"]) == 2
    assert "--stop-on-refused is about conversations the chat template refuses" in (
        capsys.readouterr().err
    )
