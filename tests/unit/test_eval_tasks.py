"""Downstream tasks on one process: the task files, the packed windows, and the scorer's
metrics (a model that learnt a corpus of facts answers its questions; bits per byte of a
byte-level model is its loss in bits)."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
import torch.nn.functional as F

from kempnerforge.config.eval import EvalTaskConfig
from kempnerforge.config.loader import load_config
from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError, DataError
from kempnerforge.data.dataset import IGNORE_INDEX
from kempnerforge.data.tokenizer import ByteTokenizer
from kempnerforge.evaluation.document_start import DocumentStart
from kempnerforge.evaluation.scoring import whole_model_losses
from kempnerforge.evaluation.task_files import read_choice_examples, read_documents
from kempnerforge.evaluation.tasks import evaluate_task, load_task, prompted_examples
from kempnerforge.evaluation.windows import Request, pack_requests, rolling_requests
from kempnerforge.model.transformer import build_model
from tests.support.tolerance import assert_layout_close

BYTES = ByteTokenizer()


def _write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _score(model, task: EvalTaskConfig, seq_len: int, rows: int = 4) -> dict[str, float]:
    loaded = load_task(task, BYTES, DocumentStart.of(BYTES, bos=True), seq_len)
    cpu = torch.device("cpu")
    losses = whole_model_losses(model, cpu, loss_chunk_tokens=0)
    return evaluate_task(
        model, loaded, losses, device=cpu, global_batch=rows, rows_per_forward=rows
    )


# --- task files ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("not json", "not JSON"),
        ('{"context": 1, "choices": ["a", "b"], "gold": 0}', 'a string "context"'),
        ('{"context": "c", "choices": ["a"], "gold": 0}', "2 or more non-empty strings"),
        ('{"context": "c", "choices": ["a", "b"], "gold": 2}', "index of the right choice"),
        ('{"context": "c", "choices": ["a", "b"], "gold": true}', "index of the right choice"),
        ('{"context": "c", "choices": ["a", "b"], "gold": 0, "subject": ""}', '"subject", a non'),
        ('{"context": "c", "choices": ["a", "b"], "gold": 0, "description": 1}', '"description"'),
    ],
)
def test_a_malformed_example_names_its_file_and_line(tmp_path, line, problem):
    path = tmp_path / "task.jsonl"
    path.write_text('{"context": "c", "choices": [" a", " b"], "gold": 1}\n\n' + line + "\n")
    with pytest.raises(DataError, match=rf"task.jsonl, line 3: .*{problem}"):
        read_choice_examples(str(path))


def test_limit_reads_the_first_examples_and_a_text_file_is_one_document(tmp_path):
    records = [{"context": f"q{i}", "choices": [" a", " b"], "gold": i % 2} for i in range(5)]
    examples = read_choice_examples(_write_jsonl(tmp_path / "mc.jsonl", records), limit=2)
    assert [e.context for e in examples] == ["q0", "q1"] and examples[1].gold == 1
    text = tmp_path / "book.txt"
    text.write_text("one\ntwo\n")
    assert read_documents(str(text)) == ["one\ntwo\n"]
    docs = _write_jsonl(tmp_path / "docs.jsonl", [{"text": "x"}, {"text": "yz"}])
    assert read_documents(docs, limit=1) == ["x"]
    with pytest.raises(DataError, match="missing.txt: no such file"):
        read_documents(str(tmp_path / "missing.txt"))


def test_few_shot_examples_are_those_of_the_examples_subject(tmp_path):
    """The description once, then the first k solved examples of the example's own subject
    (those without one for an example without one), then its context; a subject with
    fewer than k is refused naming the file and the subject."""

    def example(context: str, subject: str | None, gold: int = 0) -> dict:
        record = {"context": context, "choices": [" A", " B"], "gold": gold}
        return record if subject is None else {**record, "subject": subject}

    shots = [
        example("a1", "alg"),
        example("b1", "bio", 1),
        example("a2", "alg", 1),
        example("n1", None),
        example("b2", "bio"),
        example("a3", "alg"),
    ]
    tests = [
        {**example("qa", "alg"), "description": "Algebra.\n\n"},
        example("qb", "bio"),
        example("qn", None),
    ]
    shots_path = _write_jsonl(tmp_path / "shots.jsonl", shots)
    task = EvalTaskConfig(
        name="t", path=_write_jsonl(tmp_path / "t.jsonl", tests), fewshot_path=shots_path
    )
    task.num_fewshot = 1
    assert [e.context for e in prompted_examples(task)] == [
        "Algebra.\n\na1 A\n\nqa",
        "b1 B\n\nqb",
        "n1 A\n\nqn",
    ]
    task.num_fewshot = 2
    with pytest.raises(DataError, match=r"shots.jsonl: 1 solved example\(s\) without a subject"):
        prompted_examples(task)
    task.num_fewshot, task.path = 3, _write_jsonl(tmp_path / "u.jsonl", tests[1:2])
    with pytest.raises(DataError, match='shots.jsonl: 2 solved example.*of subject "bio", num'):
        prompted_examples(task)


def test_task_tables_are_checked_when_the_config_loads():
    def load(*overrides: str):
        return load_config(None, [f"--eval.tasks=[{{{', '.join(overrides)}}}]"])

    assert load('name = "arc"', 'path = "arc.jsonl"').eval.tasks[0].kind == "multiple_choice"
    with pytest.raises(ConfigError, match=r"eval.tasks\[0\].kind = 'mcq'"):
        load('name = "arc"', 'path = "a"', 'kind = "mcq"')
    with pytest.raises(ConfigError, match=r"eval.tasks\[0\].path = '': expected a task file"):
        load('name = "arc"')
    with pytest.raises(ConfigError, match="num_fewshot"):
        load('name = "arc"', 'path = "a"', "num_fewshot = 5")
    with pytest.raises(ConfigError, match="num_fewshot"):
        load(
            'name = "b"',
            'path = "a"',
            'kind = "bits_per_byte"',
            'fewshot_path = "s"',
            "num_fewshot = 1",
        )


# --- windows -----------------------------------------------------------------------------


def test_requests_pack_in_order_each_its_own_document_with_its_tail_scored():
    requests = [
        Request([1, 2, 3, 4], 2, slot=0),  # reads 1 2 3, scores 3 4
        Request([5, 6, 7], 1, slot=1),  # reads 5 6, scores 6 7
        Request([8, 9, 10, 11, 12, 13], 5, slot=2),  # does not fit: a new row, scores 13
    ]
    windows = pack_requests(requests, seq_len=6, pad_id=0)
    assert windows.rows == 2 and windows.truncated == 0
    assert windows.input_ids.tolist() == [[1, 2, 3, 5, 6, 0], [8, 9, 10, 11, 12, 0]]
    ignore = IGNORE_INDEX
    assert windows.labels.tolist() == [
        [ignore, 3, 4, 6, 7, ignore],
        [ignore, ignore, ignore, ignore, 13, ignore],
    ]
    assert windows.slots.tolist() == [[-1, 0, 0, 1, 1, -1], [-1, -1, -1, -1, 2, -1]]
    assert windows.doc_ids.tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 0, 1]]


def test_unpacked_requests_take_a_row_each():
    requests = [Request([1, 2, 3], 1, slot=0), Request([4, 5], 1, slot=1)]
    windows = pack_requests(requests, seq_len=6, pad_id=0, packed=False)
    assert windows.input_ids.tolist() == [[1, 2, 0, 0, 0, 0], [4, 0, 0, 0, 0, 0]]
    assert windows.slots.tolist() == [[0, 0, -1, -1, -1, -1], [1, -1, -1, -1, -1, -1]]


def test_a_request_longer_than_the_window_loses_its_left():
    windows = pack_requests([Request(list(range(1, 11)), 7, slot=0)], seq_len=4, pad_id=0)
    assert windows.truncated == 1
    assert windows.input_ids.tolist() == [[6, 7, 8, 9]]
    assert windows.labels.tolist() == [[IGNORE_INDEX, 8, 9, 10]]  # the scored 8, 9, 10 kept


@pytest.mark.parametrize("length", [2, 5, 9, 10, 11, 40])
def test_rolling_requests_score_every_token_once_within_the_window(length):
    tokens = list(range(100, 100 + length))
    requests = rolling_requests(tokens, seq_len=8, slot=0)
    scored = [t for r in requests for t in r.tokens[r.first_scored :]]
    assert scored == tokens[1:]
    assert all(len(r.tokens) <= 9 and r.first_scored >= 1 for r in requests)
    assert all(r.first_scored > 1 or i == 0 for i, r in enumerate(requests))  # later: context


# --- metrics -----------------------------------------------------------------------------


def test_bits_per_byte_of_a_byte_level_model_is_its_loss_in_bits(tmp_path):
    """One token per byte: bpb = the mean loss per predicted byte / ln 2, the same as the
    loss of the document read as one sequence (within fp32 reordering: the packed window
    pads and masks around it)."""
    config = load_config("configs/train/debug.toml")
    torch.manual_seed(0)
    model = build_model(config.model).eval()
    text = "def add(a, b):\n    return a + b\n" * 3
    path = tmp_path / "code.txt"
    path.write_text(text)
    task = EvalTaskConfig(name="code", path=str(path), kind="bits_per_byte")
    metrics = _score(model, task, seq_len=config.train.seq_len)
    assert metrics["eval/code/bytes"] == metrics["eval/code/tokens"] == len(text)
    ids = torch.tensor([[BYTES.bos_id, *BYTES.encode(text)]])
    with torch.no_grad():
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[0, 1:]).item()
    got = metrics["eval/code/bpb"] * math.log(2)
    assert_layout_close(
        [got], [loss], cfg=config.model, seq_len=config.train.seq_len, tokens=len(text)
    )


def _facts(count: int, seed: int) -> tuple[list[str], list[dict]]:
    """Made-up people and the towns they live in: the sentences, and a question per person
    with the true town and three others."""
    rng = random.Random(seed)

    def word() -> str:
        return "".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(2))

    people = [word().capitalize() for _ in range(count)]
    towns = [word().capitalize() for _ in range(count)]
    sentences = [f"{p} lives in {t}." for p, t in zip(people, towns, strict=True)]
    questions = []
    for i, person in enumerate(people):
        others = rng.sample([t for t in towns if t != towns[i]], 3)
        choices = [towns[i], *others]
        rng.shuffle(choices)
        questions.append(
            {
                "context": f"{person} lives in",
                "choices": [f" {c}." for c in choices],
                "gold": choices.index(towns[i]),
            }
        )
    return sentences, questions


def test_a_model_that_learnt_the_facts_answers_their_questions_and_an_untrained_one_guesses(
    tmp_path,
):
    """16 facts, 4 choices each: chance is 0.25. The untrained model stays near it; after
    training on the sentences the scorer finds the true town for (nearly) every person."""
    sentences, questions = _facts(16, seed=3)
    task = EvalTaskConfig(name="facts", path=_write_jsonl(tmp_path / "facts.jsonl", questions))
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, vocab_size=BYTES.vocab_size, max_seq_len=64)
    torch.manual_seed(0)
    model = build_model(cfg)
    before = _score(model, task, seq_len=64)["eval/facts/acc"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(0)
    for _ in range(300):
        batch = [[BYTES.bos_id, *BYTES.encode(rng.choice(sentences))] for _ in range(16)]
        width = max(map(len, batch))
        ids = torch.tensor([row + [BYTES.pad_id] * (width - len(row)) for row in batch])
        labels = ids[:, 1:].masked_fill(ids[:, 1:] == BYTES.pad_id, IGNORE_INDEX)
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), labels.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = _score(model, task, seq_len=64)
    assert before <= 0.5, before
    assert after["eval/facts/acc"] >= 0.9, after
    assert after["eval/facts/examples"] == 16


def test_scores_do_not_depend_on_the_batch_rows(tmp_path):
    """The windows are fixed by the requests and seq_len: scoring them 1 or 5 rows at a
    time gives the same accuracies."""
    _, questions = _facts(12, seed=5)
    mc = EvalTaskConfig(name="mc", path=_write_jsonl(tmp_path / "mc.jsonl", questions))
    torch.manual_seed(1)
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=2, vocab_size=BYTES.vocab_size, max_seq_len=32)
    model = build_model(cfg)
    one, five = _score(model, mc, 32, rows=1), _score(model, mc, 32, rows=5)
    assert one["eval/mc/acc"] == five["eval/mc/acc"]
    assert one["eval/mc/acc_norm"] == five["eval/mc/acc_norm"]
