"""Re-run attribution in the real loop: a fault that repeats is the data's (its windows are
never read again, across a rollback and a crash and resume), one that does not is the
machine's (named host and rank, the clean re-run's update kept, exit 76 after the limit)."""

from __future__ import annotations

import json
import socket

import pytest
import torch

from kempnerforge.core.errors import HardwareFaultError
from kempnerforge.data.bad_windows import BAD_DATA_FILE, BadWindow, read_bad_data
from kempnerforge.data.dataset import MemoryMappedDataset
from kempnerforge.data.prepare.corpus import prepare_data
from kempnerforge.data.tokenizer import ByteTokenizer
from kempnerforge.resilience.exit_codes import HARDWARE_FAULT, code_of
from kempnerforge.training.faults.attribution import FAULT_HOSTS_ENV
from kempnerforge.training.loop import run_training_loop
from kempnerforge.training.resume_plan import resume_session
from tests.conftest import synthetic_documents
from tests.support.faults import PoisonedSamples
from tests.support.metrics_rows import events, train_rows
from tests.support.resume import bad_data_after_a_crash, make_session
from tests.support.tiny import tiny_run

SEQ, BATCH = 32, 4
ATTRIBUTE = [
    "--train.attribute_faults=true",
    "--train.loss_chunk_tokens=0",  # the test's loss function sees the labels
    "--train.deterministic=true",
    "--scheduler.name=constant",
]


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> tuple[str, str]:
    """A corpus of about 20 steps an epoch, so a run sees every window several times."""
    root = tmp_path_factory.mktemp("small")
    source = root / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in synthetic_documents(24)))
    train, evald = str(root / "train"), str(root / "eval")
    prepare_data([str(source)], train, ByteTokenizer(), eval_fraction=0.1, eval_output_dir=evald)
    return train, evald


def _window_at(session, epoch: int, position: int) -> int:
    return session.data.sampler.rank_index(epoch, position)


def test_a_fault_that_repeats_is_the_datas_and_its_windows_are_never_read_again(
    tmp_path, small_data
):
    overrides = tiny_run(
        tmp_path / "run",
        small_data,
        *ATTRIBUTE,
        "--train.max_steps=60",
        "--checkpoint.interval=2",
        "--train.nan_consecutive_max=1",  # the bad step also rolls back to step 2
    )
    session = make_session(overrides)
    per_epoch = session.data.sampler.samples_per_rank // BATCH
    assert 2 * per_epoch < 60  # every window comes round at least twice more
    poisoned_window = _window_at(session, 0, 2 * BATCH + 1)  # read by step 3
    poisoned = PoisonedSamples(session.loss_fn, session.data.dataset, [poisoned_window])
    session.loss_fn = poisoned
    with session.tracker:
        assert run_training_loop(session)[0] == 60
    run_dir = session.config.run_dir
    [bad] = events(run_dir, "bad_data")
    step_three = [_window_at(session, 0, p) for p in range(2 * BATCH, 3 * BATCH)]
    path = session.data.dataset.path
    assert bad["step"] == 3 and bad["reason"] == "non_finite"
    assert bad["windows"] == [[path, w] for w in step_three]
    assert bad["dp_ranks"] == [0]
    assert read_bad_data(session.checkpointer.directory) == sorted(
        BadWindow(path, w, SEQ) for w in step_three
    )
    [skip] = events(run_dir, "nan_skip")
    assert skip["step"] == 3 and skip["data"].startswith(
        f"epoch 0: windows {', '.join(map(str, step_three))} of "
    )
    assert events(run_dir, "nan_rollback")[0]["step"] == 2
    assert not events(run_dir, "suspected_hardware_fault")
    # The poisoned window was read twice (the try and its re-run), never after, in any epoch.
    assert sum(row in poisoned.poison for row in poisoned.rows) == 2


def test_a_crash_and_resume_before_the_fault_never_feeds_the_bad_windows_again(
    tmp_path, small_data
):
    overrides = tiny_run(
        tmp_path / "run", small_data, *ATTRIBUTE, "--train.max_steps=30", "--checkpoint.interval=2"
    )
    first = make_session(overrides)
    dataset = first.data.dataset
    poisoned_window = _window_at(first, 0, 2 * BATCH + 1)
    first.loss_fn = PoisonedSamples(first.loss_fn, dataset, [poisoned_window])
    # The fault is recorded at step 3; no checkpoint since step 2.
    bad = bad_data_after_a_crash(first, 3)
    assert poisoned_window in bad

    resumed = make_session(overrides)
    clean = MemoryMappedDataset(small_data[0], SEQ)
    watcher = PoisonedSamples(resumed.loss_fn, clean, [poisoned_window])
    resumed.loss_fn = watcher
    with resumed.tracker:
        step, tokens_seen = resume_session(resumed)
        assert step == 2  # the checkpoint before the fault
        assert run_training_loop(resumed, step=step, tokens_seen=tokens_seen)[0] == 30
    assert not watcher.poison & set(watcher.rows), "a bad window was fed again"
    assert len(events(resumed.config.run_dir, "nan_skip")) == 1  # the first launch's only
    # Every other window is where the data order puts it; each bad one reads its stand-in.
    sampler = resumed.data.sampler
    expected = []
    for step in range(2, 30):
        for p in range(step * BATCH, (step + 1) * BATCH):
            epoch, position = divmod(p, sampler.samples_per_rank // BATCH * BATCH)
            window = sampler.rank_index(epoch, position)
            read = _stand_in(window, bad, len(clean))
            expected.append(clean[read]["labels"].numpy().tobytes())
    assert watcher.rows == expected


def _stand_in(window: int, bad: set[int], size: int) -> int:
    while window in bad:
        window = (window + 1) % size
    return window


class CorruptOnce:
    """Test-only machine fault: one parameter's gradient is NaN on one backward pass."""

    def __init__(self, param: torch.nn.Parameter, on_call: int):
        self.on_call, self.calls = on_call, 0
        param.register_hook(self)

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return grad * float("nan") if self.calls == self.on_call else grad


def test_a_fault_that_does_not_repeat_is_the_machines_and_the_clean_rerun_is_the_step(
    tiny_overrides,
):
    overrides = [*tiny_overrides, *ATTRIBUTE]
    clean = make_session([*overrides, "--train.run_dir=" + _sibling(tiny_overrides, "clean")])
    with clean.tracker:
        run_training_loop(clean)
    faulty = make_session(overrides)
    hook = CorruptOnce(next(faulty.model.parameters()), on_call=4)
    with faulty.tracker:
        assert run_training_loop(faulty)[0] == 6
    assert hook.calls == 7  # six steps and one re-run
    run_dir = faulty.config.run_dir
    [fault] = events(run_dir, "suspected_hardware_fault")
    assert fault["step"] == 4 and fault["reason"] == "non_finite"
    assert fault["host"] == socket.gethostname() and fault["rank"] == 0
    assert fault["count"] == 1 and fault["grad_norm"] is None
    assert not events(run_dir, "nan_skip") and not events(run_dir, "bad_data")
    assert not (faulty.checkpointer.directory / BAD_DATA_FILE).exists()
    # The run is the uninterrupted one, bit for bit.
    assert [r["loss"] for r in train_rows(run_dir)] == [
        r["loss"] for r in train_rows(clean.config.run_dir)
    ]
    for a, b in zip(clean.model.parameters(), faulty.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_too_many_hardware_faults_stop_the_run_with_exit_code_76(
    tiny_overrides, tmp_path, monkeypatch
):
    hosts = tmp_path / "fault-hosts"
    monkeypatch.setenv(FAULT_HOSTS_ENV, str(hosts))
    session = make_session([*tiny_overrides, *ATTRIBUTE, "--train.max_hardware_faults=2"])
    param = next(session.model.parameters())
    CorruptOnce(param, on_call=2)
    CorruptOnce(param, on_call=4)  # step 3 (call 3 is the first fault's re-run)
    with session.tracker, pytest.raises(HardwareFaultError) as info:
        run_training_loop(session)
    assert code_of(info.value) == HARDWARE_FAULT == 76
    message = str(info.value)
    assert message.startswith("2 suspected hardware faults in this launch")
    assert f"the last at step 3 on host {socket.gethostname()}, rank 0" in message
    assert hosts.read_text() == f"{socket.gethostname()}\n" * 2
    assert len(events(session.config.run_dir, "suspected_hardware_fault")) == 2


def test_a_spike_that_repeats_is_the_datas(tiny_overrides):
    overrides = [*tiny_overrides, *ATTRIBUTE, "--train.spike_window=4", "--train.spike_sigmas=3"]
    session = make_session(overrides)
    window = _window_at(session, 0, 5 * BATCH)  # read by step 6
    target = session.data.dataset[window]["labels"].numpy().tobytes()
    real = session.loss_fn

    def spiking(logits, labels):
        loss = real(logits, labels)
        return loss * 50.0 if target in {r.numpy().tobytes() for r in labels} else loss

    session.loss_fn = spiking
    with session.tracker:
        run_training_loop(session)
    [bad] = events(session.config.run_dir, "bad_data")
    assert bad["step"] == 6 and bad["reason"] == "loss_spike"
    assert [session.data.dataset.path, window] in bad["windows"]
    [skip] = events(session.config.run_dir, "nan_skip")
    assert skip["reason"] == "loss_spike"


def _sibling(overrides: list[str], name: str) -> str:
    run_dir = next(o for o in overrides if o.startswith("--train.run_dir="))
    return run_dir.split("=", 1)[1] + "-" + name
