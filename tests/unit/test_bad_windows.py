"""Bad data windows: the stand-in read in their place, the run-level file, and the data state
(the order and the number of batches otherwise unchanged, resumes exact)."""

from __future__ import annotations

import pytest
import torch

from kempnerforge.config.data import DataConfig
from kempnerforge.core.errors import DataError
from kempnerforge.data.bad_windows import (
    BAD_DATA_FILE,
    BadWindow,
    BadWindows,
    next_good_window,
    read_bad_data,
    write_bad_data,
)
from kempnerforge.data.dataset import MemoryMappedDataset
from kempnerforge.data.pipeline_build import build_data_pipeline

SEQ = 32


def test_a_bad_window_reads_the_next_good_one_in_file_order_wrapping_at_the_end():
    bad = frozenset({3, 4, 9})
    assert next_good_window(2, bad, 10, "d") == 2
    assert next_good_window(3, bad, 10, "d") == 5
    assert next_good_window(9, bad, 10, "d") == 0


def test_a_dataset_whose_every_window_is_bad_names_the_file():
    with pytest.raises(DataError, match=f"d: all 3 of its windows are recorded.*{BAD_DATA_FILE}"):
        next_good_window(1, frozenset({0, 1, 2}), 3, "d")


def test_the_dataset_reads_the_stand_in_and_every_other_window_unchanged(token_dirs):
    clean = MemoryMappedDataset(token_dirs[0], SEQ)
    skipping = MemoryMappedDataset(token_dirs[0], SEQ)
    skipping.skip_windows = frozenset({5})
    assert torch.equal(skipping[5]["input_ids"], clean[6]["input_ids"])
    for window in (0, 4, 6, len(clean) - 1):
        assert torch.equal(skipping[window]["input_ids"], clean[window]["input_ids"])


def test_the_file_gains_lines_atomically_and_reads_back(tmp_path):
    first = [BadWindow("data/a", 7, SEQ)]
    write_bad_data(tmp_path, first, step=3)
    write_bad_data(tmp_path, [BadWindow("data/b", 2, 0)], step=9)
    assert read_bad_data(tmp_path) == [*first, BadWindow("data/b", 2, 0)]
    assert [p.name for p in tmp_path.iterdir()] == [BAD_DATA_FILE]
    assert '"step": 9' in (tmp_path / BAD_DATA_FILE).read_text()
    assert read_bad_data(tmp_path / "none") == []


def test_a_malformed_line_names_the_file_and_line(tmp_path):
    (tmp_path / BAD_DATA_FILE).write_text('{"path": "a", "window": 1, "seq_len": 32}\n{"x": 1}\n')
    with pytest.raises(DataError, match=rf"{BAD_DATA_FILE}, line 2: not a bad-window record"):
        read_bad_data(tmp_path)


def test_windows_are_kept_per_dataset_and_window_length():
    bad = BadWindows([BadWindow("a", 1, 32), BadWindow("a", 2, 16), BadWindow("b", 3, 32)])
    assert bad.of("a", 32) == {1} and bad.of("b", 32) == {3}
    assert bad.add([BadWindow("a", 1, 32), BadWindow("a", 9, 32)]) == [BadWindow("a", 9, 32)]
    assert BadWindows().load_state_dict(bad.state_dict()) == list(bad)


def _pipeline(token_dirs, *, workers=0, dp_rank=0, dp_size=1):
    cfg = DataConfig(path=token_dirs[0], eval_path=token_dirs[1], num_workers=workers)
    return build_data_pipeline(
        cfg, seq_len=SEQ, batch_size=4, seed=7, dp_rank=dp_rank, dp_size=dp_size
    )


def _epoch_rows(pipeline) -> list[bytes]:
    """Every row the loader yields in one epoch, as bytes."""
    return [row.numpy().tobytes() for batch in pipeline.dataloader for row in batch["input_ids"]]


@pytest.mark.parametrize("workers", [0, 2])
def test_skipping_keeps_every_position_and_replaces_only_the_bad_window(token_dirs, workers):
    pipeline = _pipeline(token_dirs, workers=workers)
    dataset, sampler = pipeline.dataset, pipeline.sampler
    order = [sampler.rank_index(0, p) for p in range(sampler.samples_per_rank)]
    usable = len(order) - len(order) % 4  # whole batches only
    bad = order[10]
    stand_in = (bad + 1) % len(dataset)
    assert pipeline.add_bad_windows([BadWindow(dataset.path, bad, SEQ)])
    rows = _epoch_rows(pipeline)
    assert len(rows) == usable  # the same number of batches
    clean = MemoryMappedDataset(token_dirs[0], SEQ)
    expected = [clean[stand_in if w == bad else w]["input_ids"].numpy().tobytes() for w in order]
    assert rows == expected[:usable]
    assert clean[bad]["input_ids"].numpy().tobytes() not in rows


def test_a_bad_window_added_mid_epoch_is_not_read_by_the_workers_after_a_reset(token_dirs):
    from kempnerforge.training.session import BatchStream

    pipeline = _pipeline(token_dirs, workers=2)
    stream = BatchStream(pipeline)
    sampler = pipeline.sampler
    for _ in range(3):
        stream.next_batch()
    later = [sampler.rank_index(0, p) for p in range(12, 40)]
    bad = [BadWindow(pipeline.dataset.path, w, SEQ) for w in later]
    pipeline.add_bad_windows(bad)
    stream.reset()
    clean = MemoryMappedDataset(token_dirs[0], SEQ)
    bad_rows = {clean[w]["input_ids"].numpy().tobytes() for w in later}
    seen = [r.numpy().tobytes() for _ in range(7) for r in stream.next_batch()["input_ids"]]
    assert not bad_rows & set(seen)
    stream.reset()


def test_the_data_state_carries_the_bad_windows_to_a_resume_at_another_dp_size(token_dirs):
    pipeline = _pipeline(token_dirs)
    window = BadWindow(pipeline.dataset.path, pipeline.sampler.rank_index(0, 9), SEQ)
    pipeline.add_bad_windows([window])
    for _, _ in zip(range(2), pipeline.dataloader, strict=False):
        pass
    state = pipeline.state_dict()
    assert state["bad_windows"] == [[window.path, window.window, SEQ]]
    # Two ranks resume at the same global position; each skips the window too.
    rows = []
    for rank in range(2):
        resumed = _pipeline(token_dirs, dp_rank=rank, dp_size=2)
        resumed.load_state_dict(state)
        assert window in resumed.bad_windows
        assert resumed.dataset.skip_windows == {window.window}
        rows += [resumed.windows_read(0, 4, 6, [rank])]
    # windows_read names the same windows whichever rank asks.
    assert _pipeline(token_dirs, dp_size=2).windows_read(0, 4, 6, [0, 1]) != rows[0] + rows[1]
    other = _pipeline(token_dirs, dp_size=2)
    other.load_state_dict(state)
    assert other.windows_read(0, 4, 6, [0, 1]) == rows[0] + rows[1]
