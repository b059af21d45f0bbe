"""Re-run attribution on two gloo ranks: the rank whose own loss showed the fault is named,
and only its windows are recorded as bad data."""

from __future__ import annotations

import socket

import pytest

from kempnerforge.config.loader import load_config
from kempnerforge.distributed.runtime import init_runtime
from kempnerforge.training.build import build_session
from kempnerforge.training.loop import run_training_loop
from tests.support.dist import run_distributed
from tests.support.metrics_rows import events
from tests.support.tiny import tiny_run

pytestmark = pytest.mark.distributed

ATTRIBUTE = [
    "--train.attribute_faults=true",
    "--train.loss_chunk_tokens=0",
    "--train.max_steps=5",
    "--scheduler.name=constant",
]


class NaNOnRankOne:
    """Test-only fault on rank 1: NaN loss on call ``once`` (machine), or on every call whose
    labels hold ``poison`` (data)."""

    def __init__(self, real, once=None, poison=None):
        self.real, self.once, self.poison, self.calls = real, once, poison, 0

    def __call__(self, logits, labels):
        self.calls += 1
        loss = self.real(logits, labels)
        rows = {r.numpy().tobytes() for r in labels}
        if self.calls == self.once or (self.poison is not None and self.poison in rows):
            return loss * float("nan")
        return loss


def _train(rank: int, world_size: int, overrides: list[str], kind: str) -> dict:
    config = load_config(None, overrides)
    config.validate(world_size)
    session = build_session(config, init_runtime(config.distributed, "cpu"))
    window = session.data.sampler.global_index(0, 1 + 2 * 9)  # rank 1, step 3
    if rank == 1:
        if kind == "machine":
            session.loss_fn = NaNOnRankOne(session.loss_fn, once=3)
        else:
            poison = session.data.dataset[window]["labels"].numpy().tobytes()
            session.loss_fn = NaNOnRankOne(session.loss_fn, poison=poison)
    with session.tracker:
        step, _ = run_training_loop(session)
    rank_one = [session.data.sampler.global_index(0, 1 + 2 * p) for p in range(8, 12)]
    return {"step": step, "host": socket.gethostname(), "window": window, "rank_one": rank_one}


def test_a_fault_on_one_rank_names_that_rank_and_only_its_windows(tmp_path, token_dirs):
    machine = tiny_run(tmp_path / "machine", token_dirs, *ATTRIBUTE)
    records = run_distributed(_train, 2, machine, "machine")
    assert [r["step"] for r in records] == [5, 5]
    [fault] = events(tmp_path / "machine", "suspected_hardware_fault")
    assert fault["step"] == 3 and fault["rank"] == 1 and fault["ranks"] == [1]
    assert fault["host"] == records[1]["host"]

    data = tiny_run(tmp_path / "data", token_dirs, *ATTRIBUTE)
    records = run_distributed(_train, 2, data, "data")
    [bad] = events(tmp_path / "data", "bad_data")
    assert bad["step"] == 3 and bad["dp_ranks"] == [1]
    assert [w for _, w in bad["windows"]] == records[0]["rank_one"]
    assert records[0]["window"] in records[0]["rank_one"]
    assert not events(tmp_path / "data", "suspected_hardware_fault")
