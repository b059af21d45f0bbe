"""End to end: training on conversations. Pretraining text then fine-tuning on chat in one
run, switched by a phase and resumed exactly across the switch; and every parallel layout
on a chat corpus equal to one process (check-parallel)."""

from __future__ import annotations

import json
import pathlib
import re

import numpy as np
import pytest

from kempnerforge.data.chat.packing import Packing
from kempnerforge.data.chat.template import byte_chat_template
from kempnerforge.data.dataset import IGNORE_INDEX, MemoryMappedDataset
from kempnerforge.data.prepare.corpus import prepare_data
from kempnerforge.data.tokenizer import ByteTokenizer
from tests.e2e.test_check_parallel import (
    DEBUG,
    TINY,
    assert_every_layout_passes,
    run_check_parallel,
)
from tests.support.chat_files import write_conversations
from tests.support.metrics_rows import read_rows
from tests.support.tiny import tiny_run
from tests.support.train_run import train_steps

pytestmark = pytest.mark.slow

WORDS = ["amber", "birch", "cedar", "delta", "ember", "fjord", "grove", "heron", "iris", "jade"]


def conversations(count: int, seed: int = 0) -> list[dict]:
    """Small multi-turn conversations: a system turn, then the user asks for words repeated."""
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(count):
        a, b = rng.choice(WORDS, 2)
        records.append(
            {
                "messages": [
                    {"role": "system", "content": "Repeat."},
                    {"role": "user", "content": f"say {a}"},
                    {"role": "assistant", "content": f"{a} {a}"},
                    {"role": "user", "content": f"say {b}"},
                    {"role": "assistant", "content": f"{b} {b}"},
                ]
            }
        )
    return records


SEQ_LEN = 128
"""Windows the chat corpora are packed into and trained with: a conversation is about 110
tokens."""
CHAT_RUN = [f"--train.seq_len={SEQ_LEN}", f"--model.max_seq_len={SEQ_LEN}"]


def write_chat_corpus(path: pathlib.Path, records: list[dict]) -> str:
    """A chat corpus of ``records`` prepared with the byte tokenizer's template, packed
    into windows of SEQ_LEN tokens."""
    source = write_conversations(path.with_suffix(".jsonl"), records)
    prepare_data(
        [str(source)],
        str(path),
        ByteTokenizer(),
        chat_template=byte_chat_template(),
        packing=Packing(SEQ_LEN),
    )
    return str(path)


@pytest.fixture(scope="module")
def chat_dirs(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("chat")
    return (
        write_chat_corpus(root / "train", conversations(300, seed=0)),
        write_chat_corpus(root / "eval", conversations(30, seed=1)),
    )


def test_a_prepared_chat_corpus_holds_whole_conversations_in_every_window(chat_dirs):
    """Every document of every window is a whole conversation (both replies supervised,
    each with its end-of-turn) or padding (nothing supervised)."""
    dataset = MemoryMappedDataset(chat_dirs[0], SEQ_LEN)
    eos = ByteTokenizer().eos_id
    conversations_seen = 0
    for index in range(len(dataset)):
        window = dataset[index]
        supervised = window["labels"] != IGNORE_INDEX
        for doc in window["doc_ids"].unique().tolist():
            targets = window["labels"][supervised & (window["doc_ids"] == doc)].tolist()
            if not targets:
                continue  # a pad run
            replies = bytes(t if t != eos else ord("|") for t in targets).decode().split("|")
            assert len(replies) == 3 and replies[2] == "", replies  # two turns, each ended
            assert all(re.fullmatch(r"(\w+) \1", reply) for reply in replies[:2]), replies
            conversations_seen += 1
    assert conversations_seen == 300


def _supervised_per_window(dataset: MemoryMappedDataset) -> list[int]:
    return [int((dataset[i]["labels"] != IGNORE_INDEX).sum()) for i in range(len(dataset))]


def _epoch_supervised_tokens(run_dir: pathlib.Path, corpus: str, batch_size: int, *extra):
    """supervised_tokens summed over the steps of one epoch, each step logged."""
    num_windows = len(MemoryMappedDataset(corpus, SEQ_LEN))
    steps = num_windows // batch_size  # whole batches only: the rest waits for no epoch
    overrides = tiny_run(
        run_dir,
        (corpus, ""),
        *CHAT_RUN,
        f"--train.batch_size={batch_size}",
        f"--train.max_steps={steps}",
        "--metrics.log_interval=1",
        *extra,
    )
    train_steps(overrides)
    rows = [r for r in read_rows(run_dir) if "loss" in r and "event" not in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    return sum(r["supervised_tokens"] for r in rows)


def test_an_epochs_supervised_tokens_are_the_assistant_tokens_of_the_windows_it_reads(
    chat_dirs, tmp_path
):
    """docs/training.md: summed over an epoch, supervised_tokens is meta.json's
    assistant_tokens when the global batch divides the windows; otherwise the epoch leaves
    out the windows of its last, partial batch, and their assistant tokens with them."""
    small = write_chat_corpus(tmp_path / "small", conversations(22, seed=2))
    dataset = MemoryMappedDataset(small, SEQ_LEN)
    per_window = _supervised_per_window(dataset)
    assistant = json.loads((pathlib.Path(small) / "meta.json").read_text())["assistant_tokens"]
    # Every assistant token is a label exactly once: in its window, never across one.
    assert sum(per_window) == assistant
    num_windows = len(per_window)
    divisor = next(b for b in range(2, num_windows + 1) if num_windows % b == 0)
    assert _epoch_supervised_tokens(tmp_path / "whole", small, divisor) == assistant
    # In order (data.shuffle = false), the windows left out are the last ones.
    partial = next(b for b in range(2, num_windows) if num_windows % b)
    read = num_windows // partial * partial
    got = _epoch_supervised_tokens(tmp_path / "part", small, partial, "--data.shuffle=false")
    assert got == sum(per_window[:read]) < assistant


def phased_config(path: pathlib.Path, text: str, chat: str, switch_at: int) -> str:
    """Text alone until ``switch_at``, then the chat corpus alone, at a lower LR."""
    path.write_text(
        "\n".join(
            [
                "[[data.datasets]]",
                'name = "text"',
                f"path = {json.dumps(text)}",
                "weight = 1.0",
                "[[data.datasets]]",
                'name = "chat"',
                f"path = {json.dumps(chat)}",
                "weight = 0.0",
                "[[train.phases]]",
                f"start_step = {switch_at}",
                "dataset_weights = { text = 0.0, chat = 1.0 }",
                "lr_scale = 0.5",
                "",
            ]
        )
    )
    return str(path)


def test_pretraining_then_fine_tuning_on_chat_in_one_run_resumes_exactly(
    token_dirs, chat_dirs, tmp_path
):
    config = phased_config(tmp_path / "job.toml", token_dirs[0], chat_dirs[0], switch_at=4)

    def run(run_dir: pathlib.Path, *extra: str, stop_after: int | None = None):
        overrides = tiny_run(
            run_dir, None, "--train.max_steps=8", "--checkpoint.interval=3", *CHAT_RUN, *extra
        )
        return train_steps(overrides, config_path=config, stop_after=stop_after)

    whole = run(tmp_path / "whole")
    sources = [set(losses) for losses in whole["dataset_losses"]]
    assert sources == [{"text"}] * 4 + [{"chat"}] * 4  # the phase switched the source
    # Text trains on nearly every position, chat on the assistant's tokens only.
    rows = [r for r in read_rows(tmp_path / "whole") if "loss" in r and "event" not in r]
    supervised = [r["supervised_tokens"] for r in rows]
    assert all(n > 0.9 * 4 * SEQ_LEN for n in supervised[:4])
    assert all(0 < n < 0.5 * 4 * SEQ_LEN for n in supervised[4:])
    # Stopped after step 5 (the stop saves, as a preemption does, one step after the switch)
    # and resumed: the same losses bit for bit, the chat phase still in force.
    run(tmp_path / "split", stop_after=5)
    resumed = run(tmp_path / "split", "--train.use_existing_dir=true")
    assert resumed["start_step"] == 5
    assert resumed["losses"] == whole["losses"][5:]


def test_every_layout_on_a_chat_corpus_trains_as_one_process(chat_dirs, tmp_path):
    """FSDP, tensor, pipeline and context parallelism on conversations: the loss mask and
    the conversations' own document ends reach every rank's share of the batch."""
    worlds = {"dp_shard=2": "2", "tp=2": "2", "pp=2": "2", "cp=2": "2"}
    data = [f"--data.path={chat_dirs[0]}", f"--data.eval_path={chat_dirs[1]}"]
    argv = [DEBUG, "--layouts", *worlds, "--steps", "3", *TINY, *CHAT_RUN, *data]
    proc = run_check_parallel(argv, tmp_path, tmp_path / "cache")
    assert_every_layout_passes(proc, worlds)
