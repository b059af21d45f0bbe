"""The built-in corpus: prepared once from the standard library, cached, shared under a lock."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kempnerforge.config.data import DataConfig
from kempnerforge.core.errors import DataError
from kempnerforge.data import builtin
from kempnerforge.data.builtin import builtin_corpus, default_cache_dir, stdlib_files
from kempnerforge.data.pipeline_build import build_data_pipeline
from kempnerforge.data.tokenizer import ByteTokenizer, HFTokenizer
from kempnerforge.data.tokens.token_file import read_meta
from tests.support.data_files import make_hf_tokenizer


@pytest.fixture
def fake_stdlib(tmp_path, monkeypatch) -> Path:
    """A small library tree, patched in as the interpreter's standard library."""
    root = tmp_path / "lib" / "python3.x"
    files = {
        "os.py": "import sys\n",
        "json/__init__.py": "from .decoder import x\n",
        "json/decoder.py": "x = 1\n" * 20,
        "site-packages/thirdparty.py": "THIRD_PARTY = 1\n",
        "a/dist-packages/deb.py": "DEBIAN = 1\n",
        "notes.txt": "not python\n",
    }
    for i in range(30):
        files[f"pkg/m{i:02d}.py"] = f"def f{i}(x):\n    return x * {i}\n" * 4
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    (root / "latin1.py").write_bytes("# caf\u00e9\n".encode("latin-1"))
    monkeypatch.setattr(builtin, "stdlib_dir", lambda: str(root))
    return root


def _all_text(*dirs: str) -> str:
    tok = ByteTokenizer()
    return "".join(tok.decode(np.fromfile(f"{d}/tokens.bin", dtype="<u2").tolist()) for d in dirs)


def test_stdlib_files_are_sorted_python_without_site_packages(fake_stdlib):
    names = [p.relative_to(fake_stdlib).as_posix() for p in stdlib_files(str(fake_stdlib))]
    assert names == sorted(names)
    assert "os.py" in names and "json/decoder.py" in names
    assert not any("site-packages" in n or "dist-packages" in n for n in names)
    assert "notes.txt" not in names


def test_listing_the_stdlib_never_walks_into_site_packages(fake_stdlib, monkeypatch):
    # Every run lists the library to find its cache entry; site-packages may hold far more
    # files than the library itself, so the walk must not enter it.
    (fake_stdlib / "dir.py").mkdir()  # a directory, not a file
    opened: list[str] = []
    scandir = os.scandir

    def recording(path=".") -> Iterator[os.DirEntry]:
        opened.append(os.fspath(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", recording)
    names = [p.relative_to(fake_stdlib).as_posix() for p in stdlib_files(str(fake_stdlib))]
    assert names[:4] == ["json/__init__.py", "json/decoder.py", "latin1.py", "os.py"]
    assert names[4:] == [f"pkg/m{i:02d}.py" for i in range(30)]
    assert opened and not any("site-packages" in p or "dist-packages" in p for p in opened)


def test_the_listing_is_what_os_walk_lists(fake_stdlib, tmp_path):
    """Links as os.walk takes them: a linked directory is not entered (a loop back to the
    root would never end), a link to a file counts; the same list as os.walk's, in order."""
    (fake_stdlib / "loop").symlink_to(fake_stdlib, target_is_directory=True)
    (fake_stdlib / "linked.py").symlink_to(fake_stdlib / "os.py")
    (fake_stdlib / "dangling.py").symlink_to(tmp_path / "missing.py")
    walked = []
    for parent, dirs, names in os.walk(fake_stdlib):
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages")]
        paths = [Path(parent, n) for n in names if n.endswith(".py")]
        walked += [path for path in paths if path.is_file()]
    listed = stdlib_files(str(fake_stdlib))
    assert listed == sorted(walked, key=lambda p: p.relative_to(fake_stdlib).as_posix())
    names = [p.relative_to(fake_stdlib).as_posix() for p in listed]
    assert "linked.py" in names and "dangling.py" not in names
    assert not any(n.startswith("loop/") for n in names)


def test_builtin_corpus_is_prepared_once_then_reused(fake_stdlib, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    train, held = builtin_corpus(str(cache), ByteTokenizer(), 0.2)
    assert Path(train).parent == Path(held).parent
    key = Path(train).parent.name
    assert key.startswith("stdlib-py") and "-byte-" in key
    meta, held_meta = read_meta(train), read_meta(held)
    # 34 Python files, one of them not UTF-8 (skipped), the third-party ones left out.
    assert meta["num_documents"] + held_meta["num_documents"] == 33
    assert held_meta["num_documents"] >= 1
    text = _all_text(train, held)
    assert "THIRD_PARTY" not in text and "DEBIAN" not in text and "caf" not in text
    assert "import sys" in text

    calls = []
    monkeypatch.setattr(builtin, "_prepare", lambda *a: calls.append(a))
    assert builtin_corpus(str(cache), ByteTokenizer(), 0.2) == (train, held)
    assert calls == []  # reused from the cache


def test_cache_key_follows_tokenizer_fraction_and_files(fake_stdlib, tmp_path):
    cache = str(tmp_path / "cache")
    byte_dir = Path(builtin_corpus(cache, ByteTokenizer(), 0.2)[0]).parent
    other_fraction = Path(builtin_corpus(cache, ByteTokenizer(), 0.3)[0]).parent
    hf = HFTokenizer(make_hf_tokenizer(tmp_path / "tokenizer.json"))
    hf_dir = Path(builtin_corpus(cache, hf, 0.2)[0]).parent
    assert len({byte_dir, other_fraction, hf_dir}) == 3
    assert read_meta(str(hf_dir / "train"))["tokenizer"] == hf.identity
    (fake_stdlib / "new_module.py").write_text("NEW = 1\n")
    assert Path(builtin_corpus(cache, ByteTokenizer(), 0.2)[0]).parent != byte_dir


def test_incomplete_cache_is_prepared_again(fake_stdlib, tmp_path):
    train, held = builtin_corpus(str(tmp_path / "cache"), ByteTokenizer(), 0.2)
    (Path(held) / "meta.json").unlink()  # as if a run died before finishing
    assert builtin_corpus(str(tmp_path / "cache"), ByteTokenizer(), 0.2) == (train, held)
    assert read_meta(held)["num_documents"] >= 1


def test_zero_eval_fraction_has_no_eval_directory(fake_stdlib, tmp_path):
    train, held = builtin_corpus(str(tmp_path / "cache"), ByteTokenizer(), 0.0)
    assert held == "" and read_meta(train)["num_documents"] == 33


def test_concurrent_callers_prepare_once(fake_stdlib, tmp_path, monkeypatch):
    real_prepare, calls = builtin._prepare, []
    preparing, release = threading.Event(), threading.Event()

    def held_prepare(*args):
        calls.append(args)
        preparing.set()
        assert release.wait(30), "the test never released the preparation"
        real_prepare(*args)

    monkeypatch.setattr(builtin, "_prepare", held_prepare)
    results: dict[str, tuple[str, str]] = {}

    def call(name: str) -> None:
        results[name] = builtin_corpus(str(tmp_path / "cache"), ByteTokenizer(), 0.2)

    first = threading.Thread(target=call, args=("first",))
    first.start()
    assert preparing.wait(30)  # the first caller holds the lock and is preparing
    second = threading.Thread(target=call, args=("second",))
    second.start()
    second.join(0.5)
    # The overlap really happened: the second caller is waiting while the first prepares.
    assert second.is_alive() and "second" not in results
    release.set()
    first.join(30)
    second.join(30)
    assert len(calls) == 1 and results["first"] == results["second"]


def test_default_cache_dir_honours_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KEMPNERFORGE_CACHE", str(tmp_path))
    assert default_cache_dir() == str(tmp_path)
    monkeypatch.delenv("KEMPNERFORGE_CACHE")
    assert default_cache_dir() == str(Path.home() / ".cache" / "kempnerforge")


@pytest.mark.slow
def test_real_builtin_corpus_is_large_with_a_small_eval_split(tmp_path):
    fraction = 0.02
    start = time.monotonic()
    train, held = builtin_corpus(str(tmp_path), ByteTokenizer(), fraction)
    elapsed = time.monotonic() - start
    meta, held_meta = read_meta(train), read_meta(held)
    print(
        f"built-in corpus: {meta['num_tokens'] + held_meta['num_tokens']:,} tokens, "
        f"{meta['num_documents'] + held_meta['num_documents']} documents in {elapsed:.1f} s"
    )
    assert meta["num_tokens"] > 10_000_000
    share = held_meta["num_documents"] / (meta["num_documents"] + held_meta["num_documents"])
    assert fraction / 2 <= share <= fraction * 2


def test_unusable_cache_dir_is_a_data_error(fake_stdlib, tmp_path):
    (tmp_path / "file").write_text("a file, not a directory")
    with pytest.raises(
        DataError, match=r"cannot create the built-in corpus cache .*data\.cache_dir"
    ):
        builtin_corpus(str(tmp_path / "file"), ByteTokenizer(), 0.2)


def test_the_built_in_corpus_records_its_largest_id(fake_stdlib, tmp_path):
    train, held = builtin_corpus(str(tmp_path / "cache"), ByteTokenizer(), 0.2)
    for data in (train, held):
        ids = np.fromfile(f"{data}/tokens.bin", dtype="<u2")
        assert read_meta(data)["max_token_id"] == int(ids.max()) == 257  # EOS


def test_a_cache_prepared_by_an_older_version_is_read_and_its_largest_id_recorded(
    fake_stdlib, tmp_path, monkeypatch
):
    cache = str(tmp_path / "cache")
    train, held = builtin_corpus(cache, ByteTokenizer(), 0.2)
    for data in (train, held):  # as the version before max_token_id wrote them
        meta_path = Path(data) / "meta.json"
        raw = json.loads(meta_path.read_text())
        del raw["max_token_id"]
        meta_path.write_text(json.dumps(raw, indent=2) + "\n")
    monkeypatch.setattr(builtin, "_prepare", lambda *a: pytest.fail("prepared again"))
    pipe = build_data_pipeline(
        DataConfig(cache_dir=cache, builtin_eval_fraction=0.2),
        seq_len=16,
        batch_size=2,
        seed=0,
        model_vocab_size=259,
    )
    assert pipe.dataset is not None and pipe.dataset.path == train
    assert read_meta(train)["max_token_id"] == read_meta(held)["max_token_id"] == 257
