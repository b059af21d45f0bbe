"""End to end: lm-evaluation-harness's own command line with the model "kempnerforge"
registered (`python -m kempnerforge.interop.lm_eval`), over a saved checkpoint and a task
on a local file, offline; its accuracy is the native scorer's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")  # a guard: CI installs lm-eval through the dev extra

from kempnerforge.config.eval import EvalTaskConfig  # noqa: E402
from kempnerforge.config.loader import load_config, save_config  # noqa: E402
from kempnerforge.evaluation.scoring import slot_sums, whole_model_losses  # noqa: E402
from kempnerforge.evaluation.tasks import load_task, task_metrics  # noqa: E402
from kempnerforge.interop.lm_eval import KempnerForgeLM  # noqa: E402
from tests.support.cli import run_python  # noqa: E402
from tests.unit.test_eval_tasks import _facts  # noqa: E402
from tests.unit.test_inference import save_step  # noqa: E402
from tests.unit.test_lm_eval_adapter import write_task_yaml  # noqa: E402

pytestmark = pytest.mark.slow

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def test_the_harness_command_line_scores_a_checkpoint_as_the_native_scorer(
    tmp_path, tiny_overrides
):
    config = load_config(None, tiny_overrides)
    run = Path(config.run_dir)
    run.mkdir(parents=True)
    save_config(config, str(run / "config.toml"))
    save_step(config, 3)
    data = tmp_path / "facts.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in _facts(12, seed=1)[1]))
    write_task_yaml(tmp_path / "tasks", "kf_facts", str(data))

    result = run_python(
        "-m",
        "kempnerforge.interop.lm_eval",
        "--model",
        "kempnerforge",
        "--model_args",
        f"checkpoint={run}",
        "--device",
        "cpu",
        "--batch_size",
        "4",
        "--tasks",
        "kf_facts",
        "--include_path",
        str(tmp_path / "tasks"),
        "--output_path",
        str(tmp_path / "out"),
        env_extra=OFFLINE,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kf_facts" in result.stdout
    (report,) = (tmp_path / "out").rglob("results_*.json")
    harness = json.loads(report.read_text())["results"]["kf_facts"]

    lm = KempnerForgeLM(checkpoint=str(run), batch_size=4).lm
    task = EvalTaskConfig(name="facts", path=str(data))
    loaded = load_task(task, lm.tokenizer, lm.start, lm.seq_len)
    sums = slot_sums(
        lm.model,
        loaded.windows,
        loaded.slots,
        whole_model_losses(lm.model, lm.device, config.train.loss_chunk_tokens),
        device=lm.device,
        global_batch=4,
        rows_per_forward=4,
    )
    native = task_metrics(loaded, sums)
    assert harness["acc,none"] == native["eval/facts/acc"]
    assert harness["acc_norm,none"] == native["eval/facts/acc_norm"]
