"""Every `kempnerforge` command line of README.md and docs/*.md is one its command accepts.

Validated here, not run (tests/e2e/test_doc_commands.py runs each line without a "not run
in tests" marker): the arguments go through the command's real parser, a config of this
repository is loaded with the line's overrides and validated for the line's world size
(torchrun's --nproc_per_node), and check-parallel's layouts through its --dry-run. A
synopsis (`kempnerforge eval CONFIG --checkpoint PATH ...`) has its flags checked.
tests/support/doc_commands.py says what counts as a command line and how a marker reads.
"""

from __future__ import annotations

import re

import pytest

from tests.support.doc_commands import MARKER, REPO, doc_commands, doc_files, validate

COMMANDS = doc_commands()


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.where)
def test_every_documented_command_line_is_accepted(command, monkeypatch):
    monkeypatch.chdir(REPO)  # the docs' paths are relative to the repository root
    assert validate(command)


def test_the_known_command_lines_are_found():
    found = {(c.file, c.argv[0]) for c in COMMANDS}
    assert ("README.md", "prepare-data") in found
    assert ("docs/distributed.md", "check-parallel") in found
    assert ("docs/fault-tolerance.md", "lighthouse") in found
    torchrun = [c for c in COMMANDS if c.text.startswith(".venv/bin/torchrun")]
    assert torchrun and all(c.world_size > 1 for c in torchrun)


def test_every_marker_covers_a_command_line():
    for path in doc_files():
        name = str(path.relative_to(REPO))
        reasons = {c.not_run for c in COMMANDS if c.file == name}
        for line in path.read_text().splitlines():
            marker = MARKER.match(line.strip())
            assert marker is None or marker.group(2) in reasons, f"{name}: {line}"


def test_command_lines_with_a_store_url_are_run_against_the_test_s3_server():
    """tests/e2e/test_doc_commands.py runs every line naming an s3:// URL against the S3
    server the tests start (moto's); no other store has one, so a documented command
    reads and writes stores through s3:// only, and none is left unrun."""
    stored = [c for c in COMMANDS if re.search(r"\b[a-z][a-z0-9]*://", " ".join(c.argv))]
    assert stored, "the store example of docs/data.md is found"
    for command in stored:
        schemes = set(re.findall(r"\b([a-z][a-z0-9]*)://", " ".join(command.argv)))
        assert schemes == {"s3"}, f"{command.where}: {schemes}"
        assert command.not_run is None, f"{command.where}: run it against the test S3 server"


def test_a_marker_covers_its_block_or_the_lines_it_names():
    moe = [c for c in COMMANDS if c.file == "docs/moe.md"]
    assert moe[0].argv == ["train", "configs/train/debug_moe.toml"] and moe[0].not_run is None
    assert moe[2].text.startswith("torchrun")  # in the same block, named by its marker
    assert re.search("2 processes", moe[2].not_run or "")
