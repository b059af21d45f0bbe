"""Config paths that are not readable TOML files: each is a one-line ConfigError naming it."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from kempnerforge.config.loader import load_config
from kempnerforge.core.errors import ConfigError

REPO = pathlib.Path(__file__).parents[2]
NOT_UTF8 = b'[train]\nname = "r\xff\xfe"\n'


def load_error(path: str | pathlib.Path) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    return info.value


def test_a_directory_as_the_config_file(tmp_path):
    error = load_error(tmp_path)
    assert (
        str(error) == f"<config file> = {str(tmp_path)!r}: expected a TOML file (it is a directory)"
    )


def test_a_config_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "job.toml"
    path.write_bytes(NOT_UTF8)
    assert str(load_error(path)) == (
        f"<config file> = {str(path)!r}: expected a UTF-8 TOML file "
        "(byte 0xff at offset 17 is not UTF-8)"
    )


def test_an_empty_config_path_is_not_the_defaults():
    assert str(load_error("")) == "<config file> = '': expected an existing TOML file"


def test_a_config_path_under_a_file(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("")
    error = load_error(path / "inner.toml")
    assert (
        str(error)
        == f"<config file> = {str(path / 'inner.toml')!r}: expected an existing TOML file"
    )


def test_an_integer_literal_too_long_for_python(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[train]\nseed = " + "9" * 5000 + "\n")
    error = load_error(path)
    assert str(error) == (
        f"<config file> = {str(path)!r}: expected valid TOML (Exceeds the limit (4300 digits) "
        "for integer string conversion: value has 5000 digits)"
    )


def test_an_unreadable_config_file(tmp_path):
    # Reading /proc/self/mem from its start fails with EIO for every user, root included.
    path = tmp_path / "job.toml"
    path.symlink_to("/proc/self/mem")
    assert str(load_error(path)) == (
        f"<config file> = {str(path)!r}: expected a readable TOML file (Input/output error)"
    )


def write_including(tmp_path: pathlib.Path, included: str) -> pathlib.Path:
    path = tmp_path / "job.toml"
    path.write_text(f'include = ["{included}"]\n[train]\nmax_steps = 3\n')
    return path


def test_an_include_naming_a_directory(tmp_path):
    (tmp_path / "presets").mkdir()
    path = write_including(tmp_path, "presets")
    error = load_error(path)
    assert error.field == "include"
    assert str(error) == (
        f"include = {str(tmp_path / 'presets')!r}: expected a TOML file "
        f"(it is a directory; included by {path})"
    )


def test_an_include_that_is_not_utf8(tmp_path):
    (tmp_path / "preset.toml").write_bytes(NOT_UTF8)
    path = write_including(tmp_path, "preset.toml")
    assert str(load_error(path)) == (
        f"include = {str(tmp_path / 'preset.toml')!r}: expected a UTF-8 TOML file "
        f"(byte 0xff at offset 17 is not UTF-8; included by {path})"
    )


def test_a_missing_include_names_the_including_file(tmp_path):
    path = write_including(tmp_path, "gone.toml")
    assert str(load_error(path)) == (
        f"include = {str(tmp_path / 'gone.toml')!r}: expected an existing TOML file "
        f"(included by {path})"
    )


def test_an_empty_include_names_the_including_directory(tmp_path):
    path = write_including(tmp_path, "")
    error = load_error(path)
    assert error.field == "include"
    assert "it is a directory; included by" in str(error)


def test_train_on_a_directory_exits_2_with_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "kempnerforge", "train", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        f"kempnerforge: error: <config file> = {str(tmp_path)!r}: expected a TOML file "
        "(it is a directory)"
    ]
