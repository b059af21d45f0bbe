"""Image-text data: caption shift and padding, real image decoding, bad images, resume."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from kempnerforge.config.data import DataConfig
from kempnerforge.config.vlm import VisionEncoderConfig, VLMConfig, resolve_vision
from kempnerforge.core.errors import DataError, DataPathError
from kempnerforge.data.dataset import IGNORE_INDEX
from kempnerforge.data.image_text import (
    ImageTextDataset,
    SyntheticImageTextDataset,
    caption_tensors,
    synthetic_picture,
)
from kempnerforge.data.pipeline_build import build_image_text_pipeline
from kempnerforge.data.tokenizer import ByteTokenizer
from tests.support.image_pairs import write_pairs

SPEC = resolve_vision(VisionEncoderConfig(type="random", image_size=16, num_tokens=16))
TOK = ByteTokenizer()


def test_labels_are_the_next_token_of_bos_caption_eos_and_padding_is_ignored():
    out = caption_tensors(TOK.encode("abc"), TOK, max_text_len=6)
    a, b, c = TOK.encode("abc")
    assert out["input_ids"].tolist() == [TOK.bos_id, a, b, c, TOK.pad_id, TOK.pad_id]
    assert out["labels"].tolist() == [a, b, c, TOK.eos_id, IGNORE_INDEX, IGNORE_INDEX]
    # No position's label is its own input: copying the input never lowers the loss.
    supervised = out["labels"] != IGNORE_INDEX
    assert not (out["labels"][supervised] == out["input_ids"][supervised]).any()


def test_a_long_caption_is_cut_to_max_text_len():
    out = caption_tensors(TOK.encode("abcdefgh"), TOK, max_text_len=4)
    assert out["input_ids"].tolist() == [TOK.bos_id, *TOK.encode("abc")]
    assert out["labels"].tolist() == TOK.encode("abcd")


def test_images_are_decoded_resized_and_normalised(tmp_path):
    index = write_pairs(tmp_path, ["zero", "one"], size=20)
    dataset = ImageTextDataset(str(index), SPEC, TOK, max_text_len=8)
    assert len(dataset) == 2
    sample = dataset[1]
    assert sample["pixel_values"].shape == (3, 16, 16)
    assert sample["pixel_values"].dtype == torch.float32
    expected = (np.array([10, 200, 245]) / 255.0 - 0.5) / 0.5  # solid colour, (x - mean) / std
    for channel in range(3):
        assert torch.allclose(
            sample["pixel_values"][channel], torch.tensor(expected[channel], dtype=torch.float32)
        )
    assert TOK.decode(sample["input_ids"].tolist()) == "one"


def test_a_corrupt_image_is_skipped_with_its_path_by_default(tmp_path, caplog):
    index = write_pairs(tmp_path, ["zero", "one", "two"])
    (tmp_path / "images" / "1.png").write_bytes(b"not a png")
    dataset = ImageTextDataset(str(index), SPEC, TOK, max_text_len=8, bad_images="skip")
    with caplog.at_level(logging.WARNING, logger="kempnerforge"):
        sample = dataset[1]
    assert TOK.decode(sample["input_ids"].tolist()) == "two"  # the next readable pair
    assert str(tmp_path / "images" / "1.png") in caplog.text
    assert "line 2" in caplog.text
    # The same index always reads the same pair: resuming stays exact.
    assert torch.equal(dataset[1]["pixel_values"], sample["pixel_values"])


def test_a_corrupt_image_is_fatal_with_bad_images_fail(tmp_path):
    index = write_pairs(tmp_path, ["zero", "one"])
    (tmp_path / "images" / "0.png").write_bytes(b"\x89PNG\r\n\x1a\ntruncated")
    dataset = ImageTextDataset(str(index), SPEC, TOK, max_text_len=8, bad_images="fail")
    with pytest.raises(DataError, match=r"images/0\.png \(line 1 of .*index\.jsonl\)"):
        dataset[0]
    assert TOK.decode(dataset[1]["input_ids"].tolist()) == "one"


def test_a_missing_image_file_is_a_bad_image(tmp_path):
    index = write_pairs(tmp_path, ["zero", "one"])
    (tmp_path / "images" / "0.png").unlink()
    dataset = ImageTextDataset(str(index), SPEC, TOK, max_text_len=8, bad_images="fail")
    with pytest.raises(DataError, match=r"0\.png.*cannot read the image"):
        dataset[0]


def test_an_index_of_only_bad_images_says_so(tmp_path):
    index = write_pairs(tmp_path, ["zero"])
    (tmp_path / "images" / "0.png").write_bytes(b"")
    dataset = ImageTextDataset(str(index), SPEC, TOK, max_text_len=8)
    with pytest.raises(DataError, match="none of its 1 images can be read"):
        dataset[0]


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("{not json", "line 2: not JSON"),
        (
            '{"image": "a.png"}',
            'line 2: each line must be an object with a non-empty string "image"',
        ),
        ('["a.png", "text"]', "line 2: each line must be an object"),
    ],
)
def test_a_malformed_index_line_is_named_with_the_config_field(tmp_path, line, problem):
    index = write_pairs(tmp_path, ["zero"])
    with open(index, "a") as f:
        f.write(line + "\n")
    vlm = VLMConfig(data=str(index))
    with pytest.raises(DataPathError) as caught:
        build_image_text_pipeline(DataConfig(), vlm, SPEC, batch_size=1, seed=0)
    assert caught.value.field == "vlm.data"
    assert problem in str(caught.value)


def test_a_missing_index_is_named_with_the_config_field(tmp_path):
    vlm = VLMConfig(data="", eval_data=str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataPathError, match=r"vlm\.eval_data: .*nope\.jsonl: no such file"):
        build_image_text_pipeline(DataConfig(), vlm, SPEC, batch_size=1, seed=0)


def test_synthetic_pictures_are_deterministic_and_show_their_caption():
    first, caption = synthetic_picture(7, 3, 32)
    again, caption_again = synthetic_picture(7, 3, 32)
    assert np.array_equal(first, again) and caption == caption_again
    other, _ = synthetic_picture(8, 3, 32)
    assert not np.array_equal(first, other)
    captions = {synthetic_picture(7, i, 32)[1] for i in range(200)}
    assert len(captions) > 40  # colours x shapes x places vary
    # The shape's colour is in the picture: its pixels match the captioned colour.
    from kempnerforge.data.image_text import COLOURS

    colour = caption.split()[1]
    matches = np.all(np.isclose(first, COLOURS[colour]), axis=-1)
    assert matches.sum() > 20


def test_synthetic_dataset_samples_depend_only_on_seed_and_index():
    a = SyntheticImageTextDataset(10, 3, SPEC, TOK, max_text_len=40)
    b = SyntheticImageTextDataset(10, 3, SPEC, TOK, max_text_len=40)
    for key in ("pixel_values", "input_ids", "labels"):
        assert torch.equal(a[4][key], b[4][key])
    assert TOK.decode(a[4]["input_ids"].tolist()).startswith("a ")


@pytest.mark.parametrize("workers", [0, 2])
def test_the_pipeline_resumes_at_the_exact_sample(workers):
    vlm = VLMConfig(synthetic_samples=64, max_text_len=40)
    cfg = DataConfig(num_workers=workers)

    def build():
        return build_image_text_pipeline(cfg, vlm, SPEC, batch_size=4, seed=5)

    data = build()
    assert data.dataloader is not None
    it = iter(data.dataloader)
    for _ in range(3):
        next(it)
    state = data.state_dict()
    expected = [next(it) for _ in range(2)]
    del it
    resumed = build()
    resumed.load_state_dict(state)
    assert resumed.dataloader is not None
    it = iter(resumed.dataloader)
    for want in expected:
        got = next(it)
        assert set(got) == {"pixel_values", "input_ids", "labels"}
        for key in got:
            assert torch.equal(got[key], want[key]), key
    del it


def test_the_synthetic_data_has_a_held_out_set_and_the_batch_size_is_checked():
    data = build_image_text_pipeline(
        DataConfig(), VLMConfig(synthetic_samples=40), SPEC, batch_size=4, seed=0
    )
    assert list(data.eval_datasets) == ["heldout"]
    assert len(data.eval_datasets["heldout"]) == 10
    batch = next(data.eval_batches(1, 4))
    assert batch["pixel_values"].shape == (4, 3, 16, 16)
    with pytest.raises(DataError, match="fewer than one batch of 8"):
        build_image_text_pipeline(
            DataConfig(), VLMConfig(synthetic_samples=7), SPEC, batch_size=8, seed=0
        )
