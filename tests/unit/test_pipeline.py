"""build_data_pipeline: batches, determinism, eval batches, resume, and which data is used."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kempnerforge.config.data import DataConfig
from kempnerforge.core.errors import ConfigError, DataError, DataPathError
from kempnerforge.data import builtin
from kempnerforge.data.dataset import IGNORE_INDEX
from kempnerforge.data.pipeline_build import build_data_pipeline
from kempnerforge.data.prepare.corpus import prepare_data
from kempnerforge.data.tokenizer import ByteTokenizer
from tests.support.data_files import make_hf_tokenizer, write_jsonl

SEQ_LEN, BATCH = 8, 2


@pytest.fixture
def data_dirs(tmp_path) -> tuple[str, str]:
    """(train, eval) prepared from 60 short documents."""
    src = write_jsonl(tmp_path / "d.jsonl", [f"doc {i}: " + "ab" * (i % 6) for i in range(60)])
    train, held = str(tmp_path / "train"), str(tmp_path / "eval")
    prepare_data([str(src)], train, ByteTokenizer(), eval_fraction=0.25, eval_output_dir=held)
    return train, held


def _build(cfg: DataConfig, **kw):
    kw = {"seq_len": SEQ_LEN, "batch_size": BATCH, "seed": 3, **kw}
    return build_data_pipeline(cfg, **kw)


def _batches(loader, n: int) -> list[dict[str, torch.Tensor]]:
    it = iter(loader)
    return [next(it) for _ in range(n)]


def _same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True)
    )


def test_batches_are_int64_dicts_of_batch_by_seq_len(data_dirs):
    pipe = _build(DataConfig(path=data_dirs[0]))
    batch = _batches(pipe.dataloader, 1)[0]
    assert set(batch) == {"input_ids", "labels", "doc_ids"}
    for value in batch.values():
        assert value.dtype == torch.int64 and value.shape == (BATCH, SEQ_LEN)
    assert pipe.num_train_windows == len(pipe.dataset) > 0
    assert pipe.eval_dataset is None  # data.path set, data.eval_path empty
    assert pipe.tokenizer.identity == "byte"


def test_batches_are_deterministic_given_the_seed(data_dirs):
    cfg = DataConfig(path=data_dirs[0], num_workers=2)
    first = _batches(_build(cfg).dataloader, 4)
    assert _same(first, _batches(_build(cfg).dataloader, 4))
    assert not _same(first, _batches(_build(cfg, seed=4).dataloader, 4))
    no_workers = _batches(_build(DataConfig(path=data_dirs[0])).dataloader, 4)
    assert _same(first, no_workers)


def test_unshuffled_order_is_sequential(data_dirs):
    pipe = _build(DataConfig(path=data_dirs[0], shuffle=False))
    batch = _batches(pipe.dataloader, 1)[0]
    expected = torch.stack([pipe.dataset[i]["input_ids"] for i in range(BATCH)])
    assert torch.equal(batch["input_ids"], expected)


def test_eval_batches_are_identical_across_calls_and_wrap_around(data_dirs):
    train, held = data_dirs
    pipe = _build(DataConfig(path=train, eval_path=held))
    num_windows = len(pipe.eval_dataset)
    num_batches = num_windows // BATCH + 2  # more than the eval set holds
    first = list(pipe.eval_batches(num_batches, BATCH))
    assert _same(first, list(pipe.eval_batches(num_batches, BATCH)))
    flat = torch.cat([b["input_ids"] for b in first])
    for j in range(len(flat)):
        assert torch.equal(flat[j], pipe.eval_dataset[j % num_windows]["input_ids"])


def _rows(batches: list[dict[str, torch.Tensor]]) -> list[tuple[tuple[int, ...], ...]]:
    """Each row of the batches as (input_ids, labels) tuples, in order."""
    return [
        (tuple(ids.tolist()), tuple(labels.tolist()))
        for batch in batches
        for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True)
    ]


@pytest.mark.parametrize(("dp_size", "global_batch"), [(2, 4), (3, 4), (4, 3), (5, 3)])
def test_eval_windows_are_the_same_set_whatever_the_number_of_ranks(
    data_dirs, dp_size, global_batch
):
    train, held = data_dirs
    cfg = DataConfig(path=train, eval_path=held)
    steps = 3
    one = _rows(list(_build(cfg).eval_batches(steps, global_batch)))
    assert len(one) == steps * global_batch
    ranks = [
        list(_build(cfg, dp_rank=r, dp_size=dp_size).eval_batches(steps, global_batch))
        for r in range(dp_size)
    ]
    # Every rank runs the same forwards (a sharded model gathers in each), of equal rows.
    assert len({len(batches) for batches in ranks}) == 1
    assert len({b["input_ids"].shape for batches in ranks for b in batches}) == 1
    rows = [row for batches in ranks for row in _rows(batches)]
    padding = [row for row in rows if set(row[1]) == {IGNORE_INDEX}]
    real = [row for row in rows if set(row[1]) != {IGNORE_INDEX}]
    # Together the ranks read exactly one process's windows, each once; a rank with a
    # shorter share pads with a row that counts no token.
    assert sorted(real) == sorted(one)
    assert len(padding) == steps * (dp_size * -(-global_batch // dp_size) - global_batch)


def test_each_rank_reads_a_contiguous_share_of_every_eval_step_in_capped_batches(data_dirs):
    train, held = data_dirs
    cfg = DataConfig(path=train, eval_path=held)
    one = _rows(list(_build(cfg).eval_batches(2, 6)))
    rank1 = list(_build(cfg, dp_rank=1, dp_size=2).eval_batches(2, 6, max_rows=2))
    assert [len(b["input_ids"]) for b in rank1] == [2, 1, 2, 1]  # 3 rows a step, 2 at most
    assert _rows(rank1) == one[3:6] + one[9:12]


def test_eval_batches_without_eval_data_is_a_data_error(data_dirs):
    pipe = _build(DataConfig(path=data_dirs[0]))
    with pytest.raises(DataError, match="no held-out data configured"):
        pipe.eval_batches(1, BATCH)


def test_eval_only_pipeline_has_no_dataloader(data_dirs):
    train, held = data_dirs
    pipe = _build(DataConfig(path=train, eval_path=held), with_train=False)
    assert pipe.dataloader is None and pipe.dataset is None and pipe.sampler is None
    assert pipe.state_dict() == {} and pipe.num_train_windows == 0
    pipe.load_state_dict({"anything": 1})  # nothing to restore: ignored
    assert len(list(pipe.eval_batches(2, BATCH))) == 2


@pytest.mark.parametrize("num_workers", [0, 2])
def test_pipeline_state_resumes_exactly(data_dirs, num_workers):
    cfg = DataConfig(path=data_dirs[0], num_workers=num_workers)
    reference = _batches(_build(cfg).dataloader, 7)
    pipe = _build(cfg)
    _batches(pipe.dataloader, 3)
    state = pipe.state_dict()
    resumed = _build(cfg)
    resumed.load_state_dict(state)
    assert _same(_batches(resumed.dataloader, 4), reference[3:])


def test_resume_continues_across_epochs(data_dirs):
    cfg = DataConfig(path=data_dirs[0])
    pipe = _build(cfg)
    per_epoch = len(pipe.dataset) // BATCH
    for _ in pipe.dataloader:
        pass
    assert pipe.epoch == 1
    resumed = _build(cfg)
    resumed.load_state_dict(pipe.state_dict())
    assert resumed.epoch == 1
    assert _same(_batches(resumed.dataloader, per_epoch), _batches(pipe.dataloader, per_epoch))


def test_too_few_windows_for_one_batch_is_a_data_error(data_dirs):
    with pytest.raises(DataError, match=r"train: .* fewer than one batch of 10000"):
        _build(DataConfig(path=data_dirs[0]), batch_size=10_000)


def test_data_from_another_tokenizer_is_refused(tmp_path, data_dirs):
    tok = make_hf_tokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(ConfigError, match="prepared with tokenizer 'byte', but this job uses 'hf:"):
        _build(DataConfig(path=data_dirs[0], tokenizer=tok))


@pytest.mark.parametrize("field", ["data.path", "data.eval_path"])
def test_a_configured_directory_that_is_not_prepared_names_its_field(tmp_path, data_dirs, field):
    paths = {"path": data_dirs[0], "eval_path": data_dirs[1], field.split(".")[1]: str(tmp_path)}
    with pytest.raises(ConfigError) as info:
        _build(DataConfig(**paths))
    assert info.value.field == field and isinstance(info.value, DataError)
    assert str(info.value).startswith(f"{field}: {tmp_path} has no meta.json")


@pytest.mark.parametrize("field", ["data.path", "data.eval_path"])
def test_an_id_beyond_the_vocabulary_names_its_field_and_offset(data_dirs, field):
    train, held = data_dirs
    tokens = Path(train if field == "data.path" else held) / "tokens.bin"
    ids = np.fromfile(tokens, dtype="<u2")
    ids[5] = 600
    ids.tofile(tokens)
    meta_path = tokens.parent / "meta.json"  # and the largest id recorded as such
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "max_token_id": 600}))
    with pytest.raises(DataPathError) as info:
        _build(DataConfig(path=train, eval_path=held), model_vocab_size=512)
    assert info.value.field == field
    assert str(info.value) == (
        f"{field}: {tokens}: the token at offset 5 is id 600, not below meta.json's vocab_size "
        "259 and model.vocab_size 512: the file is corrupt or was not written as the uint16 "
        "ids of tokenizer byte that meta.json names; run prepare-data again with this job's "
        "tokenizer"
    )


def test_model_vocab_smaller_than_the_data_is_refused(data_dirs):
    with pytest.raises(DataError, match="set model.vocab_size >= 259"):
        _build(DataConfig(path=data_dirs[0]), model_vocab_size=200)


def _fake_stdlib(root) -> str:
    for i in range(40):
        path = root / f"pkg{i % 4}" / f"mod{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"def f{i}():\n    return {i}\n" * 3)
    return str(root)


def test_empty_path_uses_the_builtin_corpus_and_its_eval_split(tmp_path, monkeypatch):
    monkeypatch.setattr(builtin, "stdlib_dir", lambda: _fake_stdlib(tmp_path / "lib"))
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"), builtin_eval_fraction=0.25)
    pipe = _build(cfg)
    assert pipe.dataset is not None and pipe.eval_dataset is not None
    assert str(tmp_path / "cache") in pipe.dataset.path
    assert pipe.eval_dataset.path.endswith("eval")
    assert len(list(pipe.eval_batches(2, BATCH))) == 2
    # An explicit eval_path wins over the built-in held-out split.
    src = write_jsonl(tmp_path / "e.jsonl", ["held out text " * 4])
    prepare_data([str(src)], str(tmp_path / "mine"), ByteTokenizer())
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"), eval_path=str(tmp_path / "mine"))
    assert _build(cfg).eval_dataset.path == str(tmp_path / "mine")
