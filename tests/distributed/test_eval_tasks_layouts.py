"""A downstream task scores the same on every layout: FSDP, tensor parallelism, context
parallelism (each rank its slice of every window), FSDP with tensor parallelism and
pipeline stages give one process's accuracies exactly and its bits per byte within fp32
reordering, each window scored once, by one data-parallel rank."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from kempnerforge.config.eval import EvalTaskConfig
from kempnerforge.config.loader import load_config
from kempnerforge.data.pipeline import DataPipeline
from kempnerforge.data.tokenizer import ByteTokenizer
from kempnerforge.distributed.runtime import init_runtime
from kempnerforge.evaluation.document_start import DocumentStart
from kempnerforge.evaluation.scoring import whole_model_losses
from kempnerforge.evaluation.tasks import evaluate_task, load_tasks
from kempnerforge.training.eval import evaluate_tasks
from kempnerforge.training.families.family import sliced_for_context_parallel
from tests.support.dist import run_distributed
from tests.support.metrics_rows import read_rows
from tests.support.parallel import build_parallel, job_config, reference_model
from tests.support.tiny import layout_run
from tests.support.tolerance import assert_layout_close
from tests.support.train_run import train_ranks

pytestmark = pytest.mark.distributed

SEQ_LEN = 32
BYTES = ByteTokenizer()
LAYOUTS = {
    "fsdp": (["--distributed.dp_shard=2"], 2),
    "tp": (["--distributed.tp=2", "--distributed.dp_shard=1"], 2),
    "cp": (["--distributed.cp=2", "--distributed.dp_shard=1"], 2),
    "fsdp_tp": (["--distributed.dp_shard=2", "--distributed.tp=2"], 4),
}


def _task_files(directory: str) -> list[EvalTaskConfig]:
    """12 questions of 2 to 4 choices, and 3 documents, one longer than a window."""
    questions = [
        {
            "context": f"Item {i} goes with",
            "choices": [f" thing {i * k % 7}" for k in range(2 + i % 3)],
            "gold": i % 2,
        }
        for i in range(12)
    ]
    documents = [{"text": "short"}, {"text": "a b c d e f g h " * 12}, {"text": "xyz 123"}]
    paths = {}
    for name, records in (("mc", questions), ("text", documents)):
        paths[name] = f"{directory}/{name}.jsonl"
        with open(paths[name], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    return [
        EvalTaskConfig(name="mc", path=paths["mc"]),
        EvalTaskConfig(name="text", path=paths["text"], kind="bits_per_byte"),
    ]


def _metrics_both_ways(
    rank: int, world_size: int, layout: str, task_configs: list[EvalTaskConfig]
) -> dict[str, Any]:
    config = job_config(
        *LAYOUTS[layout][0],
        "--model.vocab_size=320",
        f"--train.seq_len={SEQ_LEN}",
        "--train.batch_size=2",
        "--eval.batch_size=3",
    )
    runtime = init_runtime(config.distributed, "cpu")
    model = build_parallel(config, runtime)
    tasks = load_tasks(task_configs, BYTES, DocumentStart.of(BYTES, bos=True), SEQ_LEN)
    data = DataPipeline(dataset=None, sampler=None, dataloader=None, tokenizer=BYTES)
    data = sliced_for_context_parallel(data, runtime)
    got = evaluate_tasks(model, data, config, runtime, tasks)
    reference = reference_model(config)
    cpu = torch.device("cpu")
    losses = whole_model_losses(reference, cpu, config.train.loss_chunk_tokens)
    want: dict[str, float] = {}
    for task in tasks:
        want.update(
            evaluate_task(reference, task, losses, device=cpu, global_batch=3, rows_per_forward=2)
        )
    return {"got": got, "want": want, "model": config.model}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_task_scores_the_same_in_every_layout(layout, tmp_path):
    _, world_size = LAYOUTS[layout]
    results = run_distributed(_metrics_both_ways, world_size, layout, _task_files(str(tmp_path)))
    for result in results:
        got, want = result["got"], result["want"]
        assert got["eval/mc/examples"] == 12 and got["eval/text/examples"] == 3
        assert got["eval/mc/acc"] == want["eval/mc/acc"]
        assert got["eval/mc/acc_norm"] == want["eval/mc/acc_norm"]
        assert got["eval/text/tokens"] == want["eval/text/tokens"]
        tokens = int(want["eval/text/tokens"])
        assert_layout_close(
            [got["eval/text/bpb"]],
            [want["eval/text/bpb"]],
            cfg=result["model"],
            seq_len=SEQ_LEN,
            tokens=tokens,
        )
    assert all(
        r["got"] == results[0]["got"] | {k: v for k, v in r["got"].items() if k.endswith("seconds")}
        for r in results
    )


def test_a_pipeline_run_scores_its_tasks_as_one_process_does(token_dirs, tmp_path):
    """Two pipeline stages, trained and scoring with document masking (several requests
    to a row, every stage masking with their document ids), against one process with
    the same training: the tasks after step 2 agree, the accuracies
    exactly, the bits per byte within fp32 reordering of the two updates and the forward.
    Scoring after step 1 leaves the pipeline's training as it was: the same losses, bit
    for bit, as a pipeline run that scores only at the end."""
    tasks = _task_files(str(tmp_path))
    tables = ", ".join(
        f'{{name = "{t.name}", path = "{t.path}", kind = "{t.kind}"}}' for t in tasks
    )
    base = layout_run(
        token_dirs,
        2,
        "--model.n_layers=4",
        "--model.vocab_size=320",
        "--train.batch_size=2",
        "--train.grad_accum_steps=2",
        f"--eval.tasks=[{tables}]",
        "--eval.interval=2",
    )
    pipeline = ["--distributed.pp=2", "--distributed.dp_shard=1"]
    train_ranks(base, tmp_path / "one", 1)
    at_end = train_ranks(base, tmp_path / "pp", 2, *pipeline)
    every_step = train_ranks(base, tmp_path / "pp1", 2, *pipeline, "--eval.interval=1")
    assert [r["losses"] for r in every_step] == [r["losses"] for r in at_end]
    assert len([r for r in read_rows(tmp_path / "pp1") if "eval/mc/acc" in r]) == 2
    (want,) = [r for r in read_rows(tmp_path / "one") if "eval/mc/acc" in r]
    (got,) = [r for r in read_rows(tmp_path / "pp") if "eval/mc/acc" in r]
    assert got["step"] == want["step"] == 2
    assert got["eval/mc/acc"] == want["eval/mc/acc"]
    assert got["eval/mc/acc_norm"] == want["eval/mc/acc_norm"]
    assert got["eval/text/tokens"] == want["eval/text/tokens"]
    model = load_config(None, base).model
    assert_layout_close(
        [got["eval/text/bpb"]],
        [want["eval/text/bpb"]],
        first_update=2,
        cfg=model,
        seq_len=32,
        tokens=int(want["eval/text/tokens"]),
    )
