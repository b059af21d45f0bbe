"""Sharded corpora: prepare-data writing shard I of N, and N shards read as one dataset."""

from __future__ import annotations

import json
import pathlib
from pathlib import Path

import numpy as np
import pytest
import torch

from kempnerforge.cli import main
from kempnerforge.config.data import DataConfig, DatasetSourceConfig
from kempnerforge.config.eval import EvalSetConfig
from kempnerforge.core.errors import DataError
from kempnerforge.data.dataset import MemoryMappedDataset
from kempnerforge.data.pipeline_build import build_data_pipeline
from kempnerforge.data.prepare.corpus import prepare_data
from kempnerforge.data.tokenizer import ByteTokenizer, HFTokenizer
from kempnerforge.data.tokens import token_stream
from kempnerforge.data.tokens.shards import Shard, shard_name
from kempnerforge.data.tokens.token_file import read_meta
from tests.support.data_files import (
    make_hf_tokenizer,
    prepared_documents,
    prepared_ids,
    write_jsonl,
    write_token_dir,
)

DOCS = [f"document {i}: " + "word " * (i % 9) for i in range(120)]
# Documents per input file, in the sorted order a walk reads them: uneven on purpose.
FILE_SIZES = {"a/0.jsonl": 30, "a/1.jsonl": 5, "b.jsonl": 22, "c/d/2.jsonl": 1, "e.jsonl": 40}
TXT_FILES = {"a/z.txt": "one whole file", "f.txt": "another whole file"}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """Seven input files under one directory; their documents in walk order are DOCUMENTS."""
    root = tmp_path_factory.mktemp("inputs")
    start = 0
    for name, size in FILE_SIZES.items():
        write_jsonl(root / name, DOCS[start : start + size])
        start += size
    for name, text in TXT_FILES.items():
        (root / name).write_text(text)
    return root


def documents_in_walk_order() -> list[str]:
    """The documents of the input tree in sorted relative-path order of their files."""
    by_file, start = {}, 0
    for name, size in FILE_SIZES.items():
        by_file[name] = DOCS[start : start + size]
        start += size
    by_file.update({name: [text] for name, text in TXT_FILES.items()})
    return [doc for name in sorted(by_file) for doc in by_file[name]]


def prepare(inputs: Path, out: Path, *extra: str) -> int:
    """`kempnerforge prepare-data` over the input tree, with a held-out split beside ``out``."""
    held = out.parent / f"{out.name}-eval"
    argv = ["prepare-data", "--input", str(inputs), "--output", str(out)]
    argv += ["--eval-fraction", "0.2", "--eval-output", str(held), "--no-progress", *extra]
    return main(argv)


def shard_args(index: int, count: int) -> list[str]:
    return ["--shard-index", str(index), "--num-shards", str(count)]


@pytest.fixture(scope="module")
def corpora(inputs, tmp_path_factory) -> dict[str, Path]:
    """The same input prepared unsharded, as 1 shard and as 4 shards (four calls)."""
    root = tmp_path_factory.mktemp("corpora")
    assert prepare(inputs, root / "plain", "--workers", "2") == 0
    assert prepare(inputs, root / "one", *shard_args(0, 1)) == 0
    for index in range(4):
        workers = ["--workers", "2"] if index == 2 else []
        assert prepare(inputs, root / "four", *shard_args(index, 4), *workers) == 0
    return {name: root / name for name in ("plain", "one", "four")}


def test_an_unsharded_run_reads_the_files_in_sorted_order_with_any_worker_count(corpora):
    train = prepared_documents(corpora["plain"])
    held = prepared_documents(corpora["plain"].parent / "plain-eval")
    expected = documents_in_walk_order()
    assert [doc for doc in expected if doc not in set(held)] == train
    assert [doc for doc in expected if doc in set(held)] == held and held


def test_shards_in_order_hold_exactly_the_corpus_of_one_run(corpora):
    for split in ("", "-eval"):
        plain = prepared_ids(corpora["plain"].parent / f"plain{split}")
        for name in ("one", "four"):
            assert np.array_equal(prepared_ids(corpora[name].parent / f"{name}{split}"), plain)
    four = corpora["four"]
    assert sorted(p.name for p in four.iterdir()) == [shard_name(i, 4) for i in range(4)]
    # Seven files in blocks of 7 * i // 4: 1, 2, 2 and 2 files.
    sources = [read_meta(str(four / shard_name(i, 4)))["sources"] for i in range(4)]
    assert sources == [1, 2, 2, 2]
    documents = sum(read_meta(str(four / shard_name(i, 4)))["num_documents"] for i in range(4))
    assert documents == read_meta(str(corpora["plain"]))["num_documents"]


@pytest.mark.parametrize("seq_len", [5, 64])
def test_one_shard_and_four_shards_give_the_windows_of_one_directory(corpora, seq_len):
    plain, one, four = (
        MemoryMappedDataset(str(corpora[name]), seq_len) for name in ("plain", "one", "four")
    )
    assert len(plain) == len(one) == len(four) > 0
    for index in range(len(plain)):
        expected = plain[index]
        for dataset in (one, four):
            sample = dataset[index]
            assert all(torch.equal(sample[key], expected[key]) for key in expected), index
    assert four.num_tokens == plain.num_tokens and four.meta["num_shards"] == 4
    # Some windows do span a shard boundary.
    starts = four._stream.starts[1:-1]
    spanning = [
        i for i in range(len(four)) if any(i * seq_len < s <= i * seq_len + seq_len for s in starts)
    ]
    assert spanning


def write_shards(root: Path, shards: list[list[list[int]]], count: int | None = None) -> Path:
    """A sharded directory whose shard i holds the documents ``shards[i]``."""
    count = count or len(shards)
    for index, documents in enumerate(shards):
        write_token_dir(root / shard_name(index, count), documents)
    return root


def test_windows_span_shard_boundaries_and_empty_shards(tmp_path, monkeypatch):
    # Stream: 1 2 3 EOS | 4 5 EOS | (empty) | 6 EOS | 7 8 9 EOS
    data = write_shards(tmp_path / "d", [[[1, 2, 3]], [[4, 5]], [], [[6]], [[7, 8, 9]]])
    ds = MemoryMappedDataset(str(data), seq_len=3, document_masking=False)
    stream = [1, 2, 3, 257, 4, 5, 257, 6, 257, 7, 8, 9, 257]
    assert len(ds) == (len(stream) - 1) // 3 == 4
    assert ds[1]["input_ids"].tolist() == [257, 4, 5]  # from shard 0 into shard 1
    assert ds[2]["input_ids"].tolist() == [257, 6, 257]  # shard 1, past the empty 2, into 3
    assert ds[2]["labels"].tolist() == [6, 257, 7]  # and into shard 4
    # With room for two open maps only, reading everything twice still gives the stream.
    monkeypatch.setattr(token_stream, "MAX_OPEN_MAPS", 2)
    ds = MemoryMappedDataset(str(data), seq_len=2, document_masking=False)
    for _ in range(2):
        for index in range(len(ds)):
            assert ds[index]["input_ids"].tolist() == stream[index * 2 : index * 2 + 2]
            assert len(ds._stream._maps) <= 2


def test_opening_a_sharded_directory_reads_each_meta_json_and_no_tokens(tmp_path, monkeypatch):
    data = write_shards(tmp_path / "d", [[[i, i + 1, i + 2]] for i in range(12)])
    reads: list[str] = []
    real_read_text = pathlib.Path.read_text

    def counting(self, *args, **kwargs):
        reads.append(self.name)
        return real_read_text(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_text", counting)
    monkeypatch.setattr(np, "memmap", lambda *a, **k: pytest.fail("tokens read at opening"))
    ds = MemoryMappedDataset(str(data), seq_len=4)
    assert reads == ["meta.json"] * 12
    assert ds.num_tokens == 48 and len(ds) == 11


def test_a_missing_or_unfinished_shard_is_named(tmp_path):
    data = write_shards(tmp_path / "d", [[[1, 2]]] * 3, count=6)
    (data / shard_name(4, 6)).mkdir()  # being written: no meta.json yet
    with pytest.raises(DataError) as info:
        MemoryMappedDataset(str(data), seq_len=2)
    assert str(info.value) == (
        f"{data}: a corpus of 6 shards with 2 missing (shard-00003-of-00006, "
        "shard-00005-of-00006) and 1 without meta.json (shard-00004-of-00006); a shard is "
        "complete once its `prepare-data --shard-index I --num-shards 6` has finished: wait "
        "for those still running, or run the others again"
    )


def test_shards_of_two_counts_in_one_directory_are_refused(tmp_path):
    data = write_shards(tmp_path / "d", [[[1, 2]]] * 2)
    write_token_dir(data / shard_name(0, 3), [[1, 2]])
    with pytest.raises(DataError) as info:
        MemoryMappedDataset(str(data), seq_len=2)
    assert str(info.value) == (
        f"{data} holds shards of corpora of 2, 3 shards: one directory holds one corpus, "
        "written with one --num-shards; remove the shards of the others"
    )


def test_shards_that_disagree_are_refused_naming_the_shard(tmp_path):
    data = write_shards(tmp_path / "d", [[[1, 2]]] * 3)
    hf = HFTokenizer(make_hf_tokenizer(tmp_path / "tokenizer.json"))
    other = data / shard_name(2, 3)
    write_token_dir(other, [[1, 2]], tokenizer=hf)
    with pytest.raises(DataError) as info:
        MemoryMappedDataset(str(data), seq_len=2)
    assert str(info.value) == (
        f"{other}: tokenizer {hf.identity!r}, but 'byte' in {data / shard_name(0, 3)}: the "
        "shards of a corpus are read as one stream and must be prepared with the same "
        "tokenizer and options; prepare this shard again like the others"
    )
    write_token_dir(other, [[1, 2]])
    meta_path = data / shard_name(1, 3) / "meta.json"
    meta_path.write_text(
        json.dumps({**json.loads(meta_path.read_text()), "bos_per_document": True})
    )
    with pytest.raises(DataError, match=r"shard-00001-of-00003: bos_per_document True, but False"):
        MemoryMappedDataset(str(data), seq_len=2)


def test_a_truncated_shard_is_named(tmp_path):
    data = write_shards(tmp_path / "d", [[[1, 2]]] * 3)
    tokens = data / shard_name(1, 3) / "tokens.bin"
    tokens.write_bytes(tokens.read_bytes()[:4])
    with pytest.raises(DataError, match=rf"{tokens} is 4 bytes but meta.json says 3 tokens"):
        MemoryMappedDataset(str(data), seq_len=2)


def test_a_bad_id_in_a_shard_is_named_with_its_offset_in_that_shard(tmp_path):
    data = write_shards(tmp_path / "d", [[[1, 2, 3]]] * 3)
    tokens = data / shard_name(2, 3) / "tokens.bin"
    ids = np.fromfile(tokens, dtype="<u2")
    ids[1] = 999
    ids.tofile(tokens)
    ds = MemoryMappedDataset(str(data), seq_len=3)
    with pytest.raises(DataError, match=rf"^{tokens}: the token at offset 1 is id 999, not below"):
        ds[2]  # stream tokens [6, 10): offset 9 is shard 2's second token


def test_more_shards_than_files_writes_empty_shards_and_still_reads_the_corpus(tmp_path, log):
    src = tmp_path / "src"
    for i in range(3):
        write_jsonl(src / f"{i}.jsonl", [f"text {j} of file {i}" for j in range(20)])
    plain, sharded = tmp_path / "plain", tmp_path / "sharded"
    assert prepare(src, plain) == 0
    for index in range(5):  # blocks of 3 * i // 5 files: shards 0 and 2 get none
        assert prepare(src, sharded, *shard_args(index, 5)) == 0
    assert f"{sharded / shard_name(0, 5)}: shard 0 of 5 gets none of the 3 input files" in log.text
    empty = read_meta(str(sharded / shard_name(2, 5)))
    assert (empty["num_tokens"], empty["max_token_id"], empty["sources"]) == (0, -1, 0)
    assert np.array_equal(prepared_ids(sharded), prepared_ids(plain))
    assert len(MemoryMappedDataset(str(sharded), 4)) == len(MemoryMappedDataset(str(plain), 4))


def test_shard_options_are_checked(tmp_path, inputs, capsys):
    out = tmp_path / "out"
    assert prepare(inputs, out, *shard_args(4, 4)) == 2
    assert capsys.readouterr().err == (
        "kempnerforge: error: --shard-index 4: expected an integer in [0, 4) for --num-shards 4\n"
    )
    assert prepare(inputs, out, "--num-shards", "4") == 2
    assert "--shard-index I and --num-shards N go together" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(DataError, match="--num-shards 0: expected an integer >= 1"):
        Shard(0, 0)


def test_outputs_that_would_mix_sharded_and_unsharded_corpora_are_refused(tmp_path, inputs):
    sharded, plain = tmp_path / "sharded", tmp_path / "plain"
    prepare_data([str(inputs)], str(sharded), ByteTokenizer(), shard=Shard(0, 2))
    prepare_data([str(inputs)], str(plain), ByteTokenizer())
    with pytest.raises(DataError) as info:
        prepare_data([str(inputs)], str(sharded), ByteTokenizer())
    assert str(info.value) == (
        f"--output {sharded} holds the shards of a sharded corpus (shard-00000-of-00002); "
        "pass --shard-index and --num-shards to write one of them, or name another directory "
        "for an unsharded corpus"
    )
    with pytest.raises(DataError) as info:
        prepare_data([str(inputs)], str(plain), ByteTokenizer(), shard=Shard(1, 2))
    assert str(info.value) == (
        f"--output {plain} holds an unsharded corpus (meta.json, tokens.bin); write the "
        "shards into another directory, or remove it"
    )
    with pytest.raises(DataError) as info:
        prepare_data([str(inputs)], str(sharded), ByteTokenizer(), shard=Shard(1, 3))
    assert str(info.value) == (
        f"--output {sharded} holds shards of another shard count (shard-00000-of-00002); "
        "shard 1 of 3 would mix two corpora: remove them or name another directory"
    )
    (sharded / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match=r"holding other files \(notes.txt\), not a sharded"):
        prepare_data([str(inputs)], str(sharded), ByteTokenizer(), shard=Shard(1, 2))
    # Rewriting a shard already there is fine, as for an unsharded directory.
    (sharded / "notes.txt").unlink()
    again = prepare_data([str(inputs)], str(sharded), ByteTokenizer(), shard=Shard(0, 2))
    assert again == read_meta(str(sharded / shard_name(0, 2)))


def test_record_max_id_records_every_shard(tmp_path, capsys):
    data = write_shards(tmp_path / "d", [[[1, 2]], [[3, 40]]])
    for index in range(2):
        meta_path = data / shard_name(index, 2) / "meta.json"
        raw = json.loads(meta_path.read_text())
        del raw["max_token_id"]
        meta_path.write_text(json.dumps(raw))
    assert main(["prepare-data", "--record-max-id", str(data)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{data / shard_name(0, 2)}: recorded max_token_id 257 (3 tokens scanned)",
        f"{data / shard_name(1, 2)}: recorded max_token_id 257 (3 tokens scanned)",
    ]
    assert MemoryMappedDataset(str(data), 2).meta["max_token_id"] == 257


def _batches(pipe, n: int) -> list[dict[str, torch.Tensor]]:
    it = iter(pipe.dataloader)
    return [next(it) for _ in range(n)]


def _equal(a: list[dict], b: list[dict]) -> bool:
    return all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True)
    )


def test_every_data_field_reads_a_sharded_directory_as_its_unsharded_twin(corpora):
    def build(name: str, **fields) -> object:
        path, held = str(corpora[name]), str(corpora[name].parent / f"{name}-eval")
        cfg = DataConfig(path=path, eval_path=held, **fields)
        return build_data_pipeline(cfg, seq_len=8, batch_size=2, seed=5, model_vocab_size=259)

    plain, four = build("plain"), build("four")
    assert _equal(_batches(four, 6), _batches(plain, 6))
    assert _equal(list(four.eval_batches(3, 2)), list(plain.eval_batches(3, 2)))

    def mixture(name: str) -> object:
        path, held = str(corpora[name]), str(corpora[name].parent / f"{name}-eval")
        sources = [
            DatasetSourceConfig(name="a", path=path),
            DatasetSourceConfig(name="b", path=held),
        ]
        cfg = DataConfig(datasets=sources)
        sets = [EvalSetConfig(name="held", path=held)]
        return build_data_pipeline(cfg, seq_len=8, batch_size=2, seed=5, eval_sets=sets)

    plain, four = mixture("plain"), mixture("four")
    assert _equal(_batches(four, 6), _batches(plain, 6))
    assert _equal(list(four.eval_batches(3, 2, "held")), list(plain.eval_batches(3, 2, "held")))
