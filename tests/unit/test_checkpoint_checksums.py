"""A flipped bit inside a saved tensor is found by the checksums recorded while it was written.

'auto' (a resume, and a NaN rollback) falls back to the previous complete checkpoint with a
warning naming the file; an explicit checkpoint.resume_from refuses it naming the file, as
one line and exit 1 from the command. A checkpoint of an older version, which has no
checksums, still loads.
"""

from __future__ import annotations

import json
import threading
import zlib
from pathlib import Path

import pytest
import torch

from kempnerforge.checkpoint import checksums
from kempnerforge.checkpoint.integrity import checkpoint_problems
from kempnerforge.checkpoint.manager import CheckpointError
from kempnerforge.cli import main
from kempnerforge.training.hooks import TrainingHook
from kempnerforge.training.loop import run_training_loop
from kempnerforge.training.resume_plan import resume_session
from tests.support.metrics_rows import events
from tests.support.resume import make_session
from tests.unit.test_checkpoint import REPO, _build, _load, _manager, _save, _train
from tests.unit.test_nan_rollback import PoisonedLoss
from tests.unit.test_nan_rollback import make_session as make_poisoned_session

MODES = ["disabled", "async"]


def _flip_a_bit_inside(path: Path, tensor: torch.Tensor) -> str:
    """Flip one bit in the middle of `tensor`'s bytes inside a DCP file of checkpoint
    `path` (the zip records around it stay intact); return that file's name."""
    raw = tensor.detach().float().contiguous().numpy().tobytes()
    for file in sorted(path.glob("*.distcp")):
        data = bytearray(file.read_bytes())
        at = data.find(raw)
        if at >= 0:
            data[at + len(raw) // 2] ^= 0x10
            file.write_bytes(bytes(data))
            return file.name
    raise AssertionError(f"no DCP file of {path} holds the tensor's bytes")


def _mismatch(name: str) -> str:
    return f"{name} does not match its checksum in checksums_rank0.json (crc32 "


@pytest.mark.parametrize("mode", MODES)
def test_every_file_a_rank_writes_has_its_checksum(tmp_path, monkeypatch, mode):
    threads = set()
    real_write = checksums._HashingStream.write

    def write(self, data):
        threads.add(threading.current_thread().name)
        return real_write(self, data)

    monkeypatch.setattr(checksums._HashingStream, "write", write)
    manager = _manager(tmp_path, async_mode=mode)
    path = Path(_save(manager, 3))
    manager.wait()
    recorded = json.loads((path / "checksums_rank0.json").read_text())
    names = {p.name for p in path.iterdir()} - {"complete.json", "checksums_rank0.json"}
    assert recorded["kind"] == "crc32" and set(recorded["files"]) == names
    for name, entry in recorded["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"crc32": zlib.crc32(data), "bytes": len(data)}, name
    assert json.loads((path / "complete.json").read_text())["checksums"] == "crc32"
    # Hashed as DCP wrote: on the writer's thread, in the background when async.
    assert (threading.main_thread().name in threads) == (mode == "disabled")


@pytest.mark.parametrize("mode", MODES)
def test_a_flipped_bit_in_a_tensor_makes_auto_fall_back_naming_the_file(tmp_path, log, mode):
    manager = _manager(tmp_path, async_mode=mode)
    parts = _build()
    _train(*parts, range(3))
    _save(manager, 3, parts)
    _train(*parts, range(3, 6))
    _save(manager, 6, parts)
    manager.wait()
    newest = manager.directory / "step_6"
    name = _flip_a_bit_inside(newest, parts[0][0].weight)
    [problem] = checkpoint_problems(newest)
    assert problem.startswith(_mismatch(name)) and "read" in problem and "written" in problem

    assert _manager(tmp_path).find_resume_path() == str(manager.directory / "step_3")
    assert f"skipped {newest} named by 'latest' ({problem})" in log.text
    # A NaN rollback judges the checkpoint afresh, although this manager wrote it.
    assert manager.newest_complete_path() == str(manager.directory / "step_3")
    explicit = _manager(tmp_path, resume_from=str(newest))
    with pytest.raises(CheckpointError) as error:
        explicit.find_resume_path()
    assert str(error.value) == f"{newest}: not a complete checkpoint: {problem}"
    with pytest.raises(CheckpointError, match=_mismatch(name).replace("(", r"\(")):
        _load(_manager(tmp_path), str(newest))


@pytest.mark.parametrize("mode", MODES)
def test_a_run_resumes_from_the_checkpoint_before_a_damaged_one(tiny_overrides, log, mode):
    overrides = [*tiny_overrides, "--train.max_steps=4", "--checkpoint.interval=2"]
    first = make_session([*overrides, f"--checkpoint.async_mode={mode}"])
    with first.tracker:
        run_training_loop(first)
    newest = first.checkpointer.directory / "step_4"
    name = _flip_a_bit_inside(newest, first.model.tok_embeddings.weight)
    resumed = make_session([*tiny_overrides, "--train.max_steps=6", "--checkpoint.interval=2"])
    with resumed.tracker:
        assert resume_session(resumed)[0] == 2
    assert f"skipped {newest} named by 'latest' ({_mismatch(name)}" in log.text


class _DamageOnCommit(TrainingHook):
    """Fault injection: flips a bit in the checkpoint of `step` once it is committed."""

    def __init__(self, session, step: int) -> None:
        self.session, self.step, self.damaged = session, step, ""

    def on_checkpoint_save(self, step: int, path: str) -> None:
        if step == self.step:
            weight = self.session.model.tok_embeddings.weight
            self.damaged = _flip_a_bit_inside(Path(path), weight)


def test_a_nan_rollback_skips_a_damaged_checkpoint(tiny_overrides):
    session = make_poisoned_session(
        [
            *tiny_overrides,
            "--train.max_steps=6",
            "--checkpoint.interval=2",
            "--train.nan_consecutive_max=2",
            "--scheduler.name=constant",
        ]
    )
    session.loss_fn = PoisonedLoss(session.loss_fn, {5, 6})  # the attempts after step 4
    damage = _DamageOnCommit(session, 4)
    session.hooks.add(damage)
    with session.tracker:
        run_training_loop(session)
    assert damage.damaged
    [rollback] = events(session.config.run_dir, "nan_rollback")
    assert rollback["from_step"] == 4 and rollback["path"].endswith("step_2")


def test_an_explicit_damaged_resume_from_exits_1_with_one_line_naming_the_file(
    tiny_overrides, capsys
):
    source = make_session([*tiny_overrides, "--train.max_steps=2"])
    with source.tracker:
        run_training_loop(source)
    path = source.checkpointer.directory / "step_2"
    name = _flip_a_bit_inside(path, source.model.tok_embeddings.weight)
    run_dir = Path(source.config.run_dir).parent / "other"
    overrides = [o for o in tiny_overrides if not o.startswith("--train.run_dir")]
    code = main(
        [
            "train",
            str(REPO / "configs" / "train" / "debug.toml"),
            *overrides,
            "--model.n_kv_heads=2",
            f"--train.run_dir={run_dir}",
            f"--checkpoint.resume_from={path}",
        ]
    )
    lines = [line for line in capsys.readouterr().err.splitlines() if "kempnerforge:" in line]
    assert code == 1, lines
    assert len(lines) == 1 and "Traceback" not in lines[0]
    assert lines[0].startswith(
        f"kempnerforge: checkpoint error: {path}: not a complete checkpoint: {_mismatch(name)}"
    )


def test_a_checkpoint_without_checksums_still_loads_with_one_info_line(tmp_path, log):
    manager = _manager(tmp_path)
    path = Path(_save(manager, 3))
    (path / "checksums_rank0.json").unlink()
    marker = json.loads((path / "complete.json").read_text())
    del marker["checksums"]  # what an older version wrote
    (path / "complete.json").write_text(json.dumps(marker))
    older = _manager(tmp_path)
    assert older.find_resume_path() == str(path)
    assert _load(older, str(path))["step"] == 3
    notes = [r.getMessage() for r in log.records if "holds no checksums" in r.getMessage()]
    assert notes == [
        f"{path} holds no checksums (saved by an older version): its files are checked for "
        "length and structure only"
    ]


def test_a_missing_checksum_file_makes_a_new_checkpoint_incomplete(tmp_path):
    manager = _manager(tmp_path)
    path = Path(_save(manager, 3))
    (path / "checksums_rank0.json").unlink()
    assert checkpoint_problems(path) == [
        "checksums_rank0.json is missing (complete.json says every rank recorded checksums)"
    ]
