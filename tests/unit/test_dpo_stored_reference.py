"""dpo.reference = "stored": the first launch computes every window's reference
log-probability with the frozen reference and writes it beside the corpus; training reads the
values with the data (no reference is built for the steps) and logs what a live reference's
run logs; a later launch reads the file back; other reference weights get a file of their
own."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kempnerforge.config.loader import load_config
from kempnerforge.core.errors import ConfigError
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.model.heads import IGNORE_INDEX
from kempnerforge.training.build import build_session
from kempnerforge.training.loop import run_training_loop
from kempnerforge.training.objectives import REF_LOGPS
from kempnerforge.training.objectives.stored_reference import share_bounds
from tests.support.chat_files import example_preference_corpus
from tests.support.metrics_rows import train_rows
from tests.support.tiny import preference_run

SEQ = 96


@pytest.fixture
def prefs(tmp_path):
    return example_preference_corpus(tmp_path, 10, SEQ)


def _config(run_dir, prefs, *extra: str):
    return load_config(
        None,
        preference_run(
            run_dir, prefs, SEQ, "--dpo.beta=0.5", "--train.max_steps=3",
            "--train.batch_size=4", "--checkpoint.interval=0", *extra,
        ),
    )  # fmt: skip


def _logp(model, sample) -> float:
    logits = model(sample["input_ids"][None]).float()
    losses = F.cross_entropy(
        logits[0], sample["labels"], reduction="none", ignore_index=IGNORE_INDEX
    )
    return -float(losses.sum())


def _stored_files(prefs) -> list:
    return sorted((prefs / "reference").glob("*.npy"))


def test_stored_values_are_the_references_and_train_as_the_live_reference_does(
    tmp_path, prefs, caplog
):
    caplog.set_level(logging.INFO)
    stored = build_session(
        _config(tmp_path / "stored", prefs, "--dpo.reference=stored"), RuntimeContext()
    )
    (path,) = _stored_files(prefs)
    manifest = json.loads(path.with_name(path.name + ".json").read_text())
    dataset = stored.data.dataset
    assert manifest["windows"] == len(dataset) == 20 and manifest["seq_len"] == SEQ
    assert manifest["reference"] == "seed 42" and manifest["compute_dtype"] == "fp32"
    values = np.load(path, allow_pickle=False)
    with torch.no_grad():  # the session's model is still the seed's weights: the reference
        for window in range(len(dataset)):
            want = _logp(stored.model, dataset[window])
            assert math.isclose(float(values[window]), want, rel_tol=1e-6, abs_tol=1e-5)
            assert float(dataset[window][REF_LOGPS]) == float(values[window])

    live = build_session(_config(tmp_path / "live", prefs), RuntimeContext())
    for session in (stored, live):
        run_training_loop(session)
        session.tracker.close()
    stored_rows, live_rows = train_rows(tmp_path / "stored"), train_rows(tmp_path / "live")
    assert len(stored_rows) == len(live_rows) == 3
    for got, want in zip(stored_rows, live_rows, strict=True):
        for key in ("loss", "grad_norm", "rewards/margins", "logps/rejected"):
            # The same reference forward, its rows batched otherwise: fp32 ulps of
            # log-probabilities near -100 (rel 1e-5), through the loss.
            assert math.isclose(got[key], want[key], rel_tol=1e-5, abs_tol=1e-6), key

    # A later launch reads the values back instead of building a reference.
    caplog.clear()
    mtime = path.stat().st_mtime_ns
    build_session(_config(tmp_path / "again", prefs, "--dpo.reference=stored"), RuntimeContext())
    assert _stored_files(prefs) == [path] and path.stat().st_mtime_ns == mtime
    assert "reference log-probabilities read from" in caplog.text
    assert "reference weights from" not in caplog.text  # no reference was built


def test_other_reference_weights_store_values_of_their_own(tmp_path, prefs):
    for seed in (42, 43):
        config = _config(
            tmp_path / f"seed{seed}", prefs, "--dpo.reference=stored", f"--train.seed={seed}"
        )
        build_session(config, RuntimeContext())
    first, second = _stored_files(prefs)
    assert not np.array_equal(np.load(first), np.load(second))


def test_shares_cover_every_window_once():
    for windows in (1, 7, 20, 1001):
        for size in (1, 2, 3, 8):
            bounds = [share_bounds(windows, rank, size) for rank in range(size)]
            assert bounds[0][0] == 0 and bounds[-1][1] == windows
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))


def test_a_stored_reference_in_a_store_needs_a_local_directory():
    with pytest.raises(ConfigError, match="dpo.reference_dir"):
        load_config(None, ["--dpo.reference_dir=s3://bucket/refs"])
