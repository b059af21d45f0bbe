"""End to end: low-rank adapters on an imported Hugging Face Llama, through the command line.

A tiny random LlamaForCausalLM made by transformers is imported, fine-tuned with [lora]
from its weights (8 steps on the built-in corpus), then exported twice: merged
(`export --format hf`) and as adapters (`export --format peft`). peft itself loads the
adapter folder onto the base model, and transformers the merged folder; both must compute
our adapted model's logits. Along the way: the base weights never move, the optimizer
holds state for the adapters only, and a run stopped at step 4 resumes to the same losses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kempnerforge.checkpoint.dcp_metadata import read_dcp_metadata
from kempnerforge.training.inference import load_for_inference, open_for_inference
from tests.support import hf_families as fam
from tests.support.cli import run_kempnerforge
from tests.support.metrics_rows import train_rows
from tests.support.threads import PROCESS_THREADS

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

RANK, ALPHA = 4, 8.0
JOB = """
include = ["imported/model.toml"]

[train]
name = "lora"
batch_size = 4
seq_len = 24
max_steps = 8
seed = 3
sample_tokens = 0
device = "cpu"

[optimizer]
lr = 1e-2

[scheduler]
name = "constant"  # the same rate whatever max_steps, so a run stopped at 4 is the same run
warmup_steps = 1

[data]
path = ""

[checkpoint]
interval = 4
resume_from = "imported/step_0"
load_weights_only = true

[lora]
rank = {rank}
alpha = {alpha}
target_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

[metrics]
log_interval = 1
progress = "off"
"""


def kempnerforge(*args: str, cwd: Path, cache: Path):
    result = run_kempnerforge(
        *args,
        cwd=cwd,
        env_extra={"OMP_NUM_THREADS": PROCESS_THREADS, "KEMPNERFORGE_CACHE": str(cache)},
    )
    assert result.returncode == 0, f"{args}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def work(tmp_path_factory, builtin_cache) -> Path:
    """The base folder, its import, a run of 8 steps and one stopped at 4 then resumed, and
    both exports of the first."""
    root = tmp_path_factory.mktemp("lora")
    fam.make_hf_folder(transformers.LlamaConfig, transformers.LlamaForCausalLM, root / "base")
    kempnerforge("import-hf", "--model", "base", "--out", "imported", cwd=root, cache=builtin_cache)
    (root / "job.toml").write_text(JOB.format(rank=RANK, alpha=ALPHA))
    kempnerforge("train", "job.toml", "--train.run_dir=whole", cwd=root, cache=builtin_cache)
    for steps in (4, 8):
        kempnerforge(
            "train", "job.toml", "--train.run_dir=stopped", f"--train.max_steps={steps}",
            cwd=root, cache=builtin_cache,
        )  # fmt: skip
    for fmt in ("hf", "peft"):
        kempnerforge(
            "export", "--checkpoint", "whole", "--out", f"export-{fmt}", "--format", fmt,
            "--base-model", "base", cwd=root, cache=builtin_cache,
        )  # fmt: skip
    return root


def our_adapted_model(work: Path) -> torch.nn.Module:
    """The run's model with its adapters (not merged), from its last checkpoint."""
    job = open_for_inference("export", str(work / "whole"), validate=False, device="cpu")
    return load_for_inference(job, keep_adapters=True)


def test_only_the_adapters_train_and_a_stopped_run_resumes_to_the_same_losses(work):
    whole, stopped = train_rows(work / "whole"), train_rows(work / "stopped")
    assert [r["step"] for r in stopped] == list(range(1, 9))
    assert [r["loss"] for r in stopped] == [r["loss"] for r in whole]
    assert [r["grad_norm"] for r in stopped] == [r["grad_norm"] for r in whole]
    assert whole[-1]["loss"] < whole[0]["loss"]
    model = our_adapted_model(work)
    base = fam.imported_model(work / "base").state_dict()
    adapters = 0
    for name, value in model.state_dict().items():
        if name.endswith((".lora_a", ".lora_b")):
            adapters += 1
            assert value.abs().max() > 0, name  # B moved off zero, A is drawn
        else:
            assert torch.equal(value, base[name]), name  # frozen: bitwise the import
    assert adapters == 2 * 7 * 2
    saved = read_dcp_metadata(work / "whole" / "checkpoints" / "step_8").state_dict_metadata
    with_state = {k.split(".")[-2] for k in saved if k.startswith("optimizer.state.")}
    assert with_state == {"lora_a", "lora_b"}


def test_peft_loads_the_adapter_folder_and_computes_our_logits(work):
    config = json.loads((work / "export-peft" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (
        RANK,
        ALPHA,
        "base",
    )
    assert len(config["target_modules"]) == 2 * 7
    base = transformers.LlamaForCausalLM.from_pretrained(work / "base").eval()
    theirs = peft.PeftModel.from_pretrained(base, work / "export-peft").eval()
    ours = our_adapted_model(work)
    ids = fam.random_ids()
    with torch.no_grad():
        want, got = theirs(ids).logits, ours(ids)
        plain = transformers.LlamaForCausalLM.from_pretrained(work / "base").eval()(ids).logits
    fam.assert_close_logits(got, want, ours.cfg)
    assert (want - plain).abs().max() > 100 * fam.logits_atol(ours.cfg, want)  # adapters count


def test_the_merged_export_is_the_base_plus_the_scaled_low_rank_product(work):
    merged = load_file(work / "export-hf" / "model.safetensors")
    base = load_file(work / "base" / "model.safetensors")
    adapters = load_file(work / "export-peft" / "adapter_model.safetensors")
    scale = ALPHA / RANK
    checked = 0
    for name, weight in merged.items():
        prefix = "base_model.model." + name.removesuffix(".weight")
        if f"{prefix}.lora_A.weight" not in adapters:
            assert torch.equal(weight, base[name].float()), name
            continue
        a, b = adapters[f"{prefix}.lora_A.weight"], adapters[f"{prefix}.lora_B.weight"]
        assert torch.equal(weight, base[name].float() + scale * (b @ a)), name
        checked += 1
    assert checked == 2 * 7
    hf = transformers.LlamaForCausalLM.from_pretrained(work / "export-hf").eval()
    ours = our_adapted_model(work)
    ids = fam.random_ids(seed=1)
    with torch.no_grad():
        fam.assert_close_logits(ours(ids), hf(ids).logits, ours.cfg)
