"""A BOS token per document: prepare-data --bos, the format flag, masking, sampling, builtin."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from kempnerforge.commands.prepare_data import add_prepare_data_arguments, run_prepare_data
from kempnerforge.config.loader import load_config
from kempnerforge.core.errors import ConfigError, DataError
from kempnerforge.data import builtin
from kempnerforge.data.builtin import builtin_corpus
from kempnerforge.data.dataset import IGNORE_INDEX, MemoryMappedDataset
from kempnerforge.data.pipeline_build import build_data_pipeline
from kempnerforge.data.prepare.corpus import prepare_data
from kempnerforge.data.tokenizer import ByteTokenizer, HFTokenizer
from kempnerforge.data.tokens.token_file import read_meta
from kempnerforge.training.inference.sample import prompt_ids
from kempnerforge.training.loss import cross_entropy_sum
from tests.support.data_files import make_hf_tokenizer, prepared_ids, write_jsonl

BYTE = ByteTokenizer()
BOS, EOS = BYTE.bos_id, BYTE.eos_id


def _ids(out: Path) -> list[int]:
    return prepared_ids(out).tolist()


def _prepare(tmp_path: Path, texts: list[str], name: str = "out", **kwargs) -> Path:
    src = write_jsonl(tmp_path / f"{name}.jsonl", texts)
    out = tmp_path / name
    prepare_data([str(src)], str(out), kwargs.pop("tokenizer", BYTE), **kwargs)
    return out


def test_bos_starts_every_document_and_is_recorded(tmp_path):
    out = _prepare(tmp_path, ["ab", "c"], bos_per_document=True)
    assert _ids(out) == [BOS, ord("a"), ord("b"), EOS, BOS, ord("c"), EOS]
    meta = read_meta(str(out))
    assert meta["bos_per_document"] is True and meta["num_tokens"] == 7
    assert meta["num_documents"] == 2


def test_without_bos_the_layout_is_unchanged(tmp_path):
    out = _prepare(tmp_path, ["ab", "c"])
    assert _ids(out) == [ord("a"), ord("b"), EOS, ord("c"), EOS]
    assert read_meta(str(out))["bos_per_document"] is False


def test_the_eval_split_gets_bos_too(tmp_path):
    texts = [f"document number {i}" for i in range(60)]
    src = write_jsonl(tmp_path / "d.jsonl", texts)
    train, held = tmp_path / "train", tmp_path / "held"
    prepare_data(
        [str(src)],
        str(train),
        BYTE,
        eval_fraction=0.3,
        eval_output_dir=str(held),
        bos_per_document=True,
    )
    for out in (train, held):
        ids = np.asarray(_ids(out))
        meta = read_meta(str(out))
        assert meta["bos_per_document"] is True
        assert ids[0] == BOS and (ids == BOS).sum() == (ids == EOS).sum() == meta["num_documents"]
        # Every BOS but the first follows an EOS: documents are [BOS ... EOS].
        assert (ids[1:][ids[1:] == BOS] == ids[1:][ids[:-1] == EOS]).all()


def test_a_tokenizer_whose_bos_is_its_eos_is_refused_and_nothing_is_written(tmp_path):
    no_bos = HFTokenizer(make_hf_tokenizer(tmp_path / "t.json", specials=("</s>",)))
    with pytest.raises(DataError) as info:
        _prepare(tmp_path, ["some text"], tokenizer=no_bos, bos_per_document=True)
    message = str(info.value)
    assert str(tmp_path / "out") in message and "no beginning-of-document token" in message
    assert "drop the BOS option" in message
    assert not (tmp_path / "out").exists()


def test_a_hugging_face_bos_is_written(tmp_path):
    hf = HFTokenizer(make_hf_tokenizer(tmp_path / "t.json"))
    out = _prepare(tmp_path, ["def add(a, b):"], tokenizer=hf, bos_per_document=True)
    ids = _ids(out)
    assert ids[0] == hf.bos_id != hf.eos_id and ids[-1] == hf.eos_id
    assert hf.decode(ids) == "def add(a, b):"


def test_older_meta_without_the_flag_reads_as_no_bos(tmp_path):
    out = _prepare(tmp_path, ["ab"])
    meta_path = out / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["bos_per_document"]
    meta_path.write_text(json.dumps(meta))
    assert read_meta(str(out))["bos_per_document"] is False
    assert MemoryMappedDataset(str(out), seq_len=2).bos_per_document is False


def test_a_malformed_flag_names_the_file(tmp_path):
    out = _prepare(tmp_path, ["ab"])
    meta_path = out / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["bos_per_document"] = "yes"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"meta.json: bos_per_document 'yes' is not true or false"):
        read_meta(str(out))


def test_masking_with_bos_never_predicts_across_documents(tmp_path):
    out = _prepare(tmp_path, ["abc", "de", "fgh"], bos_per_document=True)
    # ids: BOS a b c EOS BOS d e EOS BOS f g h EOS (14 tokens): one window of 13 inputs.
    ds = MemoryMappedDataset(str(out), seq_len=13)
    sample = ds[0]
    inputs, labels = sample["input_ids"].tolist(), sample["labels"].tolist()
    assert inputs[:6] == [BOS, *b"abc", EOS, BOS]
    for i, (x, y) in enumerate(zip(inputs, labels, strict=True)):
        if x == EOS:
            assert y == IGNORE_INDEX, f"position {i} predicts the next document's BOS"
        else:
            assert y != BOS, f"position {i} predicts a BOS inside a document"
    # BOS predicts the first token of its document; it starts that document.
    assert labels[inputs.index(BOS, 1)] == ord("d")
    assert sample["doc_ids"].tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]


def test_the_masked_loss_matches_documents_scored_one_by_one(tmp_path):
    """Packed with BOS and masking, the summed loss equals each [BOS ... EOS] document's own."""
    texts = ["abc", "de", "fgh"]
    out = _prepare(tmp_path, texts, bos_per_document=True)
    ds = MemoryMappedDataset(str(out), seq_len=13)
    sample = ds[0]
    torch.manual_seed(0)
    logits = torch.randn(13, BYTE.vocab_size)
    packed = cross_entropy_sum(logits[None], sample["labels"][None])
    count = int((sample["labels"] != IGNORE_INDEX).sum())
    start, total, expected_count = 0, torch.tensor(0.0), 0
    for text in texts:
        n = len(text) + 2  # BOS, the text, EOS: n - 1 predictions, the last one the EOS
        doc_labels = sample["labels"][start : start + n - 1]
        assert IGNORE_INDEX not in doc_labels.tolist()
        total = total + cross_entropy_sum(logits[start : start + n - 1][None], doc_labels[None])
        expected_count += n - 1
        start += n
    assert count == expected_count == sum(len(t) + 1 for t in texts)
    assert torch.allclose(packed, total)


def test_prompt_ids_start_with_bos_only_for_bos_data():
    assert prompt_ids(BYTE, "hi", bos_per_document=True) == [BOS, *b"hi"]
    assert prompt_ids(BYTE, "hi", bos_per_document=False) == list(b"hi")


def test_the_pipeline_reports_bos_and_warns_on_disagreeing_data(tmp_path, caplog):
    texts = [f"text {i} " * 3 for i in range(40)]
    with_bos = _prepare(tmp_path, texts, "with", bos_per_document=True)
    without = _prepare(tmp_path, texts, "without")
    cfg = load_config(None, [f"--data.path={with_bos}", f"--data.eval_path={with_bos}"]).data
    pipe = build_data_pipeline(cfg, seq_len=8, batch_size=2, seed=0)
    assert pipe.bos_per_document is True
    with caplog.at_level(logging.WARNING, logger="kempnerforge"):
        sources = f'[{{name="a", path="{with_bos}"}}, {{name="b", path="{without}"}}]'
        mixed = load_config(
            None, [f"--data.datasets={sources}", f"--data.eval_path={with_bos}"]
        ).data
        pipe = build_data_pipeline(mixed, seq_len=8, batch_size=2, seed=0)
    assert pipe.bos_per_document is False
    text = caplog.text
    assert "mixes documents with and without a leading BOS (with: a)" in text
    assert f"eval set 'heldout' ({with_bos}) was prepared with a BOS per document" in text


def test_cli_flag_and_summary(tmp_path, capsys):
    src = write_jsonl(tmp_path / "d.jsonl", ["one", "two"])
    parser = argparse.ArgumentParser()
    add_prepare_data_arguments(parser)
    args = parser.parse_args(["--input", str(src), "--output", str(tmp_path / "o"), "--bos"])
    assert run_prepare_data(args, []) == 0
    assert "(uint16, BOS per document)" in capsys.readouterr().out
    assert _ids(tmp_path / "o")[:1] == [BOS]


@pytest.fixture
def tiny_stdlib(tmp_path, monkeypatch) -> None:
    root = tmp_path / "lib"
    for i in range(40):  # enough that a 0.2 eval split is never empty
        (root / f"m{i}.py").parent.mkdir(parents=True, exist_ok=True)
        (root / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 3)
    monkeypatch.setattr(builtin, "stdlib_dir", lambda: str(root))


def test_builtin_bos_is_its_own_cache_entry(tiny_stdlib, tmp_path):
    cache = str(tmp_path / "cache")
    plain = builtin_corpus(cache, BYTE, 0.2)[0]
    with_bos = builtin_corpus(cache, BYTE, 0.2, bos_per_document=True)[0]
    assert Path(plain).parent != Path(with_bos).parent
    assert read_meta(plain)["bos_per_document"] is False
    assert read_meta(with_bos)["bos_per_document"] is True
    assert _ids(Path(with_bos))[0] == BOS


def test_builtin_bos_with_a_tokenizer_without_bos_is_a_config_error(tiny_stdlib, tmp_path):
    path = make_hf_tokenizer(tmp_path / "t.json", specials=("</s>",))
    overrides = [f"--data.tokenizer={path}", "--data.builtin_bos=true"]
    cfg = load_config(None, [*overrides, f"--data.cache_dir={tmp_path}"]).data
    with pytest.raises(ConfigError) as info:
        build_data_pipeline(cfg, seq_len=8, batch_size=2, seed=0)
    assert info.value.field == "data.builtin_bos"
    assert "no BOS token of its own" in str(info.value)


def test_training_on_bos_data_samples_from_a_bos_prompt(tmp_path, tiny_overrides, monkeypatch):
    from kempnerforge.training.families import text as family
    from kempnerforge.training.inference import sample
    from kempnerforge.training.loop import run_training_loop
    from tests.support.resume import make_session

    texts = [f"def f{i}(x):\n    return x * {i}\n" for i in range(200)]
    data = _prepare(tmp_path, texts, "bos_data", bos_per_document=True)
    overrides = [o for o in tiny_overrides if not o.startswith(("--data.", "--train.sample"))]
    session = make_session(
        [*overrides, f"--data.path={data}", "--train.sample_prompt=def", "--train.max_steps=3"]
    )
    assert session.data.bos_per_document is True
    with session.tracker:
        run_training_loop(session)
    prompts = []
    real = family.generate_greedy

    def spy(model, ids, **kwargs):
        prompts.append(list(ids))
        return real(model, ids, **kwargs)

    monkeypatch.setattr(family, "generate_greedy", spy)
    text = sample.sample_text(session)
    assert prompts == [[BOS, *b"def"]]
    assert text is not None and text.startswith("def")
