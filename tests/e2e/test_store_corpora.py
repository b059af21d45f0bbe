"""Corpora in an object store, end to end against a real S3 server (moto's, started by the
tests, reached through s3fs and botocore): training, a sharded corpus, a mixture, resume
and prepare-data --output read and write the store exactly as they do a disk, and a store
that cannot be read stops the launch at start-up with one line naming the field."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from kempnerforge.data.dataset import MemoryMappedDataset
from kempnerforge.data.prepare.corpus import prepare_data
from kempnerforge.data.tokenizer import ByteTokenizer
from kempnerforge.data.tokens.shards import Shard
from kempnerforge.storage.stores import filesystem
from tests.conftest import synthetic_documents
from tests.support.cli import run_kempnerforge
from tests.support.s3_server import new_bucket_name
from tests.support.tiny import tiny_run
from tests.support.train_run import train_steps

pytestmark = pytest.mark.slow

STEPS = "--train.max_steps=4"
DEBUG = str(pathlib.Path(__file__).parents[2] / "configs" / "train" / "debug.toml")


def upload(local_dir: str, url: str) -> str:
    filesystem(url).put(local_dir, url.removeprefix("s3://"), recursive=True)
    return url


def assert_same_run(got: dict, expected: dict) -> None:
    """The same batches, bit for bit, hence the same losses and gradient norms exactly."""
    assert len(got["batches"]) == len(expected["batches"]) > 0
    for a, b in zip(got["batches"], expected["batches"], strict=True):
        assert torch.equal(a, b)
    assert got["losses"] == expected["losses"]
    assert got["grad_norms"] == expected["grad_norms"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_training_from_a_store_corpus_equals_training_from_disk(
    s3, token_dirs, tmp_path, num_workers
):
    server, bucket = s3
    train, held_out = token_dirs
    stored = (upload(train, f"{bucket}/train"), upload(held_out, f"{bucket}/eval"))
    workers = f"--data.num_workers={num_workers}"
    on_disk = train_steps(
        tiny_run(tmp_path / "disk", token_dirs, STEPS, workers), record_batches=True
    )
    server.clear()
    from_store = train_steps(
        tiny_run(tmp_path / "store", stored, STEPS, workers), record_batches=True
    )
    assert_same_run(from_store, on_disk)
    tokens = [r for r in server.taken() if r.path.endswith("/train/tokens.bin")]
    assert tokens and all(r.method == "GET" and r.range for r in tokens if r.method == "GET")


def _write_inputs(root: pathlib.Path, parts: int) -> list[str]:
    docs = synthetic_documents(240, seed=3)
    files = []
    for i in range(parts):
        path = root / f"part-{i}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for text in docs[i * 60 : (i + 1) * 60]:
                f.write(json.dumps({"text": text}) + "\n")
        files.append(str(path))
    return files


def _sharded(inputs: list[str], output: str, count: int) -> str:
    for index in range(count):
        prepare_data(inputs, output, ByteTokenizer(), shard=Shard(index, count))
    return output


def test_a_sharded_corpus_and_a_mixture_in_the_store_train_as_on_disk(s3, token_dirs, tmp_path):
    _, bucket = s3
    inputs = _write_inputs(tmp_path / "inputs", 4)
    local = {"sharded": _sharded(inputs, str(tmp_path / "sharded"), 3), "plain": token_dirs[0]}
    stored = {
        "sharded": _sharded(inputs, f"{bucket}/sharded", 3),  # prepare-data writes the store
        "plain": upload(token_dirs[0], f"{bucket}/plain"),
    }

    def mixture(paths: dict[str, str], run: str) -> list[str]:
        tables = ", ".join(
            f'{{name="{name}", path="{path}", weight={w}}}'
            for (name, path), w in zip(paths.items(), (2, 1), strict=True)
        )
        return tiny_run(tmp_path / run, None, STEPS, f"--data.datasets=[{tables}]")

    assert_same_run(
        train_steps(mixture(stored, "store"), record_batches=True),
        train_steps(mixture(local, "disk"), record_batches=True),
    )
    sharded_only = ("--data.shuffle=false",)
    assert_same_run(
        train_steps(
            tiny_run(tmp_path / "s1", (stored["sharded"], ""), STEPS, *sharded_only),
            record_batches=True,
        ),
        train_steps(
            tiny_run(tmp_path / "d1", (local["sharded"], ""), STEPS, *sharded_only),
            record_batches=True,
        ),
    )


def test_opening_a_sharded_corpus_in_the_store_reads_only_its_meta_json_objects(s3, tmp_path):
    server, bucket = s3
    inputs = _write_inputs(tmp_path / "inputs", 4)
    url = _sharded(inputs, f"{bucket}/sharded", 4)
    server.clear()
    dataset = MemoryMappedDataset(url, 32)
    taken = server.taken()
    reads = [r.path.split("/", 2)[2] for r in taken if r.method == "GET" and not r.query]
    assert sorted(reads) == [f"sharded/shard-{i:05d}-of-00004/meta.json" for i in range(4)]
    assert not [r for r in taken if r.path.endswith("tokens.bin") and r.method != "HEAD"]
    assert len(taken) <= 6 * 4 + 4  # O(shards): a few small requests per shard
    server.clear()
    dataset[0]
    assert [r.method for r in server.taken()] == ["GET"]  # one ranged read for one window


def test_a_run_stopped_and_resumed_on_a_store_corpus_equals_an_uninterrupted_run(
    s3, token_dirs, tmp_path
):
    _, bucket = s3
    stored = (upload(token_dirs[0], f"{bucket}/train"), upload(token_dirs[1], f"{bucket}/eval"))
    steps = "--train.max_steps=6"
    whole = train_steps(tiny_run(tmp_path / "whole", stored, steps), record_batches=True)
    parts = tiny_run(tmp_path / "parts", stored, steps)
    first = train_steps(parts, record_batches=True, stop_after=3)
    assert first["step"] == 3
    second = train_steps(parts, record_batches=True)
    assert second["start_step"] == 3 and second["step"] == 6
    joined = {key: first[key] + second[key] for key in ("batches", "losses", "grad_norms")}
    assert_same_run(joined, whole)


def _store_env(server, tmp_path) -> dict[str, str]:
    return server.environment(str(tmp_path))


def test_prepare_data_into_the_store_then_train_from_it_through_the_cli(s3, tmp_path):
    server, bucket = s3
    inputs = _write_inputs(tmp_path / "inputs", 2)
    env = _store_env(server, tmp_path)
    prepared = run_kempnerforge(
        "prepare-data",
        "--input",
        *inputs,
        "--output",
        f"{bucket}/corpus",
        "--eval-fraction=0.1",
        "--eval-output",
        f"{bucket}/heldout",
        env_extra=env,
    )
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    writes = [(r.method, r.path.split("/", 2)[2]) for r in server.taken() if r.method != "GET"]
    corpus = [w for w in writes if w[1].startswith("corpus/")]
    # tokens.bin is complete before meta.json appears: the corpus is complete exactly then.
    assert corpus[-1] == ("PUT", "corpus/meta.json")
    assert ("PUT", "corpus/tokens.bin") in corpus[:-1]
    trained = run_kempnerforge(
        *cli_train(
            tmp_path / "run", (f"{bucket}/corpus", f"{bucket}/heldout"), "--train.max_steps=3"
        ),
        env_extra=env,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "finished at step 3" in trained.stdout


def cli_train(run_dir: pathlib.Path, data: tuple[str, str], *extra: str) -> list[str]:
    """`kempnerforge train` of configs/train/debug.toml cut to the tiny run on ``data``."""
    return ["train", DEBUG, *tiny_run(run_dir, data, "--model.n_kv_heads=2", *extra)]


def _one_error_line(result) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("kempnerforge:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_an_unreadable_store_stops_the_launch_at_start_up_naming_the_field(
    s3, token_dirs, tmp_path
):
    server, bucket = s3
    url = upload(token_dirs[0], f"{bucket}/train")
    env = _store_env(server, tmp_path)
    missing = f"s3://{new_bucket_name()}/train"
    result = run_kempnerforge(
        *cli_train(tmp_path / "a", (missing, ""), "--train.max_steps=2"),
        env_extra=env,
    )
    line = _one_error_line(result)
    assert line.startswith(f"kempnerforge: error: data.path = '{missing}'"), line
    assert "The specified bucket does not exist" in line, line
    assert not (tmp_path / "a").exists()  # stopped before the run directory was made
    with server.refusing_credentials():
        result = run_kempnerforge(
            *cli_train(tmp_path / "b", (url, ""), "--train.max_steps=2"),
            env_extra=env,
        )
    line = _one_error_line(result)
    assert line.startswith(f"kempnerforge: error: data.path = '{url}'"), line
    assert "PermissionError: The AWS Access Key Id you provided does not exist" in line, line
    unreachable = {**env, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}  # the discard port
    result = run_kempnerforge(
        *cli_train(tmp_path / "c", (url, ""), "--train.max_steps=2"),
        env_extra=unreachable,
    )
    line = _one_error_line(result)
    assert line.startswith(f"kempnerforge: error: data.path = '{url}'"), line
    assert "127.0.0.1:9" in line, line


def test_a_run_dir_in_a_store_is_refused_at_start_up(token_dirs, tmp_path):
    result = run_kempnerforge(
        *cli_train(tmp_path / "run", token_dirs, "--train.run_dir=s3://bucket/run"),
        cwd=tmp_path,
    )
    line = _one_error_line(result)
    assert line.startswith("kempnerforge: error: train.run_dir = 's3://bucket/run'"), line
    assert "local or mounted" in line, line
    assert not (tmp_path / "s3:").exists() and not (tmp_path / "run").exists()
