"""Checkpoints in a store (a real S3 server) read back by everything that takes one: each form
of a store URL and a run directory whose checkpoint.dir is a store, through generate, eval,
capture, export and the lm-eval adapter, fetching only the chosen checkpoint's files and
naming it by its URL; a store holding nothing is one line naming it."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kempnerforge.cli import main
from kempnerforge.config.loader import load_config, save_config
from kempnerforge.storage.stores import filesystem
from kempnerforge.training.inference.loading import load_for_inference, open_for_inference
from tests.unit.test_inference import generate, save_step, used


@pytest.fixture
def store_run(s3, tiny_overrides, tmp_path) -> tuple[Path, str, dict[int, torch.nn.Module]]:
    """A run directory whose checkpoints (steps 3 and 6, `latest` naming step_6) are in the
    test S3 server: (its run directory, the checkpoints' URL, each step's model)."""
    server, bucket = s3
    url = f"{bucket}/run/ckpt"
    staging = f"--checkpoint.staging_dir={tmp_path / 'staging'}"
    config = load_config(None, [*tiny_overrides, f"--checkpoint.dir={url}", staging])
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True)
    save_config(config, str(run_dir / "config.toml"))
    models = {step: save_step(config, step) for step in (3, 6)}
    server.clear()
    return run_dir, url, models


def _checkpoint_gets(server) -> set[str]:
    """The names under the checkpoints' prefix whose objects were read (GET) since the
    server's log was cleared: checkpoints, and `latest`."""
    gets = [r.path for r in server.taken() if r.method == "GET" and "/ckpt/" in r.path]
    return {path.split("/ckpt/")[1].split("/")[0] for path in gets}


@pytest.mark.parametrize(
    ("form", "step"),
    [("/step_3", 3), ("", 6), ("/latest", 6), ("run", 6)],
    ids=["step-url", "prefix-url", "latest-url", "run-dir"],
)
def test_each_form_loads_its_checkpoints_weights_and_reads_only_its_files(
    s3, store_run, form, step
):
    server, _ = s3
    run_dir, url, models = store_run
    given = str(run_dir) if form == "run" else f"{url}{form}"
    job = open_for_inference("generate", given)
    model = load_for_inference(job)
    assert (job.step, job.source) == (step, f"{url}/step_{step}")
    expected = models[step].state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert _checkpoint_gets(server) - {"latest"} == {f"step_{step}"}  # no other checkpoint
    staged = job.checkpoint.parent
    assert staged.is_dir()
    del job, model
    gc.collect()
    assert not staged.exists()  # the fetched copy goes with the command


def test_generate_names_the_store_checkpoint_and_the_runs_config(s3, store_run, capsys):
    run_dir, url, _ = store_run
    code, out, err = generate(run_dir, capsys)
    assert code == 0, err
    assert out.startswith("alpha ")
    assert used(err) == (
        f"generate: step 6 of {url}/step_6 (the newest complete checkpoint in {url}); "
        f"config: {run_dir / 'config.toml'}"
    )
    code, _, err = generate(f"{url}/step_3", capsys)  # no run directory: the recorded config
    assert code == 0, err
    assert (
        used(err)
        == f"generate: step 3 of {url}/step_3; config: the config recorded in {url}/step_3"
    )


def test_eval_and_capture_write_beside_the_checkpoint_in_its_store(s3, store_run, capsys):
    run_dir, url, _ = store_run
    config = str(run_dir / "config.toml")
    assert main(["eval", config, "--checkpoint", f"{url}/latest", "--steps=1"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"step 6; wrote {url}/step_6/eval.json"
    report = json.loads(filesystem(url).cat_file(f"{url}/step_6/eval.json"))
    assert (report["step"], report["checkpoint"]) == (6, f"{url}/step_6")
    out = run_dir / "acts.safetensors"
    argv = ["capture", "--checkpoint", url, "--layers", "norm", "--batches", "1", "--out", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["checkpoint"] == f"{url}/step_6"


def test_export_of_a_run_whose_checkpoints_are_in_a_store(s3, store_run, tmp_path, capsys):
    run_dir, url, _ = store_run
    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(run_dir), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"wrote {out} (LlamaForCausalLM) from {url}/step_6, step 6"
    assert (out / "config.json").is_file()


def test_the_lm_eval_adapter_takes_a_store_url(s3, store_run):
    pytest.importorskip("lm_eval")
    from kempnerforge.interop.lm_eval import KempnerForgeLM

    _, url, models = store_run
    lm = KempnerForgeLM(checkpoint=f"{url}/step_3", device="cpu")
    expected = models[3].state_dict()
    for name, tensor in lm.lm.model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_a_store_prefix_holding_no_checkpoint_is_one_line_naming_it(s3, store_run, capsys):
    _, url, _ = store_run
    empty = url.replace("/run/ckpt", "/nothing")
    for given, problem in ((empty, "holds no complete checkpoint"), (f"{url}/step_9", "not a")):
        code, _, err = generate(given, capsys)
        assert code == 1
        assert len(err.splitlines()) == 1, err
        prefix = empty if given == empty else given
        assert err.startswith(f"kempnerforge: checkpoint error: {prefix}: {problem}"), err
