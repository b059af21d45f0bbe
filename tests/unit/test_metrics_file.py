"""Reading a metrics.jsonl from its end: the newest rows a reader wants, whatever the file's
length, without reading the rest."""

from __future__ import annotations

import json

from kempnerforge.core import metrics_file
from kempnerforge.core.metrics_file import read_rows, read_tail_rows


def _is_step(row: dict) -> bool:
    return "event" not in row


def test_the_newest_rows_are_read_from_the_end_of_a_long_file(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics_file, "TAIL_BYTES", 64)  # a window of about one row
    path = tmp_path / "metrics.jsonl"
    with path.open("w") as f:
        for step in range(1, 201):
            f.write(json.dumps({"step": step, "step_time_s": step / 10}) + "\n")
            if step % 7 == 0:
                f.write(json.dumps({"step": step, "event": "checkpoint"}) + "\n")
        f.write('{"step": 201, "step_ti')  # a torn last row, as a killed run leaves
    newest = read_tail_rows(path, 5, _is_step)
    assert [r["step"] for r in newest] == [196, 197, 198, 199, 200]
    whole = [r for r in read_rows(path) if _is_step(r)]
    assert read_tail_rows(path, 1000, _is_step) == whole  # fewer than asked: all of them
    assert read_tail_rows(path, 0, _is_step) == []


def test_an_empty_file_has_no_rows(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("")
    assert read_tail_rows(path, 3, _is_step) == []
