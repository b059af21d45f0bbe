"""prepare-data inputs beyond text files (parquet, saved Hugging Face datasets) and --workers."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from kempnerforge.cli import main
from kempnerforge.core.errors import DataError
from kempnerforge.data.prepare import sources
from kempnerforge.data.prepare.corpus import prepare_data
from kempnerforge.data.prepare.tokenize_workers import ChunkEncoder
from kempnerforge.data.tokenizer import ByteTokenizer, HFTokenizer
from tests.support.data_files import make_hf_tokenizer, prepared_documents, write_jsonl

TEXTS = [
    "first document\n",
    "zweites Dokument: \u00e4\u00f6\u00fc",
    "\u65e5\u672c\u8a9e \U0001f600",
    "def add(a, b):\n    return a + b\n",
    "the quick brown fox",
]


def _write_parquet(path: Path, columns: dict[str, list], row_group_size: int = 2) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def _save_dataset(path: Path, splits: dict[str, list[str]] | list[str]) -> Path:
    datasets = pytest.importorskip("datasets")

    def build(texts: list[str]):
        return datasets.Dataset.from_dict({"id": list(range(len(texts))), "text": texts})

    if isinstance(splits, dict):
        datasets.DatasetDict({k: build(v) for k, v in splits.items()}).save_to_disk(str(path))
    else:
        build(splits).save_to_disk(str(path))
    return path


def _prepare(inputs: list[Path], out: Path, **kwargs) -> dict:
    tokenizer = kwargs.pop("tokenizer", None) or ByteTokenizer()
    return prepare_data([str(p) for p in inputs], str(out), tokenizer, **kwargs)


def test_parquet_round_trips_across_row_groups_and_read_batches(tmp_path, monkeypatch):
    pq = pytest.importorskip("pyarrow.parquet")
    texts = TEXTS + [None, ""] + [f"row {i}" for i in range(20)]
    path = _write_parquet(tmp_path / "d.parquet", {"id": list(range(len(texts))), "text": texts})
    assert pq.ParquetFile(path).metadata.num_row_groups > 5
    monkeypatch.setattr(sources, "_ROWS_PER_READ", 3)  # many batches, crossing row groups
    meta = _prepare([path], tmp_path / "out")
    expected = [t for t in texts if t]  # nulls and empty strings are no documents
    assert prepared_documents(tmp_path / "out") == expected
    assert meta["num_documents"] == len(expected) and meta["sources"] == 1


def test_parquet_custom_text_field(tmp_path):
    path = _write_parquet(tmp_path / "d.parquet", {"body": TEXTS})
    _prepare([path], tmp_path / "out", text_field="body")
    assert prepared_documents(tmp_path / "out") == TEXTS


def test_parquet_missing_column_names_file_and_columns(tmp_path):
    path = _write_parquet(tmp_path / "d.parquet", {"id": [1, 2], "body": ["a", "b"]})
    with pytest.raises(DataError, match=r"d\.parquet: no 'text' column \(columns: id, body\)"):
        _prepare([path], tmp_path / "out")
    assert not (tmp_path / "out" / "meta.json").exists()


def test_parquet_non_string_column_names_file_and_type(tmp_path):
    path = _write_parquet(tmp_path / "d.parquet", {"text": [1, 2]})
    with pytest.raises(DataError, match=r"d\.parquet: column 'text' holds int64, not strings"):
        _prepare([path], tmp_path / "out")


def test_corrupt_parquet_names_the_file(tmp_path):
    pytest.importorskip("pyarrow")
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"bad\.parquet: not a readable parquet file"):
        _prepare([path], tmp_path / "out")


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"d\.parquet: .*pip install kempnerforge\[parquet\]"):
        _prepare([path], tmp_path / "out")


def test_saved_dataset_round_trips(tmp_path):
    path = _save_dataset(tmp_path / "ds", TEXTS)
    meta = _prepare([path], tmp_path / "out")
    assert prepared_documents(tmp_path / "out") == TEXTS
    assert meta["sources"] == 1


def test_saved_dataset_dict_reads_train_or_the_given_split(tmp_path):
    path = _save_dataset(tmp_path / "dd", {"train": TEXTS[:3], "validation": TEXTS[3:]})
    _prepare([path], tmp_path / "train")
    assert prepared_documents(tmp_path / "train") == TEXTS[:3]
    _prepare([path], tmp_path / "val", split="validation")
    assert prepared_documents(tmp_path / "val") == TEXTS[3:]
    with pytest.raises(DataError, match=r"dd: no split 'test' \(splits: train, validation\)"):
        _prepare([path], tmp_path / "bad", split="test")


def test_saved_dataset_missing_column_names_dir_and_columns(tmp_path):
    path = _save_dataset(tmp_path / "ds", TEXTS)
    with pytest.raises(DataError, match=r"ds: no 'body' column \(columns: id, text\)"):
        _prepare([path], tmp_path / "out", text_field="body")


def test_saved_dataset_inside_a_walked_directory_is_one_source(tmp_path):
    src = tmp_path / "src"
    write_jsonl(src / "a.jsonl", ["a1", "a2"])
    _save_dataset(src / "b_ds", ["b1", "b2"])
    (src / "c.txt").write_text("c")
    meta = _prepare([src], tmp_path / "out")
    assert prepared_documents(tmp_path / "out") == ["a1", "a2", "b1", "b2", "c"]
    assert meta["sources"] == 3  # the dataset's arrow and json files are not inputs


def test_saved_dataset_without_datasets_says_what_to_install(tmp_path, monkeypatch):
    path = tmp_path / "ds"
    path.mkdir()
    (path / "state.json").write_text("{}")
    (path / "dataset_info.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match=r"ds: .*pip install kempnerforge\[hf-datasets\]"):
        _prepare([path], tmp_path / "out")


def _mixed_corpus(tmp_path: Path) -> list[Path]:
    """Many documents over several files, so --workers 2 gets many chunks."""
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "\u00e4\u00f6\u00fc", "\u65e5\u672c", "def", "return", "\U0001f600"]
    texts = [" ".join(rng.choice(words, size=int(rng.integers(1, 40)))) for _ in range(1500)]
    paths = [write_jsonl(tmp_path / "in" / "a.jsonl", texts[:900])]
    paths.append(write_jsonl(tmp_path / "in" / "b.jsonl.gz", texts[900:]))
    for i in range(3):
        (tmp_path / "in" / f"t{i}.txt").write_text(texts[i] * 3, encoding="utf-8")
        paths.append(tmp_path / "in" / f"t{i}.txt")
    return paths


def _bytes_and_meta(out: Path) -> tuple[bytes, dict]:
    return (out / "tokens.bin").read_bytes(), json.loads((out / "meta.json").read_text())


@pytest.mark.parametrize("kind", ["byte", "hf"])
def test_workers_output_is_byte_identical_to_one_worker(tmp_path, kind):
    tokenizer = ByteTokenizer() if kind == "byte" else None
    if kind == "hf":
        tokenizer = HFTokenizer(make_hf_tokenizer(tmp_path / "tok" / "tokenizer.json"))
    inputs = _mixed_corpus(tmp_path)
    results = {}
    for n in (1, 2):
        _prepare(
            inputs,
            tmp_path / f"out{n}",
            tokenizer=tokenizer,
            eval_fraction=0.2,
            eval_output_dir=str(tmp_path / f"eval{n}"),
            num_workers=n,
        )
        results[n] = (_bytes_and_meta(tmp_path / f"out{n}"), _bytes_and_meta(tmp_path / f"eval{n}"))
    assert results[2] == results[1]
    (data, meta), _ = results[2]
    assert meta["content_sha256"] == hashlib.sha256(data).hexdigest()
    assert meta["tokenizer"] == tokenizer.identity
    assert len(prepared_documents(tmp_path / "out2", tokenizer)) == meta["num_documents"]


def test_worker_errors_reach_the_caller_and_leave_no_output(tmp_path):
    tok_path = make_hf_tokenizer(tmp_path / "tokenizer.json")
    tokenizer = HFTokenizer(tok_path)
    Path(tok_path).write_text("{}")  # the workers rebuild from the file, now broken
    src = write_jsonl(tmp_path / "d.jsonl", TEXTS)
    with pytest.raises(DataError, match=r"tokenizer\.json: not a valid Hugging Face"):
        _prepare([src], tmp_path / "out", tokenizer=tokenizer, num_workers=2)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_cli_reads_parquet_with_workers(tmp_path, capsys):
    path = _write_parquet(tmp_path / "d.parquet", {"body": TEXTS})
    out = tmp_path / "out"
    argv = ["prepare-data", "--input", str(path), "--output", str(out)]
    argv += ["--text-field", "body", "--workers", "2", "--no-progress"]
    assert main(argv) == 0
    assert prepared_documents(out) == TEXTS
    assert capsys.readouterr().out.startswith("prepared ")


def test_cli_reads_a_dataset_dict_split(tmp_path):
    path = _save_dataset(tmp_path / "dd", {"train": TEXTS[:2], "test": TEXTS[2:]})
    out = tmp_path / "out"
    argv = ["prepare-data", "--input", str(path), "--output", str(out), "--split", "test"]
    assert main(argv + ["--no-progress"]) == 0
    assert prepared_documents(out) == TEXTS[2:]


def test_cli_rejects_zero_workers(tmp_path, capsys):
    src = write_jsonl(tmp_path / "d.jsonl", TEXTS)
    with pytest.raises(SystemExit) as exc:
        main(
            ["prepare-data", "--input", str(src), "--output", str(tmp_path / "o"), "--workers", "0"]
        )
    assert exc.value.code == 2
    assert "--workers: expected an integer >= 1" in capsys.readouterr().err


def test_chunk_encoder_reads_a_bounded_window_ahead_and_keeps_order():
    consumed = []

    def chunks():
        for i in range(20):
            consumed.append(i)
            yield [f"chunk {i}"]

    with ChunkEncoder(ByteTokenizer(), num_workers=2) as encoder:
        results = encoder.encode(chunks(), lambda texts: texts)
        first_chunk, first_arrays = next(results)
        assert len(consumed) == 4  # 2 chunks per worker in flight, not the whole input
        rest = list(results)
    assert [c for c, _ in [(first_chunk, first_arrays), *rest]] == [
        [f"chunk {i}"] for i in range(20)
    ]
    assert bytes(first_arrays[0]) == b"chunk 0"
