"""Checkpoints in an object store across ranks, against a real S3 server (moto's, in the
test process; the ranks reach it through its endpoint): two ranks save, each uploads its
own files, and a resume on two ranks fetches each rank's own share, and on one process the
whole checkpoint, resharded; a run with local checkpoints starts from it by its URL."""

from __future__ import annotations

from collections import Counter

import pytest

from kempnerforge.storage.stores import filesystem
from tests.support.tiny import tiny_run
from tests.support.train_run import train_ranks

pytestmark = pytest.mark.distributed


def _step_3_gets(server, *, ranged: bool) -> Counter[str]:
    """GETs of step_3's objects by name: whole-object reads, or ranged reads."""
    return Counter(
        r.path.rsplit("/", 1)[-1]
        for r in server.taken()
        if r.method == "GET" and "/step_3/" in r.path and bool(r.range) == ranged
    )


def test_two_ranks_save_into_a_store_and_resume_on_two_ranks_and_on_one(s3, token_dirs, tmp_path):
    server, bucket = s3
    url = f"{bucket}/ranks"
    base = tiny_run(None, token_dirs, "--checkpoint.interval=3", f"--checkpoint.dir={url}")
    saved = train_ranks(base, tmp_path / "two", 2, "--train.max_steps=3")
    assert [r["step"] for r in saved] == [3, 3]
    root = url.removeprefix("s3://")
    stored = {p.removeprefix(root + "/step_3/") for p in filesystem(url).find(f"{root}/step_3")}
    assert {"complete.json", "__0_0.distcp", "__1_0.distcp", "train_state_rank1.pt"} <= stored

    server.clear()
    again = train_ranks(base, tmp_path / "two", 2, "--train.max_steps=4")
    assert [(r["start_step"], r["step"]) for r in again] == [(3, 4), (3, 4)]
    whole = _step_3_gets(server, ranged=False)
    # The shared marker and .metadata once per rank; every other file once in all: each
    # rank reads its own files whole.
    assert {name: n for name, n in whole.items() if n != 1} == {"complete.json": 2, ".metadata": 2}
    assert set(whole) == stored
    # What a rank loads from another rank's file (replicated entries DCP saved once) is
    # read by ranges, a few requests, never the whole file.
    ranged = _step_3_gets(server, ranged=True)
    assert set(ranged) <= {"__0_0.distcp", "__1_0.distcp"} and sum(ranged.values()) <= 4

    server.clear()
    one = train_ranks(
        base, tmp_path / "one", 1, "--train.max_steps=5", "--train.use_existing_dir=true"
    )
    assert (one[0]["start_step"], one[0]["step"]) == (4, 5)

    # A run whose own checkpoints are local starts from the store's step_3 by its URL:
    # every rank stages it alike and fetches its own share of it, as a resume does.
    server.clear()
    start = tiny_run(None, token_dirs, f"--checkpoint.resume_from={url}/step_3")
    local = train_ranks(start, tmp_path / "local", 2, "--train.max_steps=4")
    assert [(r["start_step"], r["step"]) for r in local] == [(3, 4), (3, 4)]
    assert _step_3_gets(server, ranged=False) == whole
