"""What only a GPU can run: the CUDA device, bf16, fused AdamW and compiled blocks, NCCL.

Skipped where there is no CUDA device (the CPU paths of the same code are tested
everywhere else).
"""

from __future__ import annotations

import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from tests.support.metrics_rows import train_rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

REPO = pathlib.Path(__file__).parents[2]
DEBUG = str(REPO / "configs" / "train" / "debug.toml")
GPU_RUN = [
    "--train.device=cuda",
    "--train.mixed_precision=bf16",
    "--train.compile=true",
    "--optimizer.implementation=fused",
    "--train.max_steps=20",
    "--metrics.log_interval=1",
    "--metrics.progress=off",
    "--train.sample_tokens=8",
]


def _train(run_dir: pathlib.Path, cache: pathlib.Path, *launcher: str, extra=()) -> list[float]:
    env = {**os.environ, "KEMPNERFORGE_CACHE": str(cache)}
    command = [*launcher, "-m", "kempnerforge", "train", DEBUG, *GPU_RUN, *extra]
    done = subprocess.run(
        [*command, f"--train.run_dir={run_dir}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [row["loss"] for row in train_rows(run_dir)]


def test_bf16_compiled_fused_training_on_one_gpu_learns(tmp_path, builtin_cache):
    losses = _train(tmp_path / "run", builtin_cache, sys.executable)
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_fsdp_over_nccl_on_two_gpus_matches_one_gpu(tmp_path, builtin_cache):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    one = _train(tmp_path / "one", builtin_cache, sys.executable, extra=["--train.compile=false"])
    two = _train(
        tmp_path / "two",
        builtin_cache,
        *torchrun,
        "--nproc_per_node=2",
        extra=["--train.compile=false", "--distributed.dp_shard=2", "--train.batch_size=4"],
    )
    # bf16 arithmetic: the same numbers up to bf16 rounding of the sums.
    assert all(abs(a - b) < 0.05 for a, b in zip(one, two, strict=True))
