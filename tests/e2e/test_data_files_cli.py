"""End to end: `kempnerforge train` on data whose tokens changed after they were prepared, and
on a corpus written as shards by separate `kempnerforge prepare-data` processes."""

from __future__ import annotations

import pathlib
import subprocess

import numpy as np
import pytest

from tests.conftest import synthetic_documents
from tests.support.cli import run_kempnerforge
from tests.support.data_files import write_jsonl
from tests.support.tiny import tiny_run

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).parents[2]
DEBUG = str(REPO / "configs" / "train" / "debug.toml")


def kempnerforge(*args: str) -> subprocess.CompletedProcess:
    return run_kempnerforge(*args, env_extra={"OMP_NUM_THREADS": "1"})


def train_args(data: pathlib.Path, run_dir: pathlib.Path, *extra: str) -> list[str]:
    return [
        "train",
        DEBUG,
        *tiny_run(
            run_dir,
            None,
            "--model.n_kv_heads=2",
            "--train.batch_size=2",
            "--train.seq_len=16",
            "--train.max_steps=3",
            "--eval.interval=0",
            f"--data.path={data}",
            *extra,
        ),
    ]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_training_on_a_window_with_an_id_beyond_the_vocabulary_exits_2_with_one_line(
    tmp_path, num_workers
):
    src = write_jsonl(tmp_path / "d.jsonl", synthetic_documents(60))
    data = tmp_path / "data"
    prepared = kempnerforge("prepare-data", "--input", str(src), "--output", str(data))
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    tokens = data / "tokens.bin"
    ids = np.fromfile(tokens, dtype="<u2")
    ids[5] = 600  # meta.json still records the largest id the writer saw
    ids.tofile(tokens)
    result = kempnerforge(
        *train_args(
            data,
            tmp_path / "run",
            "--data.shuffle=false",  # the first batch reads offset 5
            f"--data.num_workers={num_workers}",
        )
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("kempnerforge:")]
    assert lines == [
        f"kempnerforge: error: {tokens}: the token at offset 5 is id 600, not below "
        "meta.json's vocab_size 259 and model.vocab_size 259: the file is corrupt or was not "
        "written as the uint16 ids of tokenizer byte that meta.json names; run prepare-data "
        "again with this job's tokenizer"
    ]


def test_a_corpus_written_as_shards_by_separate_commands_trains(tmp_path):
    inputs = tmp_path / "inputs"
    docs = synthetic_documents(90)
    for i in range(6):
        write_jsonl(inputs / f"part-{i}.jsonl", docs[i * 15 : (i + 1) * 15])
    data, held = tmp_path / "data", tmp_path / "held"
    for index in range(3):
        prepared = kempnerforge(
            "prepare-data",
            "--input",
            str(inputs),
            "--output",
            str(data),
            "--eval-fraction",
            "0.1",
            "--eval-output",
            str(held),
            "--shard-index",
            str(index),
            "--num-shards",
            "3",
        )
        assert prepared.returncode == 0, prepared.stderr[-3000:]
        shard = f"shard-{index:05d}-of-00003"
        assert prepared.stdout.startswith("prepared ")
        assert f"into {data / shard}; held out " in prepared.stdout
    result = kempnerforge(*train_args(data, tmp_path / "run", f"--data.eval_path={held}"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "finished at step 3" in result.stdout
