"""`kempnerforge train` against a checkpoint store that stalls (the test S3 server behind a
fault-injecting proxy, tests/support/store_proxy.py): a run whose save stalls fails that
save in time, trains to its last step and exits 0; a resume whose store stalls exits 1 in
time with one line naming the store, not the staging folder; and a checkpoint named by a
store URL in checkpoint.resume_from starts a run that continues it exactly."""

from __future__ import annotations

import pathlib
import time

import pytest

from kempnerforge.storage.stores import filesystem
from tests.e2e.test_store_checkpoints import cli_train, losses
from tests.support.cli import run_kempnerforge
from tests.support.metrics_rows import events
from tests.support.store_proxy import Fault
from tests.support.tiny import tiny_run
from tests.support.train_run import train_steps

pytestmark = pytest.mark.slow

TIMEOUT_S = 3
"""checkpoint.store_timeout_s of these runs."""
EXIT_WITHIN_S = 180
"""What a run of a few steps may take here, start-up included; a process that cannot exit
(a thread blocked in a stalled request) runs into it instead."""


def _env(proxy, server, home: pathlib.Path) -> dict[str, str]:
    return {**server.environment(str(home)), "AWS_ENDPOINT_URL": proxy.endpoint}


def _latest(url: str) -> str:
    return filesystem(url).cat_file(f"{url}/latest").decode().strip()


@pytest.mark.parametrize(
    ("stalled", "fault"),
    [
        ("upload", Fault("stall", method="PUT", path="/step_2/", after_bytes=100)),
        ("latest", Fault("stall", method="PUT", path="/latest$", times=1)),
    ],
    ids=["upload", "latest"],
)
def test_a_run_whose_store_stalls_a_save_trains_to_its_end_and_exits(
    s3_proxy, token_dirs, tmp_path, stalled, fault
):
    proxy, server, bucket = s3_proxy
    url = f"{bucket}/stalls"
    run = tmp_path / "run"
    every = ("--train.max_steps=4", "--checkpoint.interval=2")
    args = cli_train(run, token_dirs, *every, f"--checkpoint.store_timeout_s={TIMEOUT_S}")
    with proxy.faults(fault):
        started = time.monotonic()
        result = run_kempnerforge(
            *args,
            f"--checkpoint.dir={url}",
            env_extra=_env(proxy, server, tmp_path),
            timeout=EXIT_WITHIN_S,
        )
        took = time.monotonic() - started
    assert result.returncode == 0, result.stderr[-3000:]
    failed = events(run, "checkpoint_failed")
    assert [(e["step"], e["path"]) for e in failed] == [(2, f"{url}/step_2")]
    assert f"checkpoint.store_timeout_s = {TIMEOUT_S} s" in failed[0]["reason"]
    assert _latest(url) == "step_4" and len(losses(run)) == 4
    assert took < EXIT_WITHIN_S


def test_a_resume_whose_store_stalls_exits_1_in_time_naming_the_store(
    s3_proxy, token_dirs, tmp_path
):
    proxy, server, bucket = s3_proxy
    url = f"{bucket}/resume"
    env = _env(proxy, server, tmp_path)
    run = tmp_path / "run"
    common = (f"--checkpoint.dir={url}", f"--checkpoint.store_timeout_s={TIMEOUT_S}")
    first = run_kempnerforge(
        *cli_train(run, token_dirs, "--train.max_steps=4", "--checkpoint.interval=2"),
        *common,
        env_extra=env,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    again = cli_train(run, token_dirs, "--train.max_steps=6", "--train.use_existing_dir=true")
    with proxy.faults(Fault("stall", method="GET", path="/resume/step_4/")):
        started = time.monotonic()
        result = run_kempnerforge(*again, *common, env_extra=env, timeout=EXIT_WITHIN_S)
        took = time.monotonic() - started
    assert result.returncode == 1, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("kempnerforge:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert lines[0].startswith(
        f"kempnerforge: checkpoint error: {url}/step_4: the store failed while reading this "
        f"checkpoint ({url}: reading step_4 took longer than checkpoint.store_timeout_s = "
        f"{TIMEOUT_S} s"
    ), lines[0]
    assert "resume_from" not in lines[0] and "staging" not in lines[0]
    assert events(run, "resume") == []  # nothing older was taken in its place
    assert took < EXIT_WITHIN_S


def test_a_store_url_in_resume_from_starts_a_run_that_continues_it_exactly(
    s3, token_dirs, tmp_path
):
    _, bucket = s3
    url = f"{bucket}/source"
    steps = ("--train.max_steps=6", "--checkpoint.interval=3")
    whole = train_steps(tiny_run(tmp_path / "whole", token_dirs, *steps))
    source = tiny_run(tmp_path / "source", token_dirs, *steps, f"--checkpoint.dir={url}")
    first = train_steps(source, stop_after=3)
    run = tmp_path / "local"  # its own checkpoints are local: the store's is only its start
    later = train_steps(tiny_run(run, token_dirs, *steps, f"--checkpoint.resume_from={url}/step_3"))
    assert (later["start_step"], later["step"]) == (3, 6)
    assert first["losses"] + later["losses"] == whole["losses"]
    (resumed,) = events(run, "resume")
    assert resumed["path"] == f"{url}/step_3"
    assert (run / "checkpoints" / "step_6" / "complete.json").is_file()
