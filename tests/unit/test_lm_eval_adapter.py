"""The lm-evaluation-harness adapter over a saved checkpoint: its log-likelihoods are the
native task scorer's, a harness task over a local file runs offline through the harness's
own evaluator to the native accuracy, a text within one window has the native bits per
byte's sum, and generation stops at the stop string. Nothing is downloaded. (Against the
harness's own Hugging Face model: test_lm_eval_harness.py.)"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval")  # a guard: CI installs lm-eval through the dev extra

import datasets  # noqa: E402
import huggingface_hub  # noqa: E402
import lm_eval  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from kempnerforge.checkpoint.manager import CheckpointManager  # noqa: E402
from kempnerforge.config.eval import EvalTaskConfig  # noqa: E402
from kempnerforge.config.job import JobConfig  # noqa: E402
from kempnerforge.config.loader import config_to_dict, load_config, save_config  # noqa: E402
from kempnerforge.data.dataset import IGNORE_INDEX  # noqa: E402
from kempnerforge.data.tokenizer import ByteTokenizer  # noqa: E402
from kempnerforge.evaluation.scoring import slot_sums, whole_model_losses  # noqa: E402
from kempnerforge.evaluation.tasks import (  # noqa: E402
    LoadedTask,
    load_task,
    task_metrics,
)
from kempnerforge.interop.lm_eval import KempnerForgeLM, register  # noqa: E402
from kempnerforge.model import build_model  # noqa: E402
from tests.support.tiny import tiny_run  # noqa: E402
from tests.support.tolerance import assert_reordered_close  # noqa: E402
from tests.unit.test_eval_tasks import _facts  # noqa: E402

BYTES = ByteTokenizer()
TRAIN_STEPS = 300


def _save(config: JobConfig, model: torch.nn.Module, step: int) -> None:
    """A checkpoint of ``model`` as training saves one, its config recorded."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    extra = {"step": step, "config": config_to_dict(config)}
    CheckpointManager(config.checkpoint, config.checkpoint_dir).save(
        step, model=model, optimizer=optimizer, scheduler=scheduler, train_state={"extra": extra}
    )


def _learn(model: torch.nn.Module, sentences: list[str]) -> None:
    """Train ``model`` on the sentences, each a document read from its own first token (as
    training reads documents without BOS under document masking)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(0)
    for _ in range(TRAIN_STEPS):
        batch = [BYTES.encode(rng.choice(sentences)) for _ in range(16)]
        width = max(map(len, batch))
        ids = torch.tensor([row + [BYTES.pad_id] * (width - len(row)) for row in batch])
        labels = ids[:, 1:].masked_fill(ids[:, 1:] == BYTES.pad_id, IGNORE_INDEX)
        loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), labels.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


@pytest.fixture(scope="module")
def run(tmp_path_factory, token_dirs) -> tuple[Path, list[dict]]:
    """A run directory whose step_1 holds a byte-level model that learnt 16 facts (its
    data has no BOS and training masks documents, so a document starts with its own first
    token), and the facts' questions."""
    run_dir = tmp_path_factory.mktemp("lm_eval") / "run"
    overrides = ["--model.dim=64", "--model.n_heads=4", "--train.seq_len=64"]
    config = load_config(None, tiny_run(run_dir, token_dirs, *overrides))
    sentences, questions = _facts(16, seed=3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = build_model(config.model)
        _learn(model, sentences)
        run_dir.mkdir(parents=True)
        save_config(config, str(run_dir / "config.toml"))
        _save(config, model, 1)
    finally:
        torch.set_num_threads(threads)
    return run_dir, questions


@pytest.fixture(scope="module")
def adapter(run) -> KempnerForgeLM:
    return KempnerForgeLM(checkpoint=str(run[0]), batch_size=4)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """No download: the Hugging Face libraries read these settings when first imported,
    which may have been before this test, so their constants are set too."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def _requests(*args: tuple) -> list[SimpleNamespace]:
    """Harness requests as the adapter reads them: their ``args``."""
    return [SimpleNamespace(args=a) for a in args]


def _native(adapter: KempnerForgeLM, task: EvalTaskConfig) -> tuple[LoadedTask, torch.Tensor]:
    """The native task loaded for the adapter's model, and its slot sums (nll, tokens)."""
    lm = adapter.lm
    loaded = load_task(task, lm.tokenizer, lm.start, lm.seq_len)
    sums = slot_sums(
        lm.model,
        loaded.windows,
        loaded.slots,
        whole_model_losses(lm.model, lm.device, 2048),
        device=lm.device,
        global_batch=4,
        rows_per_forward=4,
    )
    return loaded, sums


def _jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def write_task_yaml(directory: Path, name: str, data: str) -> None:
    """A harness task ``name`` over the native multiple-choice file ``data``, in
    ``directory``: each choice appended to the context as written (target_delimiter ""),
    acc and acc_norm; the harness's json loader caches under ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.yaml").write_text(
        f"task: {name}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n  cache_dir: {directory / 'hf'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{gold}}"\n'
        'target_delimiter: ""\n'
        "metric_list:\n"
        "  - metric: acc\n  - metric: acc_norm\n"
    )


def test_the_adapter_reads_the_checkpoints_data_conventions(run, log):
    lm = KempnerForgeLM(checkpoint=str(run[0]), batch_size=4).lm
    # The prepared data has no BOS per document and training masks documents: a text
    # starts with its own first token (an empty one with EOS), and the log says so.
    assert lm.start.ids == () and lm.start.tokens([]) == [BYTES.eos_id]
    assert "evaluation reads each text after its own first token, which is not scored" in log.text
    assert lm.seq_len == 64 and lm.batch_rows == 4 and lm.device == torch.device("cpu")
    assert not lm.model.training


def _assert_head_close(adapter: KempnerForgeLM, got: list[float], native: tuple) -> None:
    """Assert the adapter's log-likelihoods are the native slot sums' up to the head.

    Both run the same windows in the same batches through the same body, so the hidden
    states are the same; they part at the head. The native scorer takes the fp32
    cross-entropy of the logits its chunked head computes (hidden @ weight.T over the
    flattened tokens), the adapter the fp32 log_softmax of the logits the output layer
    returns: the same sums run by other kernels, so each token's log-probability may differ
    by a reordering of the dim terms of a logit and the vocab terms of the softmax, the
    largest |logit| standing in for their size, and a request's sum by its token count
    times that."""
    loaded, sums = native
    lm = adapter.lm
    with torch.no_grad():
        logits = lm.model(loaded.windows.input_ids, doc_ids=loaded.windows.doc_ids)
    tokens = sums[:, 1]
    assert_reordered_close(
        torch.tensor(got, dtype=torch.float64),
        -sums[:, 0],
        terms=lm.model.cfg.dim + lm.model.cfg.vocab_size,
        magnitude=tokens * logits.abs().max().item(),
        dtype=torch.float32,
    )


def test_loglikelihoods_equal_the_native_scorers(adapter, run, tmp_path):
    """Per choice, the native multiple-choice task's log-likelihood (up to the head's
    rounding: _assert_head_close; on the CPUs tried they differ by about 1e-6 nats)."""
    _, questions = run
    task = EvalTaskConfig(name="facts", path=_jsonl(tmp_path / "facts.jsonl", questions))
    native = _native(adapter, task)
    pairs = [(q["context"], c) for q in questions for c in q["choices"]]
    got = adapter.loglikelihood(_requests(*pairs))
    assert len(got) == len(pairs) == 64
    _assert_head_close(adapter, [lp for lp, _ in got], native)
    assert native[1][:, 1].tolist() == [len(c) for _, c in pairs]  # one token per byte
    assert native[0].windows.truncated == 0


def test_is_greedy_says_whether_every_continuation_token_is_the_argmax(adapter, run):
    """Checked against the unpacked sequence's own argmax, one request at a time."""
    _, questions = run
    pairs = [(q["context"], c) for q in questions[:4] for c in q["choices"]]
    got = adapter.loglikelihood(_requests(*pairs, ("Nobody lives in", "")))
    lm = adapter.lm
    for (context, choice), (_, greedy) in zip(pairs, got, strict=False):
        prefix = lm.start.tokens(BYTES.encode(context))
        ids = torch.tensor([prefix + BYTES.encode(choice)])
        with torch.no_grad():
            argmax = lm.model(ids[:, :-1])[0, len(prefix) - 1 :].argmax(-1)
        assert greedy == bool((argmax == ids[0, len(prefix) :]).all())
    assert any(greedy for _, greedy in got[:-1]), "the trained model answers some itself"
    assert got[-1] == (0.0, True)  # an empty continuation


def test_a_harness_task_over_a_local_file_gets_the_native_accuracy(adapter, run, tmp_path):
    """The harness builds (context, " " + choice) requests from its YAML templates; with
    target_delimiter "" and choices that carry their own space they are the native
    requests, and acc / acc_norm (per character: bytes here, all ASCII) agree. Half the
    questions are about facts the model never saw, so the accuracy is not 1."""
    _, questions = run
    data = _jsonl(tmp_path / "facts.jsonl", questions + _facts(16, seed=4)[1])
    write_task_yaml(tmp_path, "kf_facts", data)
    results = lm_eval.simple_evaluate(
        model=adapter,
        tasks=["kf_facts"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        bootstrap_iters=0,
        log_samples=False,
        # Leave the process's random generators to the other tests (nothing here samples).
        random_seed=None,
        numpy_random_seed=None,
        torch_random_seed=None,
    )
    assert results is not None
    harness = results["results"]["kf_facts"]
    task = EvalTaskConfig(name="facts", path=data)
    loaded, sums = _native(adapter, task)
    native = task_metrics(loaded, sums)  # what evaluate_task reports from these sums
    assert harness["acc,none"] == native["eval/facts/acc"]
    assert harness["acc_norm,none"] == native["eval/facts/acc_norm"]
    assert loaded.examples == 32
    assert 0.5 <= native["eval/facts/acc"] < 1, "the learnt half right, the rest guessed"


def test_rolling_loglikelihood_of_a_text_within_one_window_is_the_native_sum(adapter, tmp_path):
    """A text that fits one window (64 positions) is one request both ways: the harness's
    first rolling window and the native bits_per_byte task's. Each sum is its native slot's
    (up to the head's rounding: _assert_head_close); longer texts part, the harness reading
    disjoint windows and the native task overlapping ones (test_lm_eval_harness.py)."""
    texts = ["Ba lives in Ko. " * 4, "short", ""]  # 64 bytes: 63 positions
    records = [{"text": t} for t in texts]
    path = _jsonl(tmp_path / "docs.jsonl", records)
    task = EvalTaskConfig(name="docs", path=path, kind="bits_per_byte")
    native = _native(adapter, task)
    got = adapter.loglikelihood_rolling(_requests(*[(t,) for t in texts]))
    _assert_head_close(adapter, got, native)
    assert got[2] == 0.0  # nothing to score
    # Every byte but the first, which opens the text (no BOS, document masking).
    assert native[1][:, 1].tolist() == [len(t) - 1 if t else 0 for t in texts]


def test_generation_stops_at_the_stop_string(adapter, run):
    """The learnt fact's town, greedily, up to the "." that ends its sentence: the same
    text as a longer generation cut there."""
    _, questions = run
    context = questions[0]["context"]
    kwargs = {"until": ["."], "max_gen_toks": 30}
    longer = {"until": [], "max_gen_toks": 30}
    (stopped, whole) = adapter.generate_until(_requests((context, kwargs), (context, longer)))
    assert "." in whole
    assert stopped == whole[: whole.index(".")]
    assert stopped in [c.rstrip(".") for c in questions[0]["choices"]]  # " Town", learnt


def test_generation_leaves_room_for_the_prompt(adapter):
    with pytest.raises(ValueError, match="max_gen_toks = 64 leaves no room"):
        adapter.generate_until(_requests(("x", {"until": ["."], "max_gen_toks": 64})))


def test_register_names_the_adapter_in_the_harness(run):
    register()
    register()  # idempotent
    cls = get_model("kempnerforge")
    assert cls is KempnerForgeLM
    lm = cls.create_from_arg_string(f"checkpoint={run[0]},device=cpu", {"batch_size": "auto"})
    assert lm.lm.batch_rows == 8 and lm.lm.seq_len == 64


def test_importing_kempnerforge_needs_no_lm_eval():
    """lm-eval is an optional extra: the package and its CLI import with it hidden."""
    code = (
        "import sys; sys.modules['lm_eval'] = None\n"
        "import kempnerforge, kempnerforge.cli, kempnerforge.interop, kempnerforge.interop.hf\n"
        "import kempnerforge.interop.lm_eval_requests\n"
        "assert 'kempnerforge.interop.lm_eval' not in sys.modules\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
