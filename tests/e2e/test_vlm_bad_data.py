"""A vision-language run whose image-text pair makes the loss NaN every time: the fault
repeats on the re-run, the pair is recorded as bad data and never read again, in later
epochs, after a rollback and after a crash and resume."""

from __future__ import annotations

from pathlib import Path

import pytest

from kempnerforge.data.bad_windows import BadWindow, read_bad_data
from kempnerforge.data.image_text import ImageTextDataset
from kempnerforge.training.loop import TrainingSession, run_training_loop
from kempnerforge.training.resume_plan import resume_session
from tests.support.faults import PoisonedSamples
from tests.support.image_pairs import write_pairs
from tests.support.metrics_rows import events
from tests.support.resume import bad_data_after_a_crash, make_session
from tests.support.tiny import tiny_run

pytestmark = pytest.mark.slow

PAIRS, BATCH, TEXT_LEN = 24, 4, 16  # 6 steps an epoch


def vlm_overrides(run_dir: Path, index: Path, *extra: str) -> list[str]:
    return tiny_run(
        run_dir,
        None,
        "--vision_encoder.type=random",
        "--vlm.arch=joint_decoder",
        f"--vlm.max_text_len={TEXT_LEN}",
        f"--vlm.data={index}",
        "--data.shuffle=true",
        "--train.attribute_faults=true",
        "--train.loss_chunk_tokens=0",  # the test's loss function sees the labels
        "--train.deterministic=true",
        "--train.sample_tokens=0",
        "--scheduler.name=constant",
        "--eval.interval=0",
        "--checkpoint.interval=2",
        *extra,
    )


def clean_pairs(session: TrainingSession) -> ImageTextDataset:
    dataset = session.data.dataset
    assert isinstance(dataset, ImageTextDataset)
    return ImageTextDataset(dataset.path, dataset.spec, dataset.tokenizer, TEXT_LEN)


@pytest.fixture
def index(tmp_path) -> Path:
    """Pairs whose captions differ, so a label row names its pair."""
    return write_pairs(tmp_path / "pairs", [f"pair number {i}" for i in range(PAIRS)])


def test_a_poisoned_pair_is_recorded_and_never_read_again(tmp_path, index):
    overrides = vlm_overrides(
        tmp_path / "run",
        index,
        "--train.max_steps=24",
        "--train.nan_consecutive_max=1",  # the bad step also rolls back to step 2
    )
    session = make_session(overrides)
    sampler = session.data.sampler
    assert sampler is not None and sampler.samples_per_rank == PAIRS
    poisoned_pair = sampler.rank_index(0, 2 * BATCH + 1)  # read by step 3
    poisoned = PoisonedSamples(session.loss_fn, clean_pairs(session), [poisoned_pair])
    session.loss_fn = poisoned
    with session.tracker:
        assert run_training_loop(session)[0] == 24
    run_dir = session.config.run_dir
    step_three = [sampler.rank_index(0, p) for p in range(2 * BATCH, 3 * BATCH)]
    [bad] = events(run_dir, "bad_data")
    assert bad["step"] == 3 and bad["reason"] == "non_finite"
    assert bad["windows"] == [[str(index), w] for w in step_three]
    # Image-text samples are recorded with window length 0: entries, not token windows.
    assert read_bad_data(session.checkpointer.directory) == sorted(
        BadWindow(str(index), w, 0) for w in step_three
    )
    assert events(run_dir, "nan_rollback")[0]["step"] == 2
    assert not events(run_dir, "suspected_hardware_fault")
    # Read twice (the try and its re-run), never after: not after the rollback, nor in
    # the three later epochs.
    assert sum(row in poisoned.poison for row in poisoned.rows) == 2


def test_after_a_crash_and_resume_the_recorded_pairs_read_their_stand_ins(tmp_path, index):
    overrides = vlm_overrides(tmp_path / "run", index, "--train.max_steps=16")
    first = make_session(overrides)
    assert first.data.sampler is not None
    poisoned_pair = first.data.sampler.rank_index(0, 2 * BATCH + 1)
    first.loss_fn = PoisonedSamples(first.loss_fn, clean_pairs(first), [poisoned_pair])
    # The fault is recorded at step 3; no checkpoint since step 2.
    bad = bad_data_after_a_crash(first, 3)
    assert poisoned_pair in bad

    resumed = make_session(overrides)
    clean = clean_pairs(resumed)
    watcher = PoisonedSamples(resumed.loss_fn, clean, [poisoned_pair])
    resumed.loss_fn = watcher
    with resumed.tracker:
        step, tokens_seen = resume_session(resumed)
        assert step == 2  # the checkpoint before the fault
        assert run_training_loop(resumed, step=step, tokens_seen=tokens_seen)[0] == 16
    assert not watcher.poison & set(watcher.rows), "a recorded pair was fed again"
    # Every other pair is where the data order puts it; each recorded one reads the next
    # pair of the index that is not recorded.
    sampler = resumed.data.sampler
    assert sampler is not None
    expected = []
    for p in range(2 * BATCH, 16 * BATCH):
        epoch, position = divmod(p, PAIRS)
        pair = sampler.rank_index(epoch, position)
        while pair in bad:
            pair = (pair + 1) % PAIRS
        expected.append(clean[pair]["labels"].numpy().tobytes())
    assert watcher.rows == expected
