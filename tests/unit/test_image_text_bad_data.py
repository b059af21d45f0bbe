"""Image-text samples recorded as bad data: each is read as the next good sample of the same
source, like a token window, in the dataset, the loader, windows_read and a resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kempnerforge.config.data import DataConfig
from kempnerforge.config.vlm import VisionEncoderConfig, VLMConfig, resolve_vision
from kempnerforge.core.errors import DataError
from kempnerforge.data.bad_windows import BAD_DATA_FILE, BadWindow
from kempnerforge.data.image_text import ImageTextDataset, SyntheticImageTextDataset
from kempnerforge.data.pipeline import DataPipeline
from kempnerforge.data.pipeline_build import build_image_text_pipeline
from kempnerforge.data.tokenizer import ByteTokenizer
from kempnerforge.training.session import BatchStream
from tests.support.image_pairs import write_pairs

SPEC = resolve_vision(VisionEncoderConfig(type="random", image_size=16, num_tokens=16))
TOK = ByteTokenizer()
PAIRS = 20


def _captions(dataset: ImageTextDataset, indices: range | list[int]) -> list[str]:
    return [TOK.decode(dataset[i]["input_ids"].tolist()) for i in indices]


def test_a_recorded_pair_reads_the_next_good_one_wrapping_at_the_end(tmp_path):
    index = str(write_pairs(tmp_path, [f"pair {i}" for i in range(5)]))
    clean = ImageTextDataset(index, SPEC, TOK, max_text_len=12)
    skipping = ImageTextDataset(index, SPEC, TOK, max_text_len=12)
    skipping.skip_windows = frozenset({1, 2, 4})
    assert [skipping.window_for(i) for i in range(5)] == [0, 3, 3, 3, 0]
    assert _captions(skipping, range(5)) == ["pair 0", "pair 3", "pair 3", "pair 3", "pair 0"]
    assert torch.equal(skipping[4]["pixel_values"], clean[0]["pixel_values"])


def test_a_recorded_synthetic_sample_reads_the_next_good_one():
    clean = SyntheticImageTextDataset(10, 3, SPEC, TOK, max_text_len=40)
    skipping = SyntheticImageTextDataset(10, 3, SPEC, TOK, max_text_len=40)
    skipping.skip_windows = frozenset({4, 9})
    for index, read in [(4, 5), (9, 0), (3, 3)]:
        for key in ("pixel_values", "input_ids", "labels"):
            assert torch.equal(skipping[index][key], clean[read][key]), (index, key)


def test_an_unreadable_image_is_replaced_by_the_next_pair_not_recorded(tmp_path):
    index = write_pairs(tmp_path, ["zero", "one", "two", "three"])
    (tmp_path / "images" / "1.png").write_bytes(b"not a png")
    dataset = ImageTextDataset(str(index), SPEC, TOK, max_text_len=8, bad_images="skip")
    dataset.skip_windows = frozenset({2})
    # Sample 1 is unreadable and its neighbour is recorded: both pass on to pair 3.
    assert _captions(dataset, [1, 2, 3]) == ["three", "three", "three"]


def test_an_index_with_no_good_pair_left_names_the_index_and_the_bad_data_file(tmp_path):
    index = write_pairs(tmp_path, ["zero", "one"])
    dataset = ImageTextDataset(str(index), SPEC, TOK, max_text_len=8)
    dataset.skip_windows = frozenset({0, 1})
    recorded = rf"index\.jsonl: all 2 of its windows are recorded as bad data \({BAD_DATA_FILE}"
    with pytest.raises(DataError, match=recorded):
        dataset[1]
    (tmp_path / "images" / "0.png").write_bytes(b"")
    dataset.skip_windows = frozenset({1})
    unreadable = (
        rf"index\.jsonl: 1 of its 2 pairs are recorded as bad data \({BAD_DATA_FILE} .* "
        r"the images of the other 1 cannot be read"
    )
    with pytest.raises(DataError, match=unreadable):
        dataset[0]


def _pipeline(index: Path, *, workers: int = 0, dp_rank: int = 0, dp_size: int = 1):
    return build_image_text_pipeline(
        DataConfig(num_workers=workers),
        VLMConfig(data=str(index), max_text_len=12),
        SPEC,
        batch_size=2,
        seed=7,
        dp_rank=dp_rank,
        dp_size=dp_size,
    )


def _epoch_captions(pipeline: DataPipeline) -> list[str]:
    assert pipeline.dataloader is not None
    return [TOK.decode(r.tolist()) for b in pipeline.dataloader for r in b["input_ids"]]


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_reads_the_stand_in_at_the_bad_samples_position_only(tmp_path, workers):
    index = write_pairs(tmp_path, [f"pair {i}" for i in range(PAIRS)])
    pipeline = _pipeline(index, workers=workers)
    assert pipeline.sampler is not None
    order = [pipeline.sampler.rank_index(0, p) for p in range(PAIRS)]
    bad, stand_in = order[5], (order[5] + 1) % PAIRS
    # A window of a token length names no sample of this index: kept, not applied.
    token_window = BadWindow(str(index), order[0], 32)
    assert pipeline.add_bad_windows([BadWindow(str(index), bad, 0), token_window])
    rows = _epoch_captions(pipeline)
    assert rows == [f"pair {stand_in if w == bad else w}" for w in order]
    assert f"pair {bad}" not in rows
    # The attribution of a later fault names what was read: the stand-in, window length 0.
    assert pipeline.windows_read(0, 5, 6, [0]) == [BadWindow(str(index), stand_in, 0)]


def test_recorded_samples_stay_skipped_after_a_resume_at_another_dp_size(tmp_path):
    index = write_pairs(tmp_path, [f"pair {i}" for i in range(PAIRS)])
    pipeline = _pipeline(index)
    assert pipeline.sampler is not None and pipeline.dataloader is not None
    order = [pipeline.sampler.rank_index(0, p) for p in range(PAIRS)]
    window = BadWindow(str(index), order[7], 0)
    pipeline.add_bad_windows([window])
    for _, _ in zip(range(2), pipeline.dataloader, strict=False):
        pass
    state = pipeline.state_dict()
    assert state["bad_windows"] == [[str(index), window.window, 0]]
    # Two ranks resume at global position 4; rank r's k-th row is global position 4 + r + 2k.
    read: dict[int, str] = {}
    for rank in range(2):
        resumed = _pipeline(index, dp_rank=rank, dp_size=2)
        resumed.load_state_dict(state)
        assert resumed.dataset is not None and resumed.dataset.skip_windows == {window.window}
        for k, caption in enumerate(_epoch_captions(resumed)):
            read[4 + rank + 2 * k] = caption
    stand_in = (window.window + 1) % PAIRS
    assert sorted(read) == list(range(4, PAIRS))
    assert [read[p] for p in range(4, PAIRS)] == [
        f"pair {stand_in if w == window.window else w}" for w in order[4:]
    ]


def test_a_worker_reading_an_index_recorded_bad_throughout_stops_with_one_line(tmp_path):
    index = write_pairs(tmp_path, [f"pair {i}" for i in range(4)])
    pipeline = _pipeline(index, workers=1)
    pipeline.add_bad_windows([BadWindow(str(index), i, 0) for i in range(4)])
    stream = BatchStream(pipeline)
    with pytest.raises(DataError) as caught:
        stream.next_batch()
    stream.reset()
    message = str(caught.value)
    assert message.startswith(f"{index}: all 4 of its windows are recorded as bad data")
    assert BAD_DATA_FILE in message and "remove those lines" in message
    assert "\n" not in message
