"""Vision-language runs end to end: the debug config, a saved CLIP tower, freeze stages at
their exact step and across a resume, text-token counting, and bad images at the batch."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
from PIL import Image

from kempnerforge.data.dataset import IGNORE_INDEX
from kempnerforge.data.tokenizer import ByteTokenizer
from kempnerforge.model.heads.head_loss import HeadLossSpec
from kempnerforge.training.forward import vlm_batch_loss
from kempnerforge.training.hooks import StepContext, TrainingHook
from kempnerforge.training.loop import StepResult, TrainingSession, run_training_loop
from kempnerforge.training.resume_plan import resume_session
from tests.support.cli import run_kempnerforge
from tests.support.metrics_rows import events, read_rows, train_rows
from tests.support.resume import (
    assert_tensors_bitwise_equal,
    make_session,
    parameters_of,
)
from tests.support.tiny import tiny_run
from tests.support.vision_towers import save_tiny_clip

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MAX_STEPS = 8
# Decoder frozen at first (only the adapter trains), unfrozen after step 3; the adapter
# frozen after step 5. The encoder stays frozen throughout.
FREEZE = '[{module="encoder", frozen=true}, {module="decoder", frozen=true}]'
SCHEDULE = (
    '[{start_step=3, specs=[{module="decoder", frozen=false}]},'
    ' {start_step=5, specs=[{module="adapter", frozen=true}]}]'
)


def vlm_overrides(run_dir: Path, *extra: str) -> list[str]:
    return tiny_run(
        run_dir,
        None,
        "--vision_encoder.type=random",
        "--vlm.arch=joint_decoder",
        "--vlm.max_text_len=40",
        "--vlm.synthetic_samples=64",
        f"--vlm.freeze={FREEZE}",
        f"--vlm.freeze_schedule={SCHEDULE}",
        f"--train.max_steps={MAX_STEPS}",
        "--train.deterministic=true",
        "--train.sample_tokens=0",
        "--optimizer.lr=3e-3",
        "--eval.interval=0",
        *extra,
    )


class GroupSnapshots(TrainingHook):
    """Each group's parameters (and which have optimizer state) after every step."""

    def __init__(self) -> None:
        self.params: dict[int, dict[str, torch.Tensor]] = {}
        self.with_state: dict[int, set[str]] = {}

    def on_step_end(self, ctx: StepContext) -> None:
        named = dict(ctx.model.named_parameters())
        self.params[ctx.step] = {n: p.detach().clone() for n, p in named.items()}
        ids = {id(p): n for n, p in named.items()}
        self.with_state[ctx.step] = {
            ids[id(p)] for p in ctx.optimizer.state if ctx.optimizer.state[p]
        }


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], group: str) -> bool:
    names = [n for n in before if n.startswith(group + ".")]
    assert names, f"no parameters in group {group}"
    return any(not torch.equal(before[n], after[n]) for n in names)


def test_freeze_stages_apply_at_their_exact_step_and_keep_the_optimizer_consistent(tmp_path):
    session = make_session(vlm_overrides(tmp_path / "run"))
    start = parameters_of(session.model)
    snaps = GroupSnapshots()
    session.hooks.add(snaps)
    with session.tracker:
        step, _ = run_training_loop(session)
    assert step == MAX_STEPS
    p = {0: start, **snaps.params}
    # The encoder never trains; the adapter trains until its stage at step 5.
    for s in range(1, MAX_STEPS + 1):
        assert not changed(p[s - 1], p[s], "encoder")
        assert changed(p[s - 1], p[s], "adapter") == (s <= 5), f"adapter at step {s}"
        # The decoder, frozen at step 0, trains from step 4: its stage applies after step 3.
        assert changed(p[s - 1], p[s], "decoder") == (s >= 4), f"decoder at step {s}"
    # Every parameter is known to the optimizer from the start, frozen or not ...
    known = {id(q) for group in session.optimizer.param_groups for q in group["params"]}
    assert {id(q) for q in session.model.parameters()} <= known
    # ... and only trained groups hold state: the adapter's is dropped when it is frozen.
    assert {n.split(".")[0] for n in snaps.with_state[3]} == {"adapter"}
    assert {n.split(".")[0] for n in snaps.with_state[4]} == {"adapter", "decoder"}
    assert {n.split(".")[0] for n in snaps.with_state[6]} == {"decoder"}
    freezes = events(session.config.run_dir, "freeze")
    assert [(e["step"], e["unfrozen"], e["frozen"]) for e in freezes] == [
        (3, ["decoder"], []),
        (5, [], ["adapter"]),
    ]


class StopAt(TrainingHook):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, ctx: StepContext) -> None:
        if ctx.step == self.step:
            self.session.shutdown_handler.request("test stop")

    session: TrainingSession


@pytest.mark.parametrize("stop_at", [3, 4, 6], ids=["at-unfreeze", "after-unfreeze", "after-both"])
def test_resume_across_a_freeze_stage_matches_the_uninterrupted_run(tmp_path, stop_at):
    whole = make_session(vlm_overrides(tmp_path / "whole"))
    with whole.tracker:
        run_training_loop(whole)

    overrides = vlm_overrides(tmp_path / "split")
    first = make_session(overrides)
    stop = StopAt(stop_at)
    stop.session = first
    first.hooks.add(stop)
    with first.tracker:
        step, _ = run_training_loop(first)
    assert step == stop_at
    saved = first.checkpointer.find_resume_path()
    assert saved is not None and saved.endswith(f"step_{stop_at}")
    extra = first.checkpointer.read_extra(saved)
    frozen = {m["module"]: m["frozen"] for m in extra["vlm_freeze"]}
    assert frozen == {
        "encoder": True,
        "decoder": stop_at < 3,
        "adapter": stop_at >= 5,
    }

    second = make_session(overrides)
    step, tokens = resume_session(second)
    assert step == stop_at
    assert {n: q.requires_grad for n, q in second.model.named_parameters()} == {
        n: q.requires_grad for n, q in first.model.named_parameters()
    }
    with second.tracker:
        final, _ = run_training_loop(second, step=step, tokens_seen=tokens)
    assert final == MAX_STEPS
    want = {r["step"]: r for r in train_rows(whole.config.run_dir)}
    for row in train_rows(second.config.run_dir):
        if row["step"] > stop_at:
            for key in ("loss", "grad_norm", "tokens_seen"):
                assert row[key] == want[row["step"]][key], (row["step"], key)
    assert_tensors_bitwise_equal(parameters_of(second.model), parameters_of(whole.model), "final")


def test_a_resume_with_a_schedule_that_rewrites_the_past_is_refused(tmp_path):
    overrides = vlm_overrides(tmp_path / "run")
    first = make_session(overrides)
    stop = StopAt(4)
    stop.session = first
    first.hooks.add(stop)
    with first.tracker:
        run_training_loop(first)
    rewritten = vlm_overrides(
        tmp_path / "run",
        '--vlm.freeze_schedule=[{start_step=6, specs=[{module="decoder", frozen=false}]}]',
    )
    from kempnerforge.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"vlm\.freeze_schedule.*decoder trainable there, frozen"):
        resume_session(make_session(rewritten))


def test_tokens_seen_counts_the_supervised_text_tokens(tmp_path):
    session = make_session(
        vlm_overrides(tmp_path / "run", "--vlm.freeze=[]", "--vlm.freeze_schedule=[]")
    )
    drawn: list[torch.Tensor] = []
    inner = session.batches.next_batch

    def recording() -> dict[str, torch.Tensor]:
        batch = inner()
        drawn.append(batch["labels"].clone())
        return batch

    session.batches.next_batch = recording  # type: ignore[method-assign]
    with session.tracker:
        _, tokens_seen = run_training_loop(session)
    supervised = sum(int((labels != IGNORE_INDEX).sum()) for labels in drawn)
    assert tokens_seen == supervised
    assert tokens_seen < MAX_STEPS * 4 * 40  # padding is not counted
    rows = train_rows(session.config.run_dir)
    assert rows[-1]["tokens_seen"] == supervised


def test_a_vlm_step_without_a_text_token_count_raises(tmp_path):
    session = make_session(vlm_overrides(tmp_path / "run"))
    inner = session.step_fn

    def uncounted(s: TrainingSession, step: int) -> StepResult:
        result = inner(s, step)
        return StepResult(loss=result.loss, grad_norm=result.grad_norm)

    session.step_fn = uncounted
    with session.tracker, pytest.raises(RuntimeError, match="no text_tokens"):
        run_training_loop(session)


def test_copying_the_input_token_cannot_lower_the_loss(tmp_path):
    """The labels are the next tokens: a model that echoes its input scores worse than
    knowing nothing, and one that predicts the next token scores ~0."""
    session = make_session(vlm_overrides(tmp_path / "run"))
    batch = next(session.data.eval_batches(1, 8))
    supervised = int((batch["labels"] != IGNORE_INDEX).sum())
    vocab = session.config.model.vocab_size

    class Echo(torch.nn.Module):
        def __init__(self, source: str) -> None:
            super().__init__()
            self.source = source

        def forward(self, pixels: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
            ids = input_ids if self.source == "input" else batch["labels"].clamp(min=0)
            return 30.0 * torch.nn.functional.one_hot(ids, vocab).float()

    spec = HeadLossSpec(0, 0.0)
    copy = float(vlm_batch_loss(Echo("input"), batch, batch, spec)) / supervised
    oracle = float(vlm_batch_loss(Echo("labels"), batch, batch, spec)) / supervised
    assert copy > math.log(vocab)
    assert oracle < 1e-6


def test_a_saved_clip_tower_trains_with_its_weights_frozen(tmp_path):
    tower = save_tiny_clip(tmp_path / "clip", whole_model=True)
    session = make_session(
        vlm_overrides(
            tmp_path / "run",
            "--vision_encoder.type=clip",
            f"--vision_encoder.path={tower}",
            "--vlm.freeze_schedule=[]",
            '--vlm.freeze=[{module="encoder", frozen=true}]',
            "--adapter.type=pool",
            "--eval.interval=4",
            "--eval.steps=2",
        )
    )
    before = parameters_of(session.model)
    with session.tracker:
        step, _ = run_training_loop(session)
    assert step == MAX_STEPS
    after = parameters_of(session.model)
    assert not changed(before, after, "encoder")
    assert changed(before, after, "adapter") and changed(before, after, "decoder")
    rows = train_rows(session.config.run_dir)
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]


def run_cli(*args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return run_kempnerforge(*args, cwd=cwd, env_extra={"PYTHONPATH": str(REPO)}, timeout=timeout)


def test_vlm_debug_config_trains_end_to_end_on_cpu(tmp_path):
    schedule = '--vlm.freeze_schedule=[{start_step=4, specs=[{module="decoder", frozen=false}]}]'
    done = run_cli(
        "train",
        str(REPO / "configs/train/vlm_debug.toml"),
        f"--train.run_dir={tmp_path / 'run'}",
        "--train.max_steps=8",
        "--eval.interval=4",
        "--eval.steps=2",
        "--checkpoint.interval=4",
        "--metrics.log_interval=2",
        "--train.sample_tokens=8",
        schedule,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "caption of image 0: 'a " in done.stdout
    rows = read_rows(tmp_path / "run")
    freeze = [r for r in rows if r.get("event") == "freeze"]
    assert [(r["step"], r["unfrozen"]) for r in freeze] == [(4, ["decoder"])]
    assert any("eval_loss" in r for r in rows)
    assert (tmp_path / "run" / "checkpoints" / "step_8").is_dir()
    # The standalone eval reads the VLM checkpoint with the VLM's own forward.
    evaluated = run_cli(
        "eval",
        str(tmp_path / "run" / "config.toml"),
        "--checkpoint",
        str(tmp_path / "run" / "checkpoints" / "step_8"),
        cwd=tmp_path,
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "checkpoints" / "step_8" / "eval.json").read_text())
    final_eval = [r for r in rows if "eval_loss" in r][-1]
    assert report["metrics"]["eval_loss"] == pytest.approx(final_eval["eval_loss"], rel=1e-5)


def write_index_with_a_corrupt_image(root: Path, count: int = 12) -> Path:
    tokenizer = ByteTokenizer()
    del tokenizer
    (root / "img").mkdir(parents=True)
    with open(root / "pairs.jsonl", "w") as f:
        for i in range(count):
            Image.new("RGB", (40, 30), (20 * i, 100, 200)).save(root / "img" / f"{i}.png")
            f.write(json.dumps({"image": f"img/{i}.png", "text": f"picture {i}"}) + "\n")
    (root / "img" / "5.png").write_bytes(b"this is not an image")
    return root / "pairs.jsonl"


@pytest.mark.parametrize("workers", [0, 1])
def test_a_corrupt_image_at_the_batch_stops_the_run_naming_the_file(tmp_path, workers):
    index = write_index_with_a_corrupt_image(tmp_path)
    done = run_cli(
        "train",
        str(REPO / "configs/train/vlm_debug.toml"),
        f"--train.run_dir={tmp_path / 'run'}",
        "--train.max_steps=6",
        "--train.batch_size=4",
        "--data.shuffle=false",
        f"--data.num_workers={workers}",
        f"--vlm.data={index}",
        "--vlm.bad_images=fail",
        "--vlm.freeze_schedule=[]",
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "img/5.png (line 6 of" in last and "vlm.bad_images = 'skip'" in last, last
    assert "Traceback" not in done.stderr


def test_a_corrupt_image_is_skipped_and_reported_when_configured(tmp_path):
    index = write_index_with_a_corrupt_image(tmp_path)
    done = run_cli(
        "train",
        str(REPO / "configs/train/vlm_debug.toml"),
        f"--train.run_dir={tmp_path / 'run'}",
        "--train.max_steps=4",
        "--train.batch_size=4",
        "--data.shuffle=false",
        f"--vlm.data={index}",
        "--vlm.freeze_schedule=[]",
        "--train.sample_tokens=0",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "skipping unreadable image" in done.stderr and "img/5.png" in done.stderr


class NaNOnCalls:
    """Test-only fault injection: a NaN loss on chosen (1-based) micro-batch calls."""

    def __init__(self, real, bad: set[int]) -> None:
        self.real, self.bad, self.calls = real, bad, 0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        loss = self.real(logits, labels)
        return loss * float("nan") if self.calls in self.bad else loss


def optimizer_counts(session: TrainingSession) -> tuple[int | None, int | None]:
    """The decoder's and the adapter's optimizer step counts; None without state."""
    named = dict(session.model.named_parameters())

    def count(name: str) -> int | None:
        state = session.optimizer.state.get(named[name], {})
        return int(state["step"]) if "step" in state else None

    return count("decoder.norm.weight"), count("adapter.fc1.weight")


def test_a_nan_rollback_across_freeze_stages_restores_the_checkpoints_optimizer_state(tmp_path):
    overrides = vlm_overrides(
        tmp_path / "run",
        "--train.loss_chunk_tokens=0",
        "--checkpoint.interval=4",
        "--train.nan_consecutive_max=2",
        "--train.attribute_faults=false",  # two tries, not a try and its re-run
    )
    session = make_session(overrides)
    session.loss_fn = NaNOnCalls(session.loss_fn, {6, 7})  # both attempts at step 6
    starts: list[tuple[int | None, int | None]] = []
    inner = session.step_fn

    def noting(s: TrainingSession, step: int) -> StepResult:
        starts.append(optimizer_counts(s))
        return inner(s, step)

    session.step_fn = noting
    with session.tracker:
        step, _ = run_training_loop(session)
    assert step == MAX_STEPS
    [rollback] = events(session.config.run_dir, "nan_rollback")
    assert rollback["step"] == 4
    # Decoder trained from step 4, adapter until step 5 (its state dropped when frozen).
    before = [(None, None), (None, 1), (None, 2), (None, 3), (1, 4), (2, None), (2, None)]
    assert starts[:7] == before
    # Back at the checkpoint of step 4: the adapter, frozen in the live run, is trainable
    # again with the moments it had then, and the decoder has its step-4 moments.
    assert starts[7] == (1, 4)
    rows = events(session.config.run_dir, "freeze")
    freezes = [(e["step"], e["unfrozen"], e["frozen"]) for e in rows]
    assert freezes == [(3, ["decoder"], []), (5, [], ["adapter"]), (5, [], ["adapter"])]
