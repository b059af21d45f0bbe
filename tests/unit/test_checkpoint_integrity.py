"""Corrupt checkpoints are found by cheap checks: a bad marker, a zeroed or overwritten shard.

'auto' skips such a checkpoint with a warning naming the file; an explicit path fails
with a CheckpointError naming it. Never a traceback, never a hang.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from kempnerforge.checkpoint.dcp_metadata import read_dcp_metadata
from kempnerforge.checkpoint.integrity import checkpoint_problems
from kempnerforge.checkpoint.manager import CheckpointError
from tests.unit.test_checkpoint import _build, _load, _manager, _save

SHARD = "__0_0.distcp"

BAD_MARKERS = {
    "world_size_float": ({"world_size": 1e9}, "world_size is 1000000000.0"),
    "world_size_huge": ({"world_size": 10**9}, "world_size is 1000000000"),
    "world_size_text": ({"world_size": "two"}, 'world_size is "two"'),
    "world_size_zero": ({"world_size": 0}, "world_size is 0"),
    "world_size_bool": ({"world_size": True}, "world_size is true"),
    "step_text": ({"step": "x"}, 'step is "x"'),
    "step_negative": ({"step": -3}, "step is -3"),
    "step_missing": ({"step": None}, "step is missing"),
    "tokens_negative": ({"tokens_seen": -1}, "tokens_seen is -1"),
    "version_unknown": ({"format_version": 7}, "format_version is 7"),
    "version_float": ({"format_version": 1.0}, "format_version is 1.0"),
}
"""Changes to a good marker (None deletes the field) and how the problem starts."""

ALLOWED = {
    "world_size": "not an integer from 1 to 1048576",
    "step": "not an integer >= 0",
    "tokens_seen": "not an integer >= 0",
    "format_version": "this version reads 1 only",
}


def _edit_marker(path: Path, changes: dict) -> None:
    file = path / "complete.json"
    marker = json.loads(file.read_text())
    for key, value in changes.items():
        if value is None:
            del marker[key]
        else:
            marker[key] = value
    file.write_text(json.dumps(marker))


def _marker_problem(name: str) -> str:
    changes, start = BAD_MARKERS[name]
    field = next(iter(changes))
    joiner = "; " if field == "format_version" else ", "
    return f"complete.json: {start}{joiner}{ALLOWED[field]}"


@pytest.mark.parametrize("name", list(BAD_MARKERS))
def test_auto_skips_a_checkpoint_whose_marker_is_malformed(tmp_path, log, name):
    manager = _manager(tmp_path)
    _save(manager, 3)
    _save(manager, 6)
    newest = manager.directory / "step_6"
    _edit_marker(newest, BAD_MARKERS[name][0])
    assert checkpoint_problems(newest) == [_marker_problem(name)]
    assert manager.find_resume_path() == str(manager.directory / "step_3")
    assert (
        f"resuming from {manager.directory / 'step_3'}, the newest complete checkpoint "
        f"(skipped {newest} named by 'latest' ({_marker_problem(name)}))"
    ) in log.text


@pytest.mark.parametrize("name", list(BAD_MARKERS))
def test_an_explicit_path_with_a_malformed_marker_names_file_and_field(tmp_path, name):
    manager = _manager(tmp_path)
    path = manager.directory / "step_3"
    _save(manager, 3)
    _edit_marker(path, BAD_MARKERS[name][0])
    expected = f"{path}: not a complete checkpoint: {_marker_problem(name)}"
    explicit = _manager(tmp_path, resume_from=str(path))
    with pytest.raises(CheckpointError) as error:
        explicit.find_resume_path()
    assert str(error.value) == expected
    with pytest.raises(CheckpointError) as error:
        _load(manager, str(path))
    assert str(error.value) == expected


@pytest.mark.parametrize(
    "text, problem",
    [
        ("[1, 2]", "complete.json: holds a JSON array, not an object"),
        ('"step_3"', "complete.json: holds a JSON string, not an object"),
        ("{", "complete.json is unreadable (JSONDecodeError: Expecting property name"),
        (b"\xff\xfe", "complete.json is unreadable (UnicodeDecodeError: 'utf-8' codec"),
    ],
    ids=["list", "string", "truncated", "not_utf8"],
)
def test_a_marker_that_is_not_a_json_object_is_reported(tmp_path, text, problem):
    manager = _manager(tmp_path)
    path = Path(_save(manager, 3))
    marker = path / "complete.json"
    marker.write_bytes(text if isinstance(text, bytes) else text.encode())
    problems = checkpoint_problems(path)
    assert len(problems) == 1 and problems[0].startswith(problem)
    with pytest.raises(CheckpointError, match="not a complete checkpoint: complete.json"):
        _manager(tmp_path, resume_from=str(path)).find_resume_path()


def test_a_world_size_whose_train_states_are_missing_is_incomplete(tmp_path):
    manager = _manager(tmp_path)
    path = Path(_save(manager, 3))
    _edit_marker(path, {"world_size": 4})
    assert checkpoint_problems(path) == [
        "train_state_rank1.pt is missing or truncated (complete.json says 4 ranks saved)"
    ]


def _items(path: Path, name: str) -> list[tuple[int, int]]:
    """(offset, length) of each DCP item stored in file `name` of checkpoint `path`."""
    storage = read_dcp_metadata(path).storage_data
    return sorted((i.offset, i.length) for i in storage.values() if i.relative_path == name)


def _overwrite(path: Path, how: str) -> int:
    """Damage the shard of `path` keeping its length; return the offset of the broken item."""
    shard = path / SHARD
    data = bytearray(shard.read_bytes())
    items = _items(path, SHARD)
    if how == "zeroed":
        data[:] = bytes(len(data))
        broken = items[0][0]
    elif how == "end_record":
        broken, length = items[-1]
        end_record = broken + length - 22
        data[end_record : end_record + 4] = bytes(4)
    else:  # the central directory the first item's end record points at
        broken, length = items[0]
        (cd_offset,) = struct.unpack("<I", data[broken + length - 6 : broken + length - 2])
        data[broken + cd_offset : broken + cd_offset + 4] = bytes(4)
    shard.write_bytes(bytes(data))
    return broken


DAMAGE = {
    "zeroed": "does not start with a zip header (overwritten?)",
    "end_record": "has no zip end record (overwritten?)",
    "central_directory": ("has no zip central directory where its end record says (overwritten?)"),
}


@pytest.mark.parametrize("mode", ["disabled", "async"])
@pytest.mark.parametrize("how", list(DAMAGE))
def test_an_overwritten_shard_is_incomplete_and_auto_falls_back(tmp_path, log, mode, how):
    manager = _manager(tmp_path, async_mode=mode)
    _save(manager, 3)
    _save(manager, 6)
    manager.wait()
    newest = manager.directory / "step_6"
    offset = _overwrite(newest, how)
    problem = f"{SHARD} (DCP) is corrupt: the item at byte {offset} {DAMAGE[how]}"
    assert checkpoint_problems(newest) == [problem]
    assert not manager.is_complete(newest)
    assert manager.find_resume_path() == str(manager.directory / "step_3")
    assert f"skipped {newest} named by 'latest' ({problem})" in log.text
    explicit = _manager(tmp_path, resume_from=str(newest))
    with pytest.raises(CheckpointError) as error:
        explicit.find_resume_path()
    assert str(error.value) == f"{newest}: not a complete checkpoint: {problem}"
    with pytest.raises(CheckpointError) as error:
        manager.load_weights(str(newest), model=_build()[0])
    assert str(error.value) == f"{newest}: not a complete checkpoint: {problem}"


def test_an_intact_checkpoint_has_no_problems(tmp_path):
    manager = _manager(tmp_path)
    path = Path(_save(manager, 3))
    assert checkpoint_problems(path) == []
    assert manager.is_complete(path)
