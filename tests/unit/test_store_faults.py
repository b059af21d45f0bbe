"""A checkpoint store that stalls, resets or throttles, against a real S3 server behind a
fault-injecting proxy: every operation ends within checkpoint.store_timeout_s, a stalled
save is a failed save whose threads end, an abandoned write never lands later, and a resume
whose store fails stops naming the store instead of taking an older checkpoint."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kempnerforge.checkpoint.failures import FailedSave
from kempnerforge.checkpoint.manager import CheckpointManager
from kempnerforge.checkpoint.store import CheckpointStore, CheckpointStoreError
from kempnerforge.config.checkpoint import CheckpointConfig
from kempnerforge.storage.stores import StoreTimeout, filesystem
from tests.support.store_proxy import Fault
from tests.unit.test_checkpoint_store import _parts, _save

TIMEOUT_S = 2.0
"""checkpoint.store_timeout_s here: room for a client's first call (its models loaded, up to
a second on a shared machine) and short enough to keep the tests quick."""
SLACK_S = 2.5
"""Past the deadline, what a failure may take: fsspec looks at a waiting call once a second,
and this machine is shared."""


def _manager(url: str, where, **cfg) -> CheckpointManager:
    config = CheckpointConfig(**{"store_timeout_s": TIMEOUT_S, **cfg})
    return CheckpointManager(config, url, staging_dir=str(where / "staging"))


def _timed(call) -> tuple[BaseException, float]:
    started = time.monotonic()
    with pytest.raises(Exception) as raised:
        call()
    return raised.value, time.monotonic() - started


def _store_threads_end() -> bool:
    """Whether every thread the store started has ended, waiting up to SLACK_S."""
    until = time.monotonic() + SLACK_S
    while time.monotonic() < until:
        if not [t for t in threading.enumerate() if t.name.startswith("kempnerforge-store")]:
            return True
        time.sleep(0.05)
    return False


def _latest(url: str) -> str:
    return filesystem(url).cat_file(f"{url}/latest").decode().strip()


def test_a_request_the_store_never_answers_ends_at_its_deadline_and_is_never_resent(s3_proxy):
    proxy, _, bucket = s3_proxy
    store = CheckpointStore(f"{bucket}/ckpt", timeout_s=TIMEOUT_S, connections=2)
    assert not store.has_marker("step_1")  # the client is ready: only the stall is timed
    with proxy.faults(Fault("stall", method="HEAD")):
        error, elapsed = _timed(lambda: store.has_marker("step_1"))
        time.sleep(TIMEOUT_S)  # a retry of the abandoned call would have come by now
    assert isinstance(error, StoreTimeout), error
    assert "did not answer within checkpoint.store_timeout_s = 2 s" in str(error)
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + SLACK_S
    assert [s.fault for s in proxy.taken() if s.method == "HEAD"] == ["", "stall"]


def test_resets_slowdowns_and_a_slow_link_are_ridden_out(s3_proxy, tmp_path):
    proxy, _, bucket = s3_proxy
    url = f"{bucket}/ckpt"
    _save(_manager(url, tmp_path / "a", store_timeout_s=30), 2, seed=1)
    faults = (
        Fault("reset", method="GET", path="/step_2/", side="response", after_bytes=200, times=1),
        Fault("503", method="GET", path="/step_2/", times=2),
        Fault("slow", method="GET", path=r"\.distcp$", side="response", bytes_per_s=1 << 20),
    )
    resumed = _manager(url, tmp_path / "b", store_timeout_s=30)
    with proxy.faults(*faults) as applied:
        path = resumed.find_resume_path()
        assert path is not None
        model, optimizer, scheduler = _parts(seed=9)
        resumed.load(path, model=model, optimizer=optimizer, scheduler=scheduler)
    assert [f.hits for f in applied[:2]] == [1, 2] and applied[2].hits >= 1
    assert torch.equal(model.weight, _parts(seed=1)[0].weight)  # bitwise: the same bytes


def test_a_stalled_upload_fails_the_save_in_time_and_its_threads_end(s3_proxy, tmp_path):
    proxy, _, bucket = s3_proxy
    url = f"{bucket}/ckpt"
    manager = _manager(url, tmp_path)
    with proxy.faults(Fault("stall", method="PUT", path="/step_2/", after_bytes=100)):
        error, elapsed = _timed(lambda: _save(manager, 2))
        assert _store_threads_end()
    assert isinstance(error, FailedSave), error
    assert str(error).startswith(f"{url}: writing checkpoint {url}/step_2 failed")
    assert "took longer than checkpoint.store_timeout_s = 2 s" in error.reason
    assert elapsed < TIMEOUT_S + SLACK_S
    _save(manager, 4)  # the store answers again: the next save goes through
    assert _latest(url) == "step_4"


def test_a_stalled_latest_write_fails_the_save_and_never_lands_later(s3_proxy, tmp_path):
    proxy, server, bucket = s3_proxy
    url = f"{bucket}/ckpt"
    manager = _manager(url, tmp_path)
    _save(manager, 2)
    with proxy.faults(Fault("stall", method="PUT", path=r"/latest$")):
        error, elapsed = _timed(lambda: _save(manager, 4))
        time.sleep(0.2)  # the stall outlasts the call that gave up on it
    assert isinstance(error, FailedSave), error
    assert f"{url}/latest: the store did not answer within" in error.reason
    assert error.problem.endswith("'latest' still names step_2")
    assert elapsed < TIMEOUT_S + SLACK_S
    time.sleep(0.5)  # the stall is over: a write still held or retried would land now
    assert _latest(url) == "step_2"
    _save(manager, 6)
    time.sleep(0.5)
    assert _latest(url) == "step_6"
    written = [r for r in server.taken() if r.method == "PUT" and r.path.endswith("/latest")]
    assert len(written) == 2  # step_2's and step_6's: the abandoned one never reached it


def test_the_listing_before_a_save_is_bounded_too(s3_proxy, tmp_path):
    proxy, _, bucket = s3_proxy
    manager = _manager(f"{bucket}/ckpt", tmp_path)
    with proxy.faults(Fault("stall", method="GET", query="list-type")):
        error, elapsed = _timed(lambda: _save(manager, 2))
    assert isinstance(error, FailedSave), error
    assert "did not answer within checkpoint.store_timeout_s = 2 s" in error.reason
    assert elapsed < TIMEOUT_S + SLACK_S


def test_a_stalled_read_at_resume_names_the_store_instead_of_taking_an_older_checkpoint(
    s3_proxy, tmp_path
):
    proxy, _, bucket = s3_proxy
    url = f"{bucket}/ckpt"
    manager = _manager(url, tmp_path / "a")
    _save(manager, 2, seed=1)
    _save(manager, 4, seed=2)
    resumed = _manager(url, tmp_path / "b")
    with proxy.faults(Fault("stall", method="GET", path="/step_4/")):
        error, elapsed = _timed(resumed.newest_complete_path)
    assert isinstance(error, CheckpointStoreError), error
    message = str(error)
    assert message.startswith(
        f"{url}/step_4: the store failed while reading this checkpoint ({url}: reading step_4 "
        "took longer than checkpoint.store_timeout_s = 2 s"
    ), message
    assert "checkpoint.store_timeout_s = 2 s" in message
    assert "resume_from" not in message and str(tmp_path) not in message
    assert elapsed < TIMEOUT_S + SLACK_S
    assert resumed.find_resume_path() == str(tmp_path / "b" / "staging" / "step_4")


def test_with_every_read_stalled_a_resume_fails_within_one_deadline(s3_proxy, tmp_path):
    proxy, _, bucket = s3_proxy
    url = f"{bucket}/ckpt"
    for step in (2, 4, 6):
        _save(_manager(url, tmp_path / "a"), step)
    resumed = _manager(url, tmp_path / "b")
    stalls = (Fault("stall", method="GET"), Fault("stall", method="HEAD"))
    with proxy.faults(*stalls):
        error, elapsed = _timed(resumed.newest_complete_path)
    assert isinstance(error, CheckpointStoreError), error
    assert str(error).startswith(f"{url}: the store failed while listing its checkpoints")
    assert elapsed < TIMEOUT_S + SLACK_S
