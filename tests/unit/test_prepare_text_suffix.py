"""prepare-data --text-suffix (other suffixes as whole-file text) and --skip-non-utf8."""

from __future__ import annotations

import argparse
import gzip
import logging

import pytest

from kempnerforge.commands.prepare_data import add_prepare_data_arguments, run_prepare_data
from kempnerforge.core.errors import DataError
from kempnerforge.data.prepare.corpus import prepare_data
from kempnerforge.data.prepare.sources import discover_input_files
from kempnerforge.data.tokenizer import ByteTokenizer
from tests.support.data_files import prepared_documents


@pytest.fixture
def code_tree(tmp_path):
    root = tmp_path / "src"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "b.py").write_text("def b():\n    return 2\n")
    (root / "a.PY").write_text("A = 1\n")
    (root / "notes.md").write_text("# notes\n")
    (root / "readme.txt").write_text("read me\n")
    (root / "data.bin").write_bytes(b"\x00\x01")
    (root / "c.py.gz").write_bytes(gzip.compress(b"C = 3\n"))
    return root


def _run(tmp_path, inputs, **kwargs):
    out = tmp_path / "out"
    meta = prepare_data([str(i) for i in inputs], str(out), ByteTokenizer(), **kwargs)
    return out, meta


def test_listed_suffixes_are_read_as_whole_file_documents_in_sorted_order(tmp_path, code_tree):
    out, meta = _run(tmp_path, [code_tree], text_suffixes=(".py",))
    # a.PY (suffixes match case-insensitively), c.py.gz, pkg/b.py, readme.txt; not .md/.bin.
    expected = ["A = 1\n", "C = 3\n", "def b():\n    return 2\n", "read me\n"]
    assert prepared_documents(out) == expected
    assert meta["sources"] == 4


def test_without_the_option_only_the_built_in_formats_are_read(tmp_path, code_tree):
    out, _ = _run(tmp_path, [code_tree])
    assert prepared_documents(out) == ["read me\n"]


def test_several_suffixes(tmp_path, code_tree):
    out, _ = _run(tmp_path, [code_tree], text_suffixes=(".py", ".MD"))
    assert "# notes\n" in prepared_documents(out) and len(prepared_documents(out)) == 5


def test_an_explicit_file_of_another_suffix_says_how_to_read_it(tmp_path, code_tree):
    with pytest.raises(DataError, match=r"a\.PY: unsupported file type.*--text-suffix"):
        _run(tmp_path, [code_tree / "a.PY"])
    out, _ = _run(tmp_path, [code_tree / "a.PY"], text_suffixes=(".py",))
    assert prepared_documents(out) == ["A = 1\n"]


@pytest.mark.parametrize("suffix", ["py", ".", ".jsonl", ".txt", ".parquet", "a/.py"])
def test_bad_suffixes_are_refused(tmp_path, code_tree, suffix):
    with pytest.raises(DataError, match=f"--text-suffix '{suffix}'"):
        _run(tmp_path, [code_tree], text_suffixes=(suffix,))


def test_a_non_utf8_file_stops_the_run_unless_skipped(tmp_path, code_tree, caplog):
    bad = code_tree / "latin1.py"
    bad.write_bytes("# caf\u00e9\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.py: not valid UTF-8"):
        _run(tmp_path, [code_tree], text_suffixes=(".py",))
    assert not (tmp_path / "out" / "meta.json").exists()
    with caplog.at_level(logging.WARNING, logger="kempnerforge"):
        out, _ = _run(tmp_path, [code_tree], text_suffixes=(".py",), skip_non_utf8=True)
    assert len(prepared_documents(out)) == 4 and "caf" not in "".join(prepared_documents(out))
    assert f"{bad} is not valid UTF-8: left out" in caplog.text


def test_cli_options(tmp_path, code_tree, capsys):
    (code_tree / "bad.py").write_bytes(b"\xff\xfe")
    parser = argparse.ArgumentParser()
    add_prepare_data_arguments(parser)
    args = parser.parse_args(
        ["--input", str(code_tree), "--output", str(tmp_path / "out")]
        + ["--text-suffix", ".py", "--text-suffix", ".md", "--skip-non-utf8"]
    )
    assert run_prepare_data(args, []) == 0
    assert "in 5 documents" in capsys.readouterr().out


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_files_left_out_of_a_directory_are_counted_by_suffix_in_one_warning(
    tmp_path, code_tree, caplog
):
    (code_tree / "pkg" / "Makefile").write_text("all:\n")
    (code_tree / ".gitignore").write_text("*.pyc\n")
    with caplog.at_level(logging.WARNING, logger="kempnerforge"):
        out, _ = _run(tmp_path, [code_tree])
    assert prepared_documents(out) == ["read me\n"]
    assert _warnings(caplog) == [
        # .gitignore is a tool's file, not text someone forgot: not counted.
        f"skipped 3 .py, 1 .bin, 1 .md and 1 no-suffix files under {code_tree}/ (not a format "
        "prepare-data reads; read them as whole-file text with --text-suffix .py "
        "--text-suffix .bin --text-suffix .md)"
    ]


def test_the_warning_names_only_what_the_text_suffixes_did_not_read(tmp_path, code_tree, caplog):
    with caplog.at_level(logging.WARNING, logger="kempnerforge"):
        _run(tmp_path, [code_tree], text_suffixes=(".py", ".md"))
    assert _warnings(caplog) == [
        f"skipped 1 .bin file under {code_tree}/ (not a format prepare-data reads; read it "
        "as whole-file text with --text-suffix .bin)"
    ]
    caplog.clear()
    (code_tree / "data.bin").unlink()
    with caplog.at_level(logging.WARNING, logger="kempnerforge"):
        _run(tmp_path, [code_tree], text_suffixes=(".py", ".md"))
    assert _warnings(caplog) == []


def test_files_without_a_suffix_get_no_text_suffix_hint(tmp_path, caplog):
    root = tmp_path / "tree"
    root.mkdir()
    (root / "doc.txt").write_text("text\n")
    (root / "LICENSE").write_text("license\n")
    with caplog.at_level(logging.WARNING, logger="kempnerforge"):
        _run(tmp_path, [root])
    assert _warnings(caplog) == [
        f"skipped 1 no-suffix file under {root}/ (not a format prepare-data reads)"
    ]
    caplog.clear()
    (root / "setup.cfg").write_text("[metadata]\n")
    with caplog.at_level(logging.WARNING, logger="kempnerforge"):
        _run(tmp_path, [root])
    assert _warnings(caplog) == [
        f"skipped 1 .cfg and 1 no-suffix files under {root}/ (not a format prepare-data reads; "
        "read them as whole-file text with --text-suffix .cfg)"
    ]


def test_tool_files_are_not_counted_as_skipped(tmp_path, caplog):
    root = tmp_path / "tree"
    (root / "__pycache__").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\0")
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / ".hidden.cfg").write_text("x")
    (root / "notes.txt").write_text("some text")
    (root / "mod.py").write_text("x = 1\n")
    with caplog.at_level(logging.WARNING, logger="kempnerforge"):
        discover_input_files([str(root)])
    assert _warnings(caplog) == [
        f"skipped 1 .py file under {root}/ (not a format prepare-data reads; read it as "
        "whole-file text with --text-suffix .py)"
    ]
