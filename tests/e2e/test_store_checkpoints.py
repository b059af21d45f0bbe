"""Checkpoints in an object store, end to end against a real S3 server (moto's, started by
the tests, reached through s3fs and botocore): a run stopped and resumed from the store
equals an uninterrupted run bit for bit, sync and async; a resume reads only its own
objects; a store that fails mid-save is a failed save the run survives; a bucket it cannot
write stops the launch."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

from kempnerforge.storage.stores import filesystem
from tests.support.cli import run_kempnerforge
from tests.support.metrics_rows import events
from tests.support.threads import PROCESS_THREADS
from tests.support.tiny import tiny_run
from tests.support.train_run import train_steps
from tests.support.warm_process import popen

pytestmark = pytest.mark.slow

DEBUG = str(pathlib.Path(__file__).parents[2] / "configs" / "train" / "debug.toml")


def objects(url: str) -> list[str]:
    fs = filesystem(url)
    root = url.removeprefix("s3://")
    return sorted(p.removeprefix(root + "/") for p in fs.find(root))


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_run_resumed_from_a_store_equals_an_uninterrupted_run(s3, token_dirs, tmp_path, mode):
    server, bucket = s3
    url = f"{bucket}/ckpt"
    steps = ("--train.max_steps=6", "--checkpoint.interval=3", f"--checkpoint.async_mode={mode}")
    whole = train_steps(tiny_run(tmp_path / "whole", token_dirs, *steps))
    parts = tiny_run(tmp_path / "parts", token_dirs, *steps, f"--checkpoint.dir={url}")
    first = train_steps(parts, stop_after=3)
    assert first["step"] == 3
    stored = objects(url)
    assert "latest" in stored and "step_3/complete.json" in stored
    assert filesystem(url).cat_file(f"{url}/latest").decode().strip() == "step_3"
    server.clear()
    second = train_steps(parts)
    assert second["start_step"] == 3 and second["step"] == 6
    assert first["losses"] + second["losses"] == whole["losses"]
    assert first["grad_norms"] + second["grad_norms"] == whole["grad_norms"]
    # The resume read only the marker, .metadata, its own train state, DCP files and
    # checksums of step_3: one GET each, nothing of any other checkpoint.
    reads = [r for r in server.taken() if r.method == "GET" and "/step_3/" in r.path]
    read_names = sorted(r.path.rsplit("/", 1)[-1] for r in reads)
    assert read_names == sorted(
        n.removeprefix("step_3/") for n in stored if n.startswith("step_3/")
    )
    assert "step_6/complete.json" in objects(url)
    assert [e["path"] for e in events(tmp_path / "parts", "resume")] == [f"{url}/step_3"]


def cli_train(run_dir: pathlib.Path, data: tuple[str, str], *extra: str) -> list[str]:
    """`kempnerforge train` of configs/train/debug.toml cut to the tiny run on ``data``."""
    return ["train", DEBUG, *tiny_run(run_dir, data, "--model.n_kv_heads=2", *extra)]


def losses(run_dir: pathlib.Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r and "step" in r}


def test_a_run_resumed_from_the_store_through_the_cli_equals_an_uninterrupted_one(
    s3, token_dirs, tmp_path
):
    server, bucket = s3
    url = f"{bucket}/cli"
    env = server.environment(str(tmp_path))
    every = "--checkpoint.interval=3"
    whole = run_kempnerforge(
        *cli_train(tmp_path / "whole", token_dirs, "--train.max_steps=6", every), env_extra=env
    )
    assert whole.returncode == 0, whole.stderr[-3000:]
    runs = []
    for steps in ("--train.max_steps=3", "--train.max_steps=6"):
        args = cli_train(tmp_path / "parts", token_dirs, steps, every, f"--checkpoint.dir={url}")
        runs.append(run_kempnerforge(*args, "--train.use_existing_dir=true", env_extra=env))
        assert runs[-1].returncode == 0, runs[-1].stderr[-3000:]
    assert "step_3/complete.json" in objects(url) and "step_6/complete.json" in objects(url)
    assert losses(tmp_path / "parts") == losses(tmp_path / "whole")
    assert len(losses(tmp_path / "whole")) == 6


def test_a_bucket_the_job_cannot_write_stops_the_launch_naming_checkpoint_dir(
    s3, token_dirs, tmp_path
):
    server, _ = s3
    url = "s3://kf-no-such-bucket/ckpt"
    env = server.environment(str(tmp_path))
    args = cli_train(tmp_path / "run", token_dirs, "--train.max_steps=2", f"--checkpoint.dir={url}")
    result = run_kempnerforge(*args, env_extra=env)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("kempnerforge:")]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"kempnerforge: error: checkpoint.dir = '{url}'"), lines[0]
    assert "The specified bucket does not exist" in lines[0], lines[0]


@pytest.mark.parametrize(
    ("mode", "fault"), [("disabled", "refuse"), ("async", "refuse"), ("async", "stall")]
)
def test_a_store_failing_mid_upload_is_a_failed_save_and_training_goes_on(
    s3, token_dirs, tmp_path, mode, fault
):
    server, bucket = s3
    url = f"{bucket}/failing"
    run = tmp_path / "run"
    overrides = tiny_run(
        run,
        token_dirs,
        "--train.max_steps=6",
        "--checkpoint.interval=2",
        f"--checkpoint.async_mode={mode}",
        "--checkpoint.store_timeout_s=2",
        f"--checkpoint.dir={url}",
    )
    started = time.monotonic()
    with server.faulting("/failing/step_4/", fault):
        # Only step 4's uploads fail: the store fails it, the run goes on to save step 6
        # (which waits for step 4's outcome first in async mode).
        done = train_steps(overrides)
    assert done["step"] == 6
    assert time.monotonic() - started < 60  # bounded by the timeout, not the store
    failed = events(run, "checkpoint_failed")
    assert [e["step"] for e in failed] == [4]
    assert failed[0]["path"] == f"{url}/step_4"
    expected = "AccessDenied|Access Denied" if fault == "refuse" else "store_timeout_s = 2 s"
    assert re.search(expected, failed[0]["reason"]), failed[0]["reason"]
    stored = objects(url)
    assert "step_4/complete.json" not in stored  # never taken by a reader
    assert {"step_2/complete.json", "step_6/complete.json"} <= set(stored)
    assert filesystem(url).cat_file(f"{url}/latest").decode().strip() == "step_6"
    # Saves are named by their URL; nothing staged outlives its save, failed or not.
    assert events(run, "checkpoint")[0]["path"] == f"{url}/step_2"
    assert not list((run / "checkpoint_staging").glob("step_*"))


def test_retention_deletes_a_checkpoints_marker_before_its_other_objects(s3, token_dirs, tmp_path):
    server, bucket = s3
    url = f"{bucket}/kept"
    overrides = tiny_run(
        tmp_path / "run",
        token_dirs,
        "--train.max_steps=4",
        "--checkpoint.interval=2",
        "--checkpoint.keep_last_n=1",
        f"--checkpoint.dir={url}",
    )
    train_steps(overrides)
    assert {name.split("/")[0] for name in objects(url)} == {"latest", "step_4"}
    taken = server.taken()
    # s3fs deletes one object with DELETE and several with one POST ?delete (keys in the body).
    deleting = [
        i
        for i, r in enumerate(taken)
        if (r.method == "DELETE" and "/kept/step_2/" in r.path)
        or (r.method == "POST" and "delete" in r.query)
    ]
    assert taken[deleting[0]].path.endswith("/kept/step_2/complete.json")
    assert taken[deleting[0]].method == "DELETE" and len(deleting) > 1


def test_a_run_killed_mid_upload_resumes_from_the_previous_checkpoint(s3, token_dirs, tmp_path):
    server, bucket = s3
    url = f"{bucket}/killed"
    every = ("--checkpoint.interval=3", "--checkpoint.async_mode=async")
    args = cli_train(tmp_path / "run", token_dirs, "--train.max_steps=9", *every)
    env = {**os.environ, **server.environment(str(tmp_path)), "OMP_NUM_THREADS": PROCESS_THREADS}
    with server.faulting("/killed/step_6/", "stall"):
        run = popen(
            [sys.executable, "-m", "kempnerforge", *args, f"--checkpoint.dir={url}"],
            cwd=pathlib.Path(__file__).parents[2],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 120
        while not any("/killed/step_6/" in r.path and r.method == "PUT" for r in server.taken()):
            assert run.poll() is None and time.monotonic() < deadline, "no upload of step_6"
            time.sleep(0.05)
        run.kill()  # SIGKILL while step 6's uploads are in flight
        run.wait()
    assert "step_6/complete.json" not in objects(url)
    assert filesystem(url).cat_file(f"{url}/latest").decode().strip() == "step_3"
    resumed = train_steps(
        tiny_run(
            tmp_path / "run",
            token_dirs,
            "--model.n_kv_heads=2",
            "--train.max_steps=9",
            *every,
            f"--checkpoint.dir={url}",
            "--train.use_existing_dir=true",
        ),
        config_path=DEBUG,
    )
    assert (resumed["start_step"], resumed["step"]) == (3, 9)
    stored = objects(url)
    assert {"step_6/complete.json", "step_9/complete.json"} <= set(stored)
    assert filesystem(url).cat_file(f"{url}/latest").decode().strip() == "step_9"


def test_unfinished_multipart_uploads_of_an_interrupted_save_are_aborted(s3, tmp_path):
    from kempnerforge.checkpoint.store import CheckpointStore

    _, bucket = s3
    url = f"{bucket}/parts"
    fs = filesystem(url)
    name = bucket.removeprefix("s3://")
    # What a process killed mid-upload leaves: a multipart upload begun, one part stored.
    for key in ("parts/step_9/__0_0.distcp", "parts/step_12/__1_0.distcp"):
        upload = fs.call_s3("create_multipart_upload", Bucket=name, Key=key)
        fs.call_s3(
            "upload_part",
            Bucket=name,
            Key=key,
            UploadId=upload["UploadId"],
            PartNumber=1,
            Body=b"x" * (5 << 20),
        )
    fs.pipe_file(f"{url}/step_9/.metadata", b"partial")  # step_9 has objects, step_12 none
    fs.call_s3("create_multipart_upload", Bucket=name, Key="elsewhere/big.bin")

    def unfinished() -> list[str]:
        page = fs.call_s3("list_multipart_uploads", Bucket=name)
        return sorted(u["Key"] for u in page.get("Uploads", []))

    store = CheckpointStore(url, timeout_s=30, connections=2)
    assert store.abort_uploads("step_9") == 1
    assert unfinished() == ["elsewhere/big.bin", "parts/step_12/__1_0.distcp"]
    store.delete("step_9")
    assert not fs.exists(f"{url}/step_9/.metadata")
    # A prefix holding nothing but parts is listed by no ls: the sweep before a run's first
    # save also aborts those, under the checkpoint prefix and nowhere else.
    store.remove_unmarked()
    assert unfinished() == ["elsewhere/big.bin"]


def test_a_large_file_is_fetched_in_ranged_parts_side_by_side(s3, tmp_path, monkeypatch):
    from kempnerforge.checkpoint import store as store_module

    server, bucket = s3
    url = f"{bucket}/large"
    data = os.urandom(5 * 1024 + 17)
    filesystem(url).pipe_file(f"{url}/step_1/__0_0.distcp", data)
    filesystem(url).pipe_file(f"{url}/step_1/small.bin", b"abc")
    monkeypatch.setattr(store_module, "DOWNLOAD_PART", 1024)
    store = store_module.CheckpointStore(url, timeout_s=30, connections=4)
    server.clear()
    store.download("step_1", tmp_path / "got", ["__0_0.distcp", "small.bin"])
    assert (tmp_path / "got" / "__0_0.distcp").read_bytes() == data
    assert (tmp_path / "got" / "small.bin").read_bytes() == b"abc"
    ranges = sorted(r.range for r in server.taken() if r.path.endswith("/__0_0.distcp"))
    assert len(ranges) == 6  # 5 whole parts of 1,024 bytes and the last 17
    assert "bytes=5120-5136" in ranges
    assert not list((tmp_path / "got").glob("*.part"))
