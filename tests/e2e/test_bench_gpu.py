"""bench/gpu/: the GPU suite's dry run on the CPU (same parts and JSON keys, tiny shapes)
and the hand-written loop's CPU smoke run, so neither rots before a GPU runs them (their
numbers are measured on the GPU, see docs/performance.md; no timing is asserted here)."""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys

import pytest
import torch

from bench.bare_loop import Llama
from bench.gpu.hand_loop import parse_args
from bench.gpu.suite import GPU_SHAPES, hand_args, preset_model
from tests.support.cli import REPO, run_python

pytestmark = pytest.mark.slow

GPU = REPO / "bench" / "gpu"


def _suite(tmp_path, *args: str) -> dict:
    out = tmp_path / "out"
    suite = [str(GPU / "suite.py"), "--dry-run", f"--out={out}", *args]
    done = run_python(*suite, env_extra={"TMPDIR": str(tmp_path)}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


def test_the_dry_run_records_each_part_with_the_gpu_run_keys(tmp_path):
    only = "matmul_peak,1b_eager,1b_compiled_blocks,1b_compiled_fp8,head_loss,float8_curve"
    results = _suite(tmp_path, f"--only={only}")
    assert results["meta"]["dry_run"] is True and results["meta"]["torch"] == torch.__version__
    assert results["device"]["matmul_peak"]["tflops"] > 0
    row = results["mfu"]["1b_eager"]
    assert row["status"] == "pass" and row["tokens_per_sec"] > 0 and row["float8"] is False
    hand = results["hand_written"]["1b_compiled_blocks"]
    assert hand["status"] == "pass" and hand["compile"] == "blocks"
    assert math.isfinite(hand["last_loss"]) and hand["params"] == row["params"]
    # FP8 is refused on the CPU in one line, which the suite records instead of failing.
    for refused in (results["float8"]["1b_compiled_fp8"], results["checks"]["float8_curve"]):
        assert refused["status"] == "skipped"
        assert "train.float8 = True: expected false on a cpu device" in refused["reason"]
    assert results["checks"]["head_loss"]["status"] == "pass"
    summary = results["summary"]
    assert summary["hand_written_best"] == "1b_compiled_blocks"
    assert summary["checks"] == {"head_loss": "pass", "float8_curve": "skipped"}
    assert summary["best_1b"]["name"] == "1b_eager" and summary["best_1b"]["mfu"] is None


def test_the_attention_part_checks_the_packed_path_against_the_dense_mask(tmp_path):
    """bench/gpu/attention.py in the suite: on the CPU the rules' kernel is the per-document
    one, and its outputs and gradients equal the dense mask's (fp32, within 1e-4)."""
    results = _suite(tmp_path, "--only=attention_packed")
    row = results["checks"]["attention_packed"]
    assert row["status"] == "pass" and row["kernel"] == "Segments"
    for name in ("causal_flash", "packed_rules", "packed_dense", "packed_window_rules"):
        assert row["ms"][name] > 0
    assert max(max(e.values()) for e in row["relative_errors"].values()) <= row["tolerance"]
    assert results["summary"]["checks"] == {"attention_packed": "pass"}


def test_a_part_past_the_budget_or_deadline_is_recorded_not_fatal(tmp_path):
    results = _suite(tmp_path, "--only=1b_eager", "--budget-s=-1")
    assert results["mfu"]["1b_eager"]["status"] == "skipped"
    assert results["mfu"]["1b_eager"]["reason"].startswith("not started: 0 s of the -1 s budget")
    results = _suite(tmp_path, "--only=matmul_peak", "--deadline-s=0")
    assert results["device"]["matmul_peak"] == {
        "status": "fail",
        "reason": "timed out after 1 s",
        "seconds": results["device"]["matmul_peak"]["seconds"],
    }


def test_the_hand_written_loop_imports_nothing_from_kempnerforge():
    for script in (GPU / "hand_loop.py", REPO / "bench" / "bare_loop.py"):
        tree = ast.parse(script.read_text())
        modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        modules += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert modules and not [m for m in modules if m.split(".")[0] == "kempnerforge"]


@pytest.mark.parametrize("compile", ["none", "blocks", "model"])
def test_the_hand_written_loop_trains_on_the_cpu(compile):
    args = ["--dim=32", "--n-heads=2", "--n-kv-heads=1", "--ffn-hidden=64", "--n-layers=2"]
    args += ["--seq-len=16", "--batch-size=2", "--steps=3", "--warmup=1", "--device=cpu"]
    args += [f"--compile={compile}", "--compile-backend=aot_eager", "--tie-embeddings"]
    done = subprocess.run(
        [sys.executable, str(GPU / "hand_loop.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["tokens_per_sec"] > 0 and figures["compile"] == compile
    assert math.isfinite(figures["first_loss"]) and math.isfinite(figures["last_loss"])
    assert figures["params"] == 259 * 32 + 2 * (4 * 32 * 16 + 2 * 32 * 16 + 3 * 32 * 64 + 64) + 32


@pytest.mark.parametrize("shape", sorted(GPU_SHAPES))
def test_the_hand_written_model_has_the_presets_parameter_count(shape):
    model = preset_model(GPU_SHAPES[shape])
    with torch.device("meta"):
        hand = Llama(parse_args([*hand_args(model), "--seq-len=16"]))
    assert sum(p.numel() for p in hand.parameters()) == model.num_params()
