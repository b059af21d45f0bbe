"""End to end: `kempnerforge check-parallel` trains the debug config under parallel layouts
(gloo on CPU) and compares them with one process."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from kempnerforge.config.context_parallel import cp_degrees
from kempnerforge.config.loader import load_config
from tests.layouts.run_sweep import passed_layouts
from tests.layouts.test_layout_sweep import recorded_layouts
from tests.layouts.variants import sweep_argv
from tests.support import warm_process
from tests.support.cli import run_kempnerforge

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).parents[2]
DEBUG = str(REPO / "configs" / "train" / "debug.toml")
DEBUG_MOE = str(REPO / "configs" / "train" / "debug_moe.toml")
TINY = [
    "--model.dim=64",
    "--model.n_layers=2",
    "--model.n_heads=4",
    "--model.n_kv_heads=4",
    "--train.seq_len=32",
    "--train.batch_size=4",
]


def run_check_parallel(argv: list[str], cwd: pathlib.Path, cache: pathlib.Path):
    """`kempnerforge check-parallel` with ``argv``, run in ``cwd`` on the built-in corpus of
    ``cache``; the command itself forked from the warm server (it only plans, launches and
    compares: its runs are fresh processes, the reference and each torchrun launch)."""
    # One thread per process, the reference's too: the layouts' ranks share the cores with
    # each other and with the other test worker (tests/support/threads.py says what more costs).
    env = {"KEMPNERFORGE_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    return run_kempnerforge("check-parallel", *argv, cwd=cwd, env_extra=env, timeout=600)


def check_parallel(*args: str, cwd: pathlib.Path, cache: pathlib.Path, config: str = DEBUG):
    """check-parallel of ``config`` shrunk to the TINY model; ``args`` come after TINY, so
    they override it."""
    return run_check_parallel([config, *TINY, *args], cwd, cache)


def check_moe_layouts(layouts: list[str], cwd: pathlib.Path, cache: pathlib.Path):
    """check-parallel of the debug MoE config under ``layouts`` for 3 steps, its experts
    32 wide."""
    return check_parallel(
        "--layouts",
        *layouts,
        "--steps",
        "3",
        "--model.moe_expert_hidden_dim=32",
        cwd=cwd,
        cache=cache,
        config=DEBUG_MOE,
    )


def table_rows(stdout: str) -> dict[str, list[str]]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("layout "))
    rows = {}
    for line in lines[start + 1 :]:
        cells = line.split()
        if len(cells) == 5 and cells[-1] in ("PASS", "FAIL", "REFUSED"):
            rows[cells[0]] = cells
    return rows


def assert_every_layout_passes(proc, worlds: dict[str, str]) -> None:
    """Exit 0 and one row per layout of ``worlds``, each PASS on its number of processes
    with the loss and gradient-norm differences within 1e-4."""
    assert sorted(table_rows(proc.stdout)) == sorted(worlds)
    assert_layouts_pass(proc, worlds)


def assert_layouts_pass(proc, worlds: dict[str, str]) -> None:
    """Exit 0, and the rows of the layouts of ``worlds`` (among others the check ran) each
    PASS on its number of processes with the loss and gradient-norm differences within
    1e-4."""
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = table_rows(proc.stdout)
    for layout in worlds:
        _, world, loss_diff, norm_diff, result = rows[layout]
        assert (world, result) == (worlds[layout], "PASS"), layout
        assert float(loss_diff) <= 1e-4 and float(norm_diff) <= 1e-4


DENSE_LAYOUTS = {
    **{"dp_shard=2": "2", "tp=2": "2", "pp=2,schedule=1f1b": "2", "pp=2,tp=2": "4"},
    **{"cp=2": "2", "cp=2,dp_shard=2": "4"},
}
"""The debug config's layouts two tests below read from one check (one reference run and
one launch per world size for all of them)."""


@pytest.fixture(scope="module")
def dense_check(tmp_path_factory, builtin_cache):
    """check-parallel of the tiny debug config under DENSE_LAYOUTS for 3 steps, run in an
    empty directory: (the finished process, that directory)."""
    cwd = tmp_path_factory.mktemp("dense-check")
    proc = check_parallel("--layouts", *DENSE_LAYOUTS, "--steps", "3", cwd=cwd, cache=builtin_cache)
    assert sorted(table_rows(proc.stdout)) == sorted(DENSE_LAYOUTS), proc.stdout
    return proc, cwd


MOE_LAYOUTS = {"dp_shard=2,ep=2": "2", "dp_shard=2": "2", "pp=2": "2", "pp=2,dp_shard=2,ep=2": "4"}
"""The debug MoE config's layouts two tests below read from one check."""


@pytest.fixture(scope="module")
def moe_check(tmp_path_factory, builtin_cache):
    """check_moe_layouts under MOE_LAYOUTS, run in an empty directory."""
    proc = check_moe_layouts(list(MOE_LAYOUTS), tmp_path_factory.mktemp("moe-check"), builtin_cache)
    assert sorted(table_rows(proc.stdout)) == sorted(MOE_LAYOUTS), proc.stdout
    return proc


def test_fsdp_tp_and_pp_layouts_match_one_process(dense_check):
    proc, cwd = dense_check
    worlds = {"dp_shard=2": "2", "tp=2": "2", "pp=2,schedule=1f1b": "2", "pp=2,tp=2": "4"}
    assert_layouts_pass(proc, worlds)
    assert "max rel dloss" in proc.stdout and "|x - x_ref| / |x_ref|" in proc.stdout
    # The pipeline layout changes every run, the reference included, and says so; document
    # masking stays on (the debug config packs documents): the stages carry the ids.
    assert "uses 2" in proc.stdout and "document_masking" not in proc.stdout
    assert not list(cwd.iterdir())  # the runs lived in a temporary directory


CRASHING_HOOK = """
import os, signal
from kempnerforge.training.hooks import TrainingHook

class CrashUnderTensorParallelism(TrainingHook):
    def on_train_begin(self, config):
        self.tp = config.distributed.tp

    def on_step_end(self, ctx):
        if self.tp > 1 and os.environ.get("RANK") == "1":
            os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_layout_that_crashes_in_a_batch_is_rerun_alone_and_the_rest_still_checked(
    tmp_path, builtin_cache
):
    """The two-process layouts train in one launch; rank 1 of the tp=2 run dies after its
    first step. The layout before it keeps its batched result, and tp=2 and the layout
    after it run one launch each: tp=2 fails there too (its own launch names the rank and
    the signal) and cp=2 still passes."""
    (tmp_path / "crashing_hook.py").write_text(CRASHING_HOOK)
    worlds = ["dp_shard=2", "tp=2", "cp=2"]
    hooks = '--train.hooks=["crashing_hook:CrashUnderTensorParallelism"]'
    proc = check_parallel(
        "--layouts", *worlds, "--steps", "2", hooks, cwd=tmp_path, cache=builtin_cache
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    out = proc.stdout
    assert "one launch of 2 processes for 3 layouts: dp_shard=2, tp=2, cp=2" in out
    assert "the launch ended at tp=2" in out and "run one launch each" in out
    # dp_shard=2 is reported once, from the batch; tp=2 and cp=2 from launches of their own.
    assert out.count("  dp_shard=2 (2 processes): ok") == 1
    assert "  tp=2 (2 processes): exit code" in out
    assert "  cp=2 (2 processes): ok" in out
    rows = table_rows(out)
    assert [rows[layout][-1] for layout in worlds] == ["PASS", "FAIL", "PASS"]
    assert "rank 1 ended with signal SIGKILL (torchrun)" in out


def test_expert_parallel_moe_layouts_match_one_process(moe_check):
    assert_layouts_pass(moe_check, {"dp_shard=2,ep=2": "2", "dp_shard=2": "2"})


def test_moe_pipeline_layouts_match_one_process(moe_check):
    """MoE split into pipeline stages, alone and with the experts of each stage split over
    its 2 shard ranks (4 processes)."""
    assert_layouts_pass(moe_check, {"pp=2": "2", "pp=2,dp_shard=2,ep=2": "4"})


def test_context_parallel_layouts_match_one_process(dense_check):
    """The debug config packs documents (document masking on): cp 2 alone and beside FSDP."""
    assert_layouts_pass(dense_check[0], {"cp=2": "2", "cp=2,dp_shard=2": "4"})


def test_rings_windows_and_pipelines_over_packed_documents_match_one_process(
    tmp_path, builtin_cache, token_dirs
):
    """One check of the attention layouts over short packed documents (5 to 40 words, so
    most rows hold two or more and document masking masks them) with 2 query and 2
    key/value heads and windows of 8 tokens in every other layer (layer 0 slides, layer 1
    sees the whole causal past of its document): Ulysses cp 2 (the heads allow it), a pure
    ring of 4 ('cp=4,ring=4': no head exchange, each layer's rule masks the ring's chunk
    pairs), what 'auto' makes of cp 4 with 2 heads, a ring of 2 Ulysses pairs (the
    hybrid), and two pipeline stages that mask their own layers from the step's ids."""
    heads = ["--model.n_heads=2", "--model.n_kv_heads=2"]
    windows = ["--model.sliding_window=8", "--model.sliding_window_pattern=2"]
    corpus = [f"--data.path={token_dirs[0]}", f"--data.eval_path={token_dirs[1]}"]
    assert cp_degrees(load_config(DEBUG, [*TINY, *heads, "--distributed.cp=4"])) == (2, 2)
    worlds = {"cp=2": "2", "cp=4,ring=4": "4", "cp=4": "4", "pp=2": "2"}
    args = ["--layouts", *worlds, "--steps", "3", *heads, *windows, *corpus]
    proc = check_parallel(*args, cwd=tmp_path, cache=builtin_cache)
    assert_every_layout_passes(proc, worlds)
    assert "uses 2" in proc.stdout and "document_masking" not in proc.stdout


MUON = str(REPO / "configs" / "train" / "muon.toml")


def test_muon_matches_one_process_on_every_layout(tmp_path, builtin_cache):
    """Muon's matrices exchanged over the ranks that share them, through the trainer:
    pipeline stages, HSDP, and FSDP with tensor parallelism (each matrix cut on two mesh
    dimensions). FSDP, tensor and context parallelism alone are checked at the optimizer
    against one process (tests/distributed/test_muon_fsdp.py)."""
    worlds = {"pp=2": "2", "dp_replicate=2,dp_shard=2": "4", "dp_shard=2,tp=2": "4"}
    proc = check_parallel(
        "--layouts", *worlds, "--steps", "3", cwd=tmp_path, cache=builtin_cache, config=MUON
    )
    assert_every_layout_passes(proc, worlds)


def test_lora_adapters_train_on_every_layout_as_one_process(tmp_path, builtin_cache):
    """Adapters on every projection, the base frozen: FSDP shards them with their base,
    tensor parallelism splits B with a column-wise weight and A with a row-wise one
    (distributed/adapter_styles.py), pipeline stages and context parallelism hold them as
    any weight. Three steps: the first moves B off zero, the next two train A through it."""
    worlds = {"dp_shard=2": "2", "tp=2": "2", "pp=2": "2", "cp=2": "2"}
    lora = ["--lora.rank=4", "--lora.alpha=8", "--optimizer.lr=1e-2"]
    proc = check_parallel(
        "--layouts", *worlds, "--steps", "3", *lora, cwd=tmp_path, cache=builtin_cache
    )
    assert_every_layout_passes(proc, worlds)


def test_muon_on_split_experts_matches_one_process(tmp_path, builtin_cache):
    """Each expert's matrices are whole on their expert-parallel rank, which orthogonalises
    them there; the routers stay on AdamW."""
    worlds = {"dp_shard=2,ep=2": "2"}
    muon = ["--optimizer.name=muon", "--optimizer.lr=0.02", "--optimizer.muon_adam_lr=2e-3"]
    proc = check_parallel(
        "--layouts",
        *worlds,
        "--steps",
        "3",
        "--model.moe_expert_hidden_dim=32",
        *muon,
        cwd=tmp_path,
        cache=builtin_cache,
        config=DEBUG_MOE,
    )
    assert_every_layout_passes(proc, worlds)


def test_a_refused_layout_is_reported_with_its_config_error_and_exit_1(tmp_path, builtin_cache):
    """Checked before anything runs, with the launch's own checks: no run, not even the
    reference, when every named layout is refused."""
    runs = tmp_path / "runs"
    proc = check_parallel(
        "--layouts",
        "tp=3",
        "--steps",
        "2",
        "--runs-dir",
        str(runs),
        cwd=tmp_path,
        cache=builtin_cache,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert table_rows(proc.stdout)["tp=3"] == ["tp=3", "3", "-", "-", "REFUSED"]
    assert "tp=3 (3 processes): REFUSED distributed.tp = 3: expected a divisor of" in proc.stdout
    assert not (runs / "reference").exists()


def test_every_accepted_two_process_layout_trains_as_one_process(tmp_path, builtin_cache):
    """The layout sweep's sample in the suite: the dense config with accumulation, every
    layout of 2 processes (each mesh dimension, pp with each schedule, cp with the head
    exchange and as a ring)."""
    argv = sweep_argv("dense-accum", "--nproc", "2")  # the later --nproc wins
    proc = run_check_parallel(argv, tmp_path, builtin_cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "sweep: 11 accepted layouts checked, 11 pass, 0 fail; 0 refused" in proc.stdout
    passed = set(passed_layouts(proc.stdout))
    assert len(passed) == 11 and passed <= recorded_layouts()["dense-accum"]


def test_dpo_under_fsdp_and_tensor_parallelism_matches_one_process(tmp_path, builtin_cache):
    """train.loss_fn = "dpo" on prepared preference pairs: each rank's micro-batch holds
    whole pairs (the pair sampler), the step's loss is the mean over all ranks' pairs, and
    each rank runs the frozen reference (sharded or split as the policy) on its own rows.
    With dp_shard=2 each rank holds one of the step's two pairs."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = {"cwd": tmp_path, "env": env, "check": True, "capture_output": True, "timeout": 300}
    example = [sys.executable, "-m", "examples.chat_conversations", "--preference"]
    subprocess.run([*example, "--count", "16", "--output", "prefs.jsonl"], **run)
    prepare = [sys.executable, "-m", "kempnerforge", "prepare-data", "--format", "preference"]
    warm_process.run(
        [*prepare, "--seq-len", "96", "--input", "prefs.jsonl", "--output", "prefs"], **run
    )
    worlds = {"dp_shard=2": "2", "tp=2": "2"}
    dpo = ["--train.loss_fn=dpo", f"--data.path={tmp_path / 'prefs'}", "--data.eval_path="]
    dpo += ["--eval.interval=0", "--train.seq_len=96", "--model.max_seq_len=96"]
    proc = check_parallel(
        "--layouts", *worlds, "--steps", "3", *dpo, "--optimizer.lr=1e-2",
        cwd=tmp_path, cache=builtin_cache,
    )  # fmt: skip
    assert_every_layout_passes(proc, worlds)


GRPO_REWARD = """
def digits(completion, answer, prompt):
    return float(sum(c.isdigit() for c in completion) % 3) + 0.25 * (len(completion) % 2)
"""


def test_grpo_under_fsdp_and_tensor_parallelism_matches_one_process(tmp_path, builtin_cache):
    """train.loss_fn = "grpo" on prepared prompts: each rank samples its own prompts' groups
    through the sharded or split training forward (every rank decoding the same number of
    steps), from seeds of the prompt and the completion's number, so the layouts sample the
    completions one process samples; a reward of the working directory's module scores
    them with varied values (an untrained model answers no sum right)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = {"cwd": tmp_path, "env": env, "check": True, "capture_output": True, "timeout": 300}
    (tmp_path / "grpo_check_reward.py").write_text(GRPO_REWARD)
    example = [sys.executable, "-m", "examples.chat_conversations", "--prompts"]
    subprocess.run([*example, "--count", "32", "--output", "prompts.jsonl"], **run)
    prepare = [sys.executable, "-m", "kempnerforge", "prepare-data", "--format", "prompts"]
    warm_process.run(
        [*prepare, "--seq-len", "64", "--input", "prompts.jsonl", "--output", "prompts"], **run
    )
    worlds = {"dp_shard=2": "2", "tp=2": "2"}
    grpo = ["--train.loss_fn=grpo", f"--data.path={tmp_path / 'prompts'}", "--data.eval_path="]
    grpo += ["--eval.interval=0", "--train.seq_len=64", "--model.max_seq_len=64"]
    grpo += ["--grpo.group_size=4", "--grpo.max_new_tokens=8", "--grpo.iterations=2"]
    grpo += ["--grpo.reward=grpo_check_reward:digits", "--grpo.kl_beta=0.1"]
    grpo += ["--train.batch_size=8"]  # 8 completions a step: one group per rank at dp_shard=2
    proc = check_parallel(
        "--layouts", *worlds, "--steps", "3", *grpo, "--optimizer.lr=1e-2",
        cwd=tmp_path, cache=builtin_cache,
    )  # fmt: skip
    assert_every_layout_passes(proc, worlds)
