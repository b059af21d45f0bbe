"""The largest token id: recorded when data is written, compared (not scanned) when it is
opened, scanned once for directories prepared before it was recorded, and the per-window check
that stops a run on an id beyond the vocabulary."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from kempnerforge.cli import main
from kempnerforge.core.errors import DataError, unwrap_worker_error
from kempnerforge.data.dataset import MemoryMappedDataset
from kempnerforge.data.prepare.corpus import prepare_data
from kempnerforge.data.tokenizer import ByteTokenizer, HFTokenizer
from kempnerforge.data.tokens import token_ids
from kempnerforge.data.tokens.token_file import read_meta
from tests.support.data_files import make_hf_tokenizer, prepared_ids, write_jsonl, write_token_dir

CORRUPT = (
    "not below meta.json's vocab_size 259{model}: the file is corrupt or was not written as "
    "the uint16 ids of tokenizer byte that meta.json names; run prepare-data again with this "
    "job's tokenizer"
)


def _plant(data_dir: str | Path, offset: int, token_id: int) -> Path:
    """Overwrite one uint16 id of tokens.bin in place, leaving meta.json as it was."""
    tokens = Path(data_dir) / "tokens.bin"
    ids = np.fromfile(tokens, dtype="<u2")
    ids[offset] = token_id
    ids.tofile(tokens)
    return tokens


def _drop_max_id(data_dir: str | Path) -> dict:
    """meta.json as an older version wrote it: without max_token_id. Returns what is left."""
    meta_path = Path(data_dir) / "meta.json"
    raw = json.loads(meta_path.read_text())
    del raw["max_token_id"]
    meta_path.write_text(json.dumps(raw, indent=2) + "\n")
    return raw


@pytest.fixture
def no_scan(monkeypatch):
    """Fail on any read of a tokens.bin through a memory map (how ids are scanned and read)."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"tokens read: {args[0] if args else kwargs}")

    monkeypatch.setattr(np, "memmap", refuse)


@pytest.fixture
def small_dir(tmp_path) -> str:
    """Documents of ids 0..20 and 30..40 (each then EOS 257): 34 tokens."""
    return write_token_dir(tmp_path / "small", [list(range(21)), list(range(30, 41))])


def test_prepare_data_records_the_largest_id_written(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", ["plain ascii", "caf\u00e9 \U0001f600"])
    meta = prepare_data([str(src)], str(tmp_path / "byte"), ByteTokenizer())
    assert meta["max_token_id"] == 257 == int(prepared_ids(tmp_path / "byte").max())  # EOS
    tok = HFTokenizer(make_hf_tokenizer(tmp_path / "tokenizer.json"))
    meta = prepare_data([str(src)], str(tmp_path / "hf"), tok)
    assert meta["max_token_id"] == int(prepared_ids(tmp_path / "hf").max())
    assert read_meta(str(tmp_path / "hf"))["max_token_id"] == meta["max_token_id"]


def test_an_empty_token_file_records_minus_one(tmp_path):
    meta = read_meta(write_token_dir(tmp_path / "empty", []))
    assert (meta["num_tokens"], meta["max_token_id"]) == (0, -1)


def test_opening_compares_the_recorded_id_without_reading_tokens(tmp_path, no_scan):
    # 2**30 uint16 tokens (2 GiB, sparse): any scan would trip the guard, and take minutes.
    data = Path(write_token_dir(tmp_path / "big", [[1, 2, 3]]))
    meta_path = data / "meta.json"
    meta = {**json.loads(meta_path.read_text()), "num_tokens": 2**30}
    meta_path.write_text(json.dumps(meta))
    os.truncate(data / "tokens.bin", 2**31)
    ds = MemoryMappedDataset(str(data), seq_len=1024, model_vocab_size=259)
    assert len(ds) == (2**30 - 1) // 1024
    # A recorded id beyond the vocabulary is refused as it stands: the file is too large to
    # search for its offset.
    meta_path.write_text(json.dumps({**meta, "max_token_id": 300}))
    with pytest.raises(DataError) as info:
        MemoryMappedDataset(str(data), seq_len=1024, model_vocab_size=280)
    assert str(info.value) == (
        f"{data / 'tokens.bin'}: its largest id, meta.json's max_token_id, is 300, "
        + CORRUPT.format(model=" and model.vocab_size 280")
    )


def test_a_directory_prepared_before_is_scanned_once_and_the_id_recorded(small_dir, monkeypatch):
    raw = _drop_max_id(small_dir)
    meta_path = Path(small_dir) / "meta.json"
    os.chmod(meta_path, 0o640)
    before = len(MemoryMappedDataset(small_dir, seq_len=4))
    recorded = json.loads(meta_path.read_text())
    assert recorded == {**raw, "max_token_id": 257}
    assert meta_path.stat().st_mode & 0o777 == 0o640  # a shared directory stays readable
    assert sorted(p.name for p in Path(small_dir).iterdir()) == ["meta.json", "tokens.bin"]
    with monkeypatch.context() as patch:
        patch.setattr(np, "memmap", lambda *a, **k: pytest.fail("scanned a second time"))
        assert len(MemoryMappedDataset(small_dir, seq_len=4)) == before


def test_an_unwritable_directory_prepared_before_is_scanned_with_a_warning(
    small_dir, monkeypatch, log
):
    raw = _drop_max_id(small_dir)

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(token_ids.tempfile, "mkstemp", read_only)
    assert len(MemoryMappedDataset(small_dir, seq_len=4)) == 8
    assert json.loads((Path(small_dir) / "meta.json").read_text()) == raw
    assert f"{small_dir}: cannot record max_token_id in meta.json (Permission denied)" in log.text


def test_a_large_directory_prepared_before_is_refused_with_the_command_that_records_it(
    small_dir, monkeypatch, capsys
):
    _drop_max_id(small_dir)
    monkeypatch.setattr(token_ids, "SCAN_ON_OPEN_MAX_BYTES", 10)
    with pytest.raises(DataError) as info:
        MemoryMappedDataset(small_dir, seq_len=4)
    assert str(info.value) == (
        f"{small_dir}: meta.json records no max_token_id (prepared by an older version) and "
        "tokens.bin is 0.0 GiB, too large for every rank to scan at startup; record it once "
        f"with `kempnerforge prepare-data --record-max-id {small_dir}`"
    )
    assert main(["prepare-data", "--record-max-id", small_dir]) == 0
    assert capsys.readouterr().out == (
        f"{small_dir}: recorded max_token_id 257 (34 tokens scanned)\n"
    )
    assert read_meta(small_dir)["max_token_id"] == 257
    assert len(MemoryMappedDataset(small_dir, seq_len=4)) == 8


def test_recording_an_id_beyond_the_vocabulary_records_it_and_names_its_offset(small_dir, capsys):
    _drop_max_id(small_dir)
    tokens = _plant(small_dir, 25, 700)
    assert main(["prepare-data", "--record-max-id", small_dir]) == 2
    captured = capsys.readouterr()
    assert captured.out == f"{small_dir}: recorded max_token_id 700 (34 tokens scanned)\n"
    assert captured.err == (
        f"kempnerforge: error: {tokens}: the token at offset 25 is id 700, "
        + CORRUPT.format(model="")
        + "\n"
    )
    assert read_meta(small_dir)["max_token_id"] == 700


def test_record_max_id_takes_no_inputs_and_prepare_data_needs_them(small_dir, capsys):
    code = main(["prepare-data", "--record-max-id", small_dir, "--output", "x"])
    assert code == 2
    assert capsys.readouterr().err == (
        "kempnerforge: error: --record-max-id scans directories already prepared; it takes "
        "no --input or --output (run it on its own)\n"
    )
    assert main(["prepare-data", "--output", "x"]) == 2
    assert "prepare-data needs --input FILE_OR_DIR ... and --output DIR" in capsys.readouterr().err


def _open_at_once(data_dir: str, barrier, results) -> None:
    barrier.wait(30)
    try:
        results.put(len(MemoryMappedDataset(data_dir, seq_len=4)))
    except BaseException as exc:  # reported to the test, which fails on it
        results.put(repr(exc))


def test_ranks_opening_a_directory_prepared_before_at_once_record_the_same_file(small_dir):
    raw = _drop_max_id(small_dir)
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(4), context.Queue()
    ranks = [
        context.Process(target=_open_at_once, args=(small_dir, barrier, results)) for _ in "1234"
    ]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(60)
    assert sorted(results.get(timeout=5) for _ in ranks) == [8, 8, 8, 8]
    meta_path = Path(small_dir) / "meta.json"
    assert meta_path.read_text() == json.dumps({**raw, "max_token_id": 257}, indent=2) + "\n"
    assert sorted(p.name for p in Path(small_dir).iterdir()) == ["meta.json", "tokens.bin"]


@pytest.mark.parametrize("model_vocab_size", [None, 300])
def test_a_window_holding_an_id_beyond_the_vocabulary_stops_naming_file_and_offset(
    small_dir, model_vocab_size
):
    tokens = _plant(small_dir, 9, 600)  # meta.json still says the largest id is 257
    ds = MemoryMappedDataset(small_dir, seq_len=4, model_vocab_size=model_vocab_size)
    assert ds[0]["input_ids"].tolist() == [0, 1, 2, 3]
    assert ds[1]["labels"].tolist() == [5, 6, 7, 8]  # tokens [4, 9): offset 9 not yet read
    model = " and model.vocab_size 300" if model_vocab_size else ""
    with pytest.raises(DataError) as info:
        ds[2]  # tokens [8, 13)
    assert str(info.value) == (
        f"{tokens}: the token at offset 9 is id 600, " + CORRUPT.format(model=model)
    )
    assert ds[3]["input_ids"].tolist() == [12, 13, 14, 15]


def test_a_worker_reading_a_bad_window_reports_one_line(small_dir):
    tokens = _plant(small_dir, 9, 600)
    ds = MemoryMappedDataset(small_dir, seq_len=4)
    loader = torch.utils.data.DataLoader(ds, batch_size=1, num_workers=2)
    with pytest.raises(DataError) as info:
        list(loader)
    assert str(unwrap_worker_error(info.value)) == (
        f"{tokens}: the token at offset 9 is id 600, " + CORRUPT.format(model="")
    )
