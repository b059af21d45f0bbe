"""The lm-evaluation-harness adapter against the harness itself, offline: its rolling
log-likelihoods equal the harness's own Hugging Face model (HFLM) over the exported
checkpoint, and a converted MMLU task renders the harness's own mmlu prompts (its installed
task files over a local copy of the data) and reports its accuracies, per subject and for
the group. The native bits_per_byte task keeps its overlapping windows, which differ."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lm_eval")  # a guard: CI installs lm-eval through the dev extra
pytest.importorskip("accelerate")  # the harness's HF model needs it: the lm-eval extra has it
pytest.importorskip("transformers")

import datasets  # noqa: E402
import huggingface_hub  # noqa: E402
import lm_eval  # noqa: E402
import yaml  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager, get_task_dict  # noqa: E402

from kempnerforge.checkpoint.manager import CheckpointManager  # noqa: E402
from kempnerforge.config.eval import EvalTaskConfig  # noqa: E402
from kempnerforge.config.loader import config_to_dict, load_config, save_config  # noqa: E402
from kempnerforge.data.prepare import prepare_data  # noqa: E402
from kempnerforge.data.tokenizer import load_tokenizer  # noqa: E402
from kempnerforge.evaluation.converters import convert_mmlu, write_examples  # noqa: E402
from kempnerforge.evaluation.scoring import slot_sums, whole_model_losses  # noqa: E402
from kempnerforge.evaluation.tasks import (  # noqa: E402
    LoadedTask,
    load_task,
    prompted_examples,
    task_metrics,
)
from kempnerforge.interop.hf import export_hf  # noqa: E402
from kempnerforge.interop.lm_eval import KempnerForgeLM  # noqa: E402
from kempnerforge.model.transformer import Transformer  # noqa: E402
from tests.conftest import synthetic_documents  # noqa: E402
from tests.support.data_files import make_hf_tokenizer, write_jsonl  # noqa: E402
from tests.support.tiny import tiny_run  # noqa: E402
from tests.support.tolerance import reorder_atol, transformer_terms  # noqa: E402

SEQ_LEN = 512
INSTALLED_MMLU = Path(lm_eval.__file__).parent / "tasks" / "mmlu" / "default"
MMLU_ROWS = {"astronomy": 3, "high_school_physics": 7}
"""Test questions per subject (sizes differ, so a mean of the subjects' accuracies is not the
accuracy over all questions); each subject has 5 dev questions, as MMLU has."""


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """No download (see test_lm_eval_adapter._offline)."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, Path, Transformer]:
    """A random Llama-shaped model over a BPE tokenizer, its run's data prepared with a BOS
    per document: the run directory (its checkpoint, windows of SEQ_LEN), the model
    exported for transformers, and the model. A wide init (0.1) makes each prediction lean
    on its context."""
    root = tmp_path_factory.mktemp("harness")
    tokenizer_path = make_hf_tokenizer(root / "tokenizer" / "tokenizer.json")
    tokenizer = load_tokenizer(tokenizer_path)
    source = write_jsonl(root / "docs.jsonl", synthetic_documents(100))
    train = str(root / "train")
    prepare_data([str(source)], train, tokenizer, bos_per_document=True)
    overrides = tiny_run(
        root / "run",
        (train, ""),  # no eval set: the adapter reads the BOS from the training data
        f"--data.tokenizer={tokenizer_path}",
        f"--model.vocab_size={tokenizer.vocab_size}",
        f"--model.max_seq_len={SEQ_LEN}",
        f"--train.seq_len={SEQ_LEN}",
        "--model.init_std=0.1",
    )
    config = load_config(None, overrides)
    model = Transformer(config.model)
    model.init_weights(0)
    model.eval()
    run = Path(config.run_dir)
    run.mkdir(parents=True)
    save_config(config, str(run / "config.toml"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    extra = {"step": 1, "config": config_to_dict(config)}
    CheckpointManager(config.checkpoint, config.checkpoint_dir).save(
        1, model=model, optimizer=optimizer, scheduler=scheduler, train_state={"extra": extra}
    )
    folder = export_hf(
        model, config.model, root / "hf", tokenizer_path=tokenizer_path, model_type="llama"
    )
    return run, folder, model


def _models(checkpoint: tuple[Path, Path, Transformer], window: int) -> tuple[KempnerForgeLM, HFLM]:
    """The adapter over the checkpoint and the harness's HF model over its export, both
    reading windows of ``window`` tokens (train.seq_len; the harness's max_length)."""
    run, folder, _ = checkpoint
    ours = KempnerForgeLM(checkpoint=str(run), batch_size=4, overrides=f"--train.seq_len={window}")
    theirs = HFLM(
        pretrained=str(folder), device="cpu", batch_size=4, max_length=window, dtype="float32"
    )
    return ours, theirs


def _requests(*args: tuple) -> list[SimpleNamespace]:
    return [SimpleNamespace(args=a) for a in args]


def _texts() -> list[str]:
    """Documents of 0 to about 1,300 tokens."""
    short = synthetic_documents(12, seed=5)
    return [*short[:6], "".join(short), "".join(short[6:]) * 2, "x", ""]


def test_the_adapter_starts_texts_as_the_harness_hf_model_does(checkpoint):
    ours, theirs = _models(checkpoint, SEQ_LEN)
    assert ours.lm.start.ids == (theirs.prefix_token_id,) == (ours.lm.tokenizer.bos_id,)
    assert ours.lm.seq_len == theirs.max_length == SEQ_LEN
    text = _texts()[6]
    assert theirs.tok_encode(text) == ours.lm.tokenizer.encode(text)


def test_rolling_loglikelihood_equals_the_harness_hf_model(checkpoint, tmp_path):
    """Each text's log-likelihood is the HF model's in the harness (its disjoint windows:
    the first after BOS, each later one after the token before it), in windows of 32
    tokens: documents of up to 41 windows.

    The two run the same windows through two implementations: each token's
    log-probability may differ by a reordering of the forward's sums (transformer_terms,
    at the largest |logit|), twice over (the logit and the log-sum-exp), and the harness
    sums a window's log-probabilities in fp32 (window terms at the text's |sum|)."""
    window = 32
    ours, theirs = _models(checkpoint, window)
    model = checkpoint[2]
    texts = _texts()
    got = ours.loglikelihood_rolling(_requests(*[(t,) for t in texts]))
    want = theirs.loglikelihood_rolling(_requests(*[(t,) for t in texts]), disable_tqdm=True)
    lengths = [len(ours.lm.tokenizer.encode(t)) for t in texts]
    assert max(lengths) > 40 * window and min(lengths) == 0
    magnitude = _largest_logit(model, ours.lm.tokenizer.encode(texts[6])[:window])
    per_token = 2 * reorder_atol(
        torch.float32, transformer_terms(model.cfg, window, backward=False), magnitude
    )
    bounds = [
        n * per_token + reorder_atol(torch.float32, window, abs(b))
        for n, b in zip(lengths, want, strict=True)
    ]
    for text_len, a, b, bound in zip(lengths, got, want, bounds, strict=True):
        assert abs(a - b) <= bound, (text_len, a, b, bound)
    assert got[-1] == want[-1] == 0.0
    # The native bits_per_byte task (`eval --tasks`) reads the same tokens in overlapping
    # windows, every later one with half a window of context: the same sums for a text
    # within one window, other ones past it (here the two longest by 2 and 27 nats).
    native = -_native_sums(ours, tmp_path, texts)[:, 0]
    for text_len, a, b, bound in zip(lengths, native.tolist(), want, bounds, strict=True):
        if text_len <= window:
            assert abs(a - b) <= bound, (text_len, a, b, bound)
        elif text_len > 20 * window:
            assert abs(a - b) > bound, (text_len, a, b, bound)


def _largest_logit(model: Transformer, ids: list[int]) -> float:
    """The largest |logit| over a window of text: the scale of the forward's sums."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]))
    assert isinstance(logits, torch.Tensor)
    return logits.abs().max().item()


def _native(lm: KempnerForgeLM, task: EvalTaskConfig) -> tuple[LoadedTask, torch.Tensor]:
    """The native task loaded for the adapter's model, and its slot sums (nll, tokens)."""
    loaded = load_task(task, lm.lm.tokenizer, lm.lm.start, lm.lm.seq_len)
    sums = slot_sums(
        lm.lm.model,
        loaded.windows,
        loaded.slots,
        whole_model_losses(lm.lm.model, lm.lm.device, 2048),
        device=lm.lm.device,
        global_batch=4,
        rows_per_forward=4,
    )
    return loaded, sums


def _native_sums(lm: KempnerForgeLM, directory: Path, texts: list[str]) -> torch.Tensor:
    path = directory / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    task = EvalTaskConfig(name="docs", path=str(path), kind="bits_per_byte")
    return _native(lm, task)[1]


# MMLU: a small release in MMLU's CSV layout, converted by convert-task, against the
# harness's installed mmlu task files over the same questions in the hub's columns.


def _mmlu_rows(subject: str, split: str, count: int) -> list[list[str]]:
    """Rows as MMLU's CSV files hold them: question, four options, the answer letter; a
    question with surrounding spaces and a comma, an option with a comma."""
    return [
        [
            f" {split} {subject[:4]} {i}, which? ",
            f"a{i}",
            f"b, {i}",
            f"c{i}",
            f"d{i}",
            "ABCD"[i % 4],
        ]
        for i in range(count)
    ]


def _write_mmlu(root: Path) -> tuple[str, str, TaskManager]:
    """The converted test and dev task files, and a harness TaskManager that knows the
    group "kf_mmlu" of one task per subject: each the installed mmlu task of its subject
    (its prompt, description, few-shot split and sampler) over a local copy of the rows,
    the group aggregated as the installed group "mmlu" is."""
    tasks = root / "harness"
    tasks.mkdir(parents=True)
    for subject, count in MMLU_ROWS.items():
        for split, rows in (("test", count), ("dev", 5)):
            folder = root / "data" / split
            folder.mkdir(parents=True, exist_ok=True)
            with (folder / f"{subject}_{split}.csv").open("w", newline="") as out:
                csv.writer(out).writerows(_mmlu_rows(subject, split, rows))
            hub = [
                {"question": q, "subject": subject, "choices": options, "answer": "ABCD".index(a)}
                for q, *options, a in _mmlu_rows(subject, split, rows)
            ]
            (tasks / f"{subject}_{split}.jsonl").write_text(
                "".join(json.dumps(row) + "\n" for row in hub)
            )
        files = {split: str(tasks / f"{subject}_{split}.jsonl") for split in ("test", "dev")}
        (tasks / f"kf_mmlu_{subject}.yaml").write_text(
            yaml.safe_dump(
                {
                    "include": str(INSTALLED_MMLU / f"mmlu_{subject}.yaml"),
                    "task": f"kf_mmlu_{subject}",
                    "tag": [],
                    "dataset_path": "json",
                    "dataset_name": None,
                    "dataset_kwargs": {"data_files": files, "cache_dir": str(tasks / "hf")},
                }
            )
        )
    group = yaml.safe_load((INSTALLED_MMLU / "_mmlu.yaml").read_text())
    group.update(group="kf_mmlu", task=[f"kf_mmlu_{subject}" for subject in MMLU_ROWS])
    (tasks / "kf_mmlu.yaml").write_text(yaml.safe_dump(group))
    converted = []
    for split in ("test", "dev"):
        path = root / f"mmlu_{split}.jsonl"
        write_examples(convert_mmlu([root / "data" / split]), path)
        converted.append(str(path))
    return converted[0], converted[1], TaskManager(include_path=str(tasks), include_defaults=False)


def _harness_tasks(names: list[str], manager: TaskManager) -> dict:
    """The harness's task objects by name: TaskManager.load where the harness has it,
    get_task_dict in the older ones."""
    if hasattr(manager, "load"):
        return manager.load(names)["tasks"]
    return get_task_dict(names, manager)


@pytest.mark.parametrize("shots", [0, 5])
def test_converted_mmlu_prompts_are_the_harness_mmlu_prompts(tmp_path, shots):
    """Each question's prompt is the one the harness's mmlu task renders for it: the
    subject's header once, the first `shots` dev questions of its own subject each with
    its answer, then the question; its choices the harness's continuations."""
    test, dev, manager = _write_mmlu(tmp_path)
    task = EvalTaskConfig(
        name="mmlu", path=test, fewshot_path=dev if shots else "", num_fewshot=shots
    )
    ours = prompted_examples(task)
    harness = _harness_tasks([f"kf_mmlu_{subject}" for subject in MMLU_ROWS], manager)
    rendered = []
    for subject in sorted(MMLU_ROWS):  # the converter reads a folder's files sorted
        their_task = harness[f"kf_mmlu_{subject}"]
        delimiter = their_task.config.target_delimiter
        for doc in their_task.test_docs():
            choices = tuple(delimiter + c for c in their_task.doc_to_choice(doc))
            context = their_task.fewshot_context(doc, shots)
            rendered.append((context, choices, their_task.doc_to_target(doc), subject))
    assert [(e.context, e.choices, e.gold, e.subject) for e in ours] == rendered
    assert len(ours) == sum(MMLU_ROWS.values())


def test_mmlu_accuracies_are_the_harness_mmlu_accuracies(checkpoint, tmp_path):
    """5-shot, the harness's evaluator over the adapter scores its group (each subject's
    task and the group, aggregated as its mmlu group is: weighted by the subjects' sizes)
    as the native task scores the converted files: acc/<subject> per subject, acc over
    all questions."""
    test, dev, manager = _write_mmlu(tmp_path)
    ours, _ = _models(checkpoint, SEQ_LEN)
    results = lm_eval.simple_evaluate(
        model=ours,
        tasks=["kf_mmlu"],
        num_fewshot=5,
        task_manager=manager,
        bootstrap_iters=0,
        log_samples=False,
        random_seed=None,
        numpy_random_seed=None,
        torch_random_seed=None,
    )
    assert results is not None
    task = EvalTaskConfig(name="mmlu", path=test, fewshot_path=dev, num_fewshot=5)
    loaded, sums = _native(ours, task)
    assert loaded.windows.truncated == 0  # the whole prompts are scored
    native = task_metrics(loaded, sums)
    scores = results["results"]
    for subject in MMLU_ROWS:
        assert scores[f"kf_mmlu_{subject}"]["acc,none"] == native[f"eval/mmlu/acc/{subject}"]
    # A weighted mean of two accuracies in float64 against count / total: a few ulps.
    assert scores["kf_mmlu"]["acc,none"] == pytest.approx(
        native["eval/mmlu/acc"], rel=1e-15, abs=1e-15
    )
