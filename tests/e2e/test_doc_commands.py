"""End to end: every `kempnerforge` command line of the docs without a "not run in tests"
marker runs and exits 0, in its file's order, with tiny model overrides.

README.md's "Using it" block is tests/e2e/test_readme.py's. The lines run in one working
directory holding what `make train` leaves (runs/debug, trained here for its 400 steps by
the tiny model), since the docs start from there; a `train` line of a config in configs/
gets the tiny model, short evals and 4 steps appended. Lines naming s3:// URLs run against
the tests' S3 server (moto's, on a loopback port), their buckets created empty first. Run
time: about 2 minutes on 2
loaded cores, most of it the built-in corpus's first preparation and the 400 steps.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests.support import warm_process
from tests.support.doc_commands import REPO, SHELL_VARIABLES, DocCommand, doc_commands
from tests.support.threads import PROCESS_THREADS
from tests.support.tiny import TINY_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

TINY = [
    *TINY_MODEL,
    "--model.n_kv_heads=2",
    "--model.n_layers=4",  # hooks.md captures layers.3
    "--train.batch_size=2",
    "--train.seq_len=32",
    "--train.sample_tokens=4",
    "--eval.steps=1",
    "--checkpoint.interval=0",
    "--metrics.progress=off",
]
"""Appended to every `train` line of a config in configs/: a step of milliseconds, one eval
batch, only the last step saved."""

SHORT = ["--train.max_steps=4"]
"""Also appended there, except for the run `make train` leaves, whose step_400 the docs
name: no line reads another new run's checkpoints."""


def readme_block() -> set[int]:
    """Lines of README's "Using it" block, which test_readme.py runs in order."""
    text = (REPO / "README.md").read_text().splitlines()
    start = text.index("## Using it")
    end = text.index("```", text.index("```sh", start) + 1)
    return set(range(start + 1, end + 2))


def to_run() -> dict[str, list[DocCommand]]:
    """The unmarked command lines a test here runs, by file."""
    skip = readme_block()
    runs: dict[str, list[DocCommand]] = {}
    for command in doc_commands():
        if command.not_run or command.is_synopsis:
            continue
        if command.file == "README.md" and command.line in skip:
            continue
        runs.setdefault(command.file, []).append(command)
    return runs


def argv_of(command: DocCommand) -> list[str]:
    """The line's command: `python -m kempnerforge` (the console script's own entry point,
    which the working directory's first run goes through), torchrun for several ranks."""
    program = [sys.executable, "-m", "kempnerforge"]
    if command.world_size > 1:
        program = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        program += [f"--nproc_per_node={command.world_size}", "-m", "kempnerforge"]
    # A run's own config.toml (a rerun) is tiny already and keeps its steps.
    fresh = command.argv[0] == "train" and command.argv[1].startswith("configs/")
    return [*program, *command.expanded, *(TINY + SHORT if fresh else [])]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, builtin_cache) -> tuple[pathlib.Path, dict[str, str]]:
    """A working directory as `make train` leaves one, with the repository's inputs linked."""
    root = tmp_path_factory.mktemp("docs")
    for name in ("configs", "kempnerforge", "docs", "examples"):
        (root / name).symlink_to(REPO / name)
    env = {
        **os.environ,
        **SHELL_VARIABLES,
        "OMP_NUM_THREADS": PROCESS_THREADS,
        "KEMPNERFORGE_CACHE": str(builtin_cache),
        "PYTHONPATH": str(root),  # hooks named as examples.module:Class
    }
    kempnerforge = str(pathlib.Path(sys.executable).parent / "kempnerforge")
    made = subprocess.run(
        [kempnerforge, "train", "configs/train/debug.toml", *TINY],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert made.returncode == 0, made.stderr[-3000:]
    return root, env


RUNS = to_run()


def test_some_lines_of_the_guides_are_run():
    assert {"docs/quickstart.md", "docs/hooks.md", "docs/data.md"} <= set(RUNS)
    assert any(STORE_URL.search(c.text) for c in RUNS["docs/data.md"])


STORE_URL = re.compile(r"\bs3://([a-z0-9][a-z0-9.-]+)")
"""A store URL of a command line, its bucket captured."""


def store_environment(request, commands: list[DocCommand], root: pathlib.Path) -> dict[str, str]:
    """For lines naming s3:// URLs: the test S3 server's environment (moto, on a loopback
    port) with every bucket they name created empty; nothing otherwise."""
    buckets = {b for c in commands for b in STORE_URL.findall(c.text)}
    if not buckets:
        return {}
    server = request.getfixturevalue("_s3_server")
    store_env = server.environment(str(root))
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=store_env["AWS_ENDPOINT_URL"],
        region_name=store_env["AWS_DEFAULT_REGION"],
        aws_access_key_id=store_env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=store_env["AWS_SECRET_ACCESS_KEY"],
    )
    for bucket in sorted(buckets):
        client.create_bucket(Bucket=bucket)
    return store_env


@pytest.mark.parametrize("file", sorted(RUNS))
def test_the_unmarked_command_lines_of_each_doc_run(file, workdir, request):
    root, env = workdir
    env = {**env, **store_environment(request, RUNS[file], root)}
    for command in RUNS[file]:
        done = warm_process.run(
            argv_of(command), cwd=root, env=env, capture_output=True, text=True, timeout=900
        )
        assert done.returncode == 0, f"{command.where}: {command.text}\n{done.stderr[-3000:]}"
