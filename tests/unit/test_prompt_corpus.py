"""Prompt data: prepare-data --format prompts writes each prompt and its reference answer as
one window, the prompt exactly as `generate --chat` tokenizes it and never a target, the
answer the only targets, so a sample read by the real dataset gives back both; a row that
does not fit is dropped and counted, and training refuses another train.seq_len."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from examples.chat_conversations import prompt_row
from kempnerforge.cli import main
from kempnerforge.config.data import DataConfig
from kempnerforge.config.loader import load_config
from kempnerforge.core.errors import DataError
from kempnerforge.data.chat import load_chat_template
from kempnerforge.data.dataset import MemoryMappedDataset
from kempnerforge.data.pipeline_build import build_data_pipeline, is_prompts
from kempnerforge.data.prepare import write_prompts_corpus
from kempnerforge.data.sampling import ShardedSampler
from kempnerforge.data.tokenizer import load_tokenizer
from kempnerforge.model.heads import IGNORE_INDEX
from kempnerforge.training.inference.chat_prompt import chat_prompt
from tests.support.chat_files import make_chat_tokenizer_dir, write_conversations

SEQ = 128

# Renders as ChatML, but refuses a prompt that mentions "forbidden", as templates refuse
# what they cannot write.
REFUSING = """{%- for message in messages %}
    {%- if 'forbidden' in message['content'] %}{{ raise_exception('no such topic') }}{% endif %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}
"""


def _rows() -> list[dict]:
    """Arithmetic rows as the example writes them, a string prompt, a two-message prompt
    and a unicode answer."""
    rng = random.Random(0)
    rows = [prompt_row(rng) for _ in range(12)]
    rows.append({"prompt": "What is 5 - 17?", "answer": "-12"})
    system = {"role": "system", "content": "Answer with the number only."}
    rows.append({"prompt": [system, {"role": "user", "content": "Half of 7?"}], "answer": "3.5"})
    rows.append({"prompt": "Caf\u00e9 in Japanese?", "answer": "\u30ab\u30d5\u30a7"})
    return rows


def _messages(prompt) -> list[dict]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


@pytest.fixture(params=["byte", "chatml"])
def tokenizer_spec(request, tmp_path) -> str:
    """The byte tokenizer with its built-in template, or a tokenizer.json with ChatML."""
    if request.param == "byte":
        return "byte"
    return str(make_chat_tokenizer_dir(tmp_path / "tok"))


def test_each_row_is_one_window_that_gives_back_its_prompt_and_answer(tmp_path, tokenizer_spec):
    rows = _rows()
    source = write_conversations(tmp_path / "prompts.jsonl", rows)
    tokenizer, template = load_tokenizer(tokenizer_spec), load_chat_template(tokenizer_spec)
    meta = write_prompts_corpus([str(source)], str(tmp_path / "out"), tokenizer, template, SEQ)
    assert meta["format"] == "prompts" and is_prompts(meta)
    assert (meta["prompts"], meta["prompts_dropped"], meta["prompts_refused"]) == (15, 0, 0)
    assert meta["packed_seq_len"] == SEQ and meta["num_tokens"] == 15 * SEQ + 1
    dataset = MemoryMappedDataset(str(tmp_path / "out"), SEQ, document_masking=True)
    assert len(dataset) == 15
    # The prompt as generate --chat would give it to the model.
    config = load_config(None, [f"--data.tokenizer={tokenizer_spec}", "--model.vocab_size=300"])
    for index, row in enumerate(rows):
        sample = dataset[index]
        targets = (sample["labels"] != IGNORE_INDEX).nonzero().flatten()
        first = int(targets[0])
        # The targets are one run: the positions whose next token is an answer token.
        assert torch.equal(targets, torch.arange(first, first + len(targets)))
        expected = chat_prompt(
            tokenizer, config.model, config.data, _messages(row["prompt"]), max_new_tokens=1
        )
        assert sample["input_ids"][: first + 1].tolist() == expected.ids
        answer_ids = sample["labels"][targets].tolist()
        assert tokenizer.decode(answer_ids) == row["answer"]
        assert sample["input_ids"][first + 1 : first + 1 + len(answer_ids)].tolist() == answer_ids


def test_a_row_that_does_not_fit_is_dropped_and_counted(tmp_path):
    tokenizer, template = load_tokenizer("byte"), load_chat_template("byte")
    prompt_len = len(template.render(_messages("q"), add_generation_prompt=True).encode())
    fits = {"prompt": "q", "answer": "a" * (SEQ - prompt_len)}  # exactly a window
    rows = [fits, {"prompt": "q" * SEQ, "answer": "1"}, {**fits, "answer": fits["answer"] + "a"}]
    source = write_conversations(tmp_path / "prompts.jsonl", rows)
    for long_conversations in ("cut", "drop"):
        out = tmp_path / long_conversations
        argv = ["prepare-data", "--format", "prompts", "--input", str(source), "--output"]
        argv += [str(out), "--seq-len", str(SEQ), "--long-conversations", long_conversations]
        assert main(argv + ["--no-progress"]) == 0
        meta = json.loads((out / "meta.json").read_text())
        assert (meta["prompts"], meta["prompts_dropped"], meta["pad_tokens"]) == (1, 2, 1)
    with pytest.raises(DataError, match=r"no prompt to write \(3 dropped as longer than --seq-len"):
        write_prompts_corpus([str(source)], str(tmp_path / "none"), tokenizer, template, 40)


def test_a_prompt_the_template_refuses_is_skipped_or_stops_the_run(tmp_path):
    folder = make_chat_tokenizer_dir(tmp_path / "tok", REFUSING)
    tokenizer, template = load_tokenizer(str(folder)), load_chat_template(str(folder))
    rows = [{"prompt": "fine", "answer": "1"}, {"prompt": "a forbidden topic", "answer": "2"}]
    source = write_conversations(tmp_path / "prompts.jsonl", rows)
    meta = write_prompts_corpus([str(source)], str(tmp_path / "out"), tokenizer, template, SEQ)
    assert (meta["prompts"], meta["prompts_refused"]) == (1, 1)
    with pytest.raises(DataError, match=r"prompts.jsonl:2: the chat template .* no such topic"):
        write_prompts_corpus(
            [str(source)], str(tmp_path / "o2"), tokenizer, template, SEQ, stop_on_refused=True
        )


@pytest.mark.parametrize(
    ("row", "says"),
    [
        ({"prompt": "q"}, "needs 'prompt' and 'answer'; missing answer"),
        ({"answer": "1"}, "needs 'prompt' and 'answer'; missing prompt"),
        (["q", "1"], "missing prompt, answer"),
        ({"prompt": 7, "answer": "1"}, "'prompt' is int; expected a string"),
        ({"prompt": [{"role": "user"}], "answer": "1"}, "prompt: message 0 (user): content"),
        ({"prompt": "q", "answer": 42}, "'answer' is int; expected the reference answer"),
        ({"prompt": "q", "answer": " "}, "'answer' is an empty string"),
    ],
)
def test_a_bad_row_names_its_file_and_line(tmp_path, row, says):
    source = write_conversations(tmp_path / "prompts.jsonl", [{"prompt": "q", "answer": "1"}, row])
    with pytest.raises(DataError) as raised:
        write_prompts_corpus(
            [str(source)],
            str(tmp_path / "out"),
            load_tokenizer("byte"),
            load_chat_template("byte"),
            SEQ,
        )
    assert f"{source}:2: " in str(raised.value) and says in str(raised.value)
    assert not (tmp_path / "out" / "meta.json").exists()


def test_only_jsonl_is_read(tmp_path):
    text = tmp_path / "prompts.txt"
    text.write_text("What is 1 + 1?\n", encoding="utf-8")
    with pytest.raises(DataError, match="--format prompts reads .jsonl files"):
        write_prompts_corpus(
            [str(text)], str(tmp_path / "o"), load_tokenizer("byte"), load_chat_template("byte"), 8
        )


def test_cli_writes_a_prompt_set_and_refuses_what_does_not_go_with_it(tmp_path, capsys):
    source = write_conversations(tmp_path / "prompts.jsonl", _rows())
    base = ["prepare-data", "--format", "prompts", "--input", str(source), "--no-progress"]
    out = tmp_path / "out"
    assert main(base + ["--output", str(out), "--seq-len", str(SEQ)]) == 0
    summary = capsys.readouterr().out
    assert summary.startswith(f"prepared {15 * SEQ + 1:,} tokens in 15 documents (uint16) into")
    assert summary.rstrip().endswith(
        f"(15 prompts, one window of {SEQ} tokens each with "
        f"{json.loads((out / 'meta.json').read_text())['pad_tokens']:,} pad tokens; 0 dropped "
        "as longer; 0 refused by the chat template and skipped)"
    )
    whole = "does not go with --format prompts: a prompt set is written whole"
    refused = [
        (["--eval-fraction", "0.1", "--eval-output", "h"], f"--eval-fraction {whole}"),
        (["--shard-index", "0", "--num-shards", "2"], f"--shard-index {whole}"),
        (["--bos"], f"--bos {whole}"),
        (["--text-suffix", ".py"], "--text-suffix is about whole-file text documents"),
    ]
    for extra, says in refused:
        assert main(base + ["--output", str(tmp_path / "refused"), "--seq-len", "64"] + extra) == 2
        assert says in capsys.readouterr().err
    assert main(base + ["--output", str(tmp_path / "refused")]) == 2
    assert "--format prompts needs --seq-len N" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


def test_training_reads_prompts_one_window_each_at_their_seq_len(tmp_path):
    source = write_conversations(tmp_path / "prompts.jsonl", _rows())
    tokenizer, template = load_tokenizer("byte"), load_chat_template("byte")
    write_prompts_corpus([str(source)], str(tmp_path / "out"), tokenizer, template, SEQ)
    cfg = DataConfig(path=str(tmp_path / "out"), tokenizer="byte")
    pipeline = build_data_pipeline(cfg, seq_len=SEQ, batch_size=3, seed=0)
    assert isinstance(pipeline.sampler, ShardedSampler)
    batch = next(iter(pipeline.dataloader))  # type: ignore[arg-type]
    assert batch["input_ids"].shape == (3, SEQ)
    assert np.all((batch["labels"] != IGNORE_INDEX).sum(dim=1).numpy() > 0)
    with pytest.raises(DataError) as raised:
        build_data_pipeline(cfg, seq_len=SEQ // 2, batch_size=3, seed=0)
    assert str(raised.value) == (
        f"{tmp_path / 'out'}: a prompts corpus prepared with --seq-len {SEQ} holds one prompt "
        f"and its answer per window of {SEQ} tokens, but train.seq_len is {SEQ // 2}; train "
        f"with --train.seq_len={SEQ} or prepare it again with --seq-len {SEQ // 2}"
    )
