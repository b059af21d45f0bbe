"""Shared fixtures: a tiny job config over a token file generated in tmp_path."""

from __future__ import annotations

import logging
import os
import random

import pytest
import torch

from kempnerforge.config.loader import load_config
from kempnerforge.data.prepare.corpus import prepare_data
from kempnerforge.data.tokenizer import ByteTokenizer
from tests.support.threads import PROCESS_THREADS
from tests.support.tiny import tiny_run

# Tests that share a class, module or package fixture run on one pytest-xdist worker.
pytest_plugins = ["tests.support.worker_groups"]

if PROCESS_THREADS == "1":
    # As many workers as cores: every process a test starts inherits one intra-op thread
    # (unless the test sets its own), so no two workers' processes fight over a core.
    os.environ.setdefault("OMP_NUM_THREADS", PROCESS_THREADS)


def synthetic_documents(num_docs: int, seed: int = 0) -> list[str]:
    """Small, learnable documents: repeated words with a little variety."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "class", "import"]
    return [
        " ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) + "\n"
        for _ in range(num_docs)
    ]


@pytest.fixture(scope="session")
def token_dirs(tmp_path_factory) -> tuple[str, str]:
    """(train_dir, eval_dir) prepared with the byte tokenizer from synthetic documents."""
    root = tmp_path_factory.mktemp("tokens")
    source = root / "docs.jsonl"
    import json

    with open(source, "w") as f:
        for text in synthetic_documents(400):
            f.write(json.dumps({"text": text}) + "\n")
    train, evald = str(root / "train"), str(root / "eval")
    prepare_data([str(source)], train, ByteTokenizer(), eval_fraction=0.1, eval_output_dir=evald)
    return train, evald


@pytest.fixture
def tiny_overrides(tmp_path, token_dirs) -> list[str]:
    return tiny_run(tmp_path / "run", token_dirs, "--train.max_steps=6")


@pytest.fixture
def tiny_job_config(tiny_overrides):
    return load_config(None, tiny_overrides)


@pytest.fixture(autouse=True)
def _one_thread():
    """Two cores are shared by everything: keep each test to one intra-op thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def log(caplog):
    """caplog that sees the package's records at INFO and above, also after the CLI's
    configure_logging stopped them from propagating to the root logger."""
    logger = logging.getLogger("kempnerforge")
    caplog.set_level(logging.INFO, logger="kempnerforge")
    stopped = not logger.propagate  # when propagating, caplog's root handler sees them
    if stopped:
        logger.addHandler(caplog.handler)
    yield caplog
    if stopped:
        logger.removeHandler(caplog.handler)


@pytest.fixture
def package_logging():
    """Put the kempnerforge logger back as it was after the CLI configured it."""
    logger = logging.getLogger("kempnerforge")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    for handler in saved[0]:
        logger.addHandler(handler)
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


@pytest.fixture(scope="session")
def _s3_server():
    pytest.importorskip("s3fs", reason="the s3 extra (pip install 'kempnerforge[s3]')")
    pytest.importorskip("moto", reason="moto[server], in the dev extra")
    from tests.support.s3_server import s3_server

    with s3_server() as server:
        yield server


@pytest.fixture
def s3(_s3_server, monkeypatch, tmp_path):
    """The test S3 server with this process's environment pointing at it and a new empty
    bucket; yields (server, 's3://bucket'). Filesystems opened before are dropped, so the
    store's environment is read afresh."""
    from kempnerforge.storage.stores import filesystem, forget_filesystems
    from tests.support.s3_server import new_bucket_name

    for name, value in _s3_server.environment(str(tmp_path)).items():
        monkeypatch.setenv(name, value)
    forget_filesystems()
    bucket = f"s3://{new_bucket_name()}"
    filesystem(bucket).mkdir(bucket.removeprefix("s3://"))
    _s3_server.clear()
    yield _s3_server, bucket
    forget_filesystems()


@pytest.fixture
def s3_proxy(s3, monkeypatch):
    """The test S3 server behind a fault-injecting proxy (tests/support/store_proxy.py),
    this process's AWS_ENDPOINT_URL pointing at the proxy; yields (proxy, server,
    's3://bucket')."""
    from kempnerforge.storage.stores import forget_filesystems
    from tests.support.store_proxy import fault_proxy

    server, bucket = s3
    with fault_proxy(server.endpoint) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        forget_filesystems()
        yield proxy, server, bucket
    forget_filesystems()


@pytest.fixture
def memory_root():
    """A fresh memory:// directory, removed afterwards (the memory store is per process)."""
    import uuid

    import fsspec

    root = f"memory://kf-{uuid.uuid4().hex[:8]}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)
