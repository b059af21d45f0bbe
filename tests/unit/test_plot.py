"""`kempnerforge plot`: reading metrics.jsonl as a resumed run ended up, and the PNG files."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from kempnerforge.commands.plot import add_plot_arguments, run_plot
from kempnerforge.core.errors import ConfigError, DataError
from kempnerforge.metrics.plot import GOODPUT_PLOT, PLOTTED, plot_runs, read_curves, run_names

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def train_row(step: int, loss: float, **more: object) -> dict:
    row = {
        "step": step,
        "loss": loss,
        "loss_avg": loss,
        "grad_norm": 1.0 / step,
        "lr": 1e-3 * step,
        "tokens_seen": 128 * step,
        "tokens_per_sec": 1000.0 + step,
        "time": 1.0,
    }
    row.update(more)
    return row


def write_jsonl(run_dir: Path, rows: list[dict], torn_tail: str = "") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + torn_tail)
    return path


def resumed_run(run_dir: Path) -> Path:
    """Steps 1..7 with eval at 3 and 6, killed; resumed from the step 4 checkpoint, steps
    5..8 again (logged every other step), eval at 6 again; a NaN value at step 8's norm."""
    rows = [train_row(s, 10.0 - s) for s in range(1, 8)]
    rows.insert(3, {"step": 3, "eval_loss": 7.5, "eval_ppl": 1800.0, "eval_tokens": 64})
    rows.insert(7, {"step": 6, "eval_loss": 6.5, "eval_ppl": 665.0, "eval_tokens": 64})
    rows.insert(5, {"step": 4, "event": "checkpoint", "path": "ckpt/step_4", "time": 1.0})
    rows += [
        {"step": 4, "event": "resume", "path": "ckpt/step_4", "tokens_seen": 512, "time": 2.0},
        train_row(6, 3.25),
        {"step": 6, "eval_loss": 6.25, "eval_ppl": 500.0, "eval_tokens": 64},
        train_row(8, 2.0, grad_norm=None),
    ]
    return write_jsonl(run_dir, rows, torn_tail='{"step": 9, "loss": 1.')


def test_a_resume_supersedes_the_rows_of_the_redone_steps(tmp_path):
    curves = read_curves(resumed_run(tmp_path / "run"), "run")
    assert curves.name == "run"
    assert set(curves.points) == set(PLOTTED)
    # Steps 5 and 7 of the first attempt were redone after the resume at step 4 and not
    # logged again; step 6 was, with its new loss; the torn row of step 9 is skipped.
    assert curves.points["loss"] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (6, 3.25), (8, 2.0)]
    assert curves.points["eval_loss"] == [(3, 7.5), (6, 6.25)]
    assert [s for s, _ in curves.points["lr"]] == [1, 2, 3, 4, 6, 8]
    assert curves.points["tokens_per_sec"][-1] == (8, 1008.0)
    # A null (non-finite) value is a gap, not a point and not the superseded value.
    assert [s for s, _ in curves.points["grad_norm"]] == [1, 2, 3, 4, 6]


def test_a_later_row_of_the_same_step_wins_and_a_rollback_restarts(tmp_path):
    rows = [
        train_row(1, 5.0),
        train_row(2, 4.0),
        train_row(3, float("nan")),
        {"step": 2, "event": "nan_rollback", "from_step": 3, "path": "p", "time": 1.0},
        train_row(3, 3.5),
        train_row(3, 3.0),
        {"step": 3, "event": "checkpoint", "path": "p"},
    ]
    path = tmp_path / "metrics.jsonl"
    # json.dumps writes NaN as a bare NaN token: the file a tracker never writes, still read.
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    curves = read_curves(path)
    assert curves.points["loss"] == [(1, 5.0), (2, 4.0), (3, 3.0)]
    assert "eval_loss" not in curves.points


def test_legend_names_are_directory_names_unless_they_clash(tmp_path):
    assert run_names([str(tmp_path / "a"), str(tmp_path / "b/")]) == ["a", "b"]
    clash = [str(tmp_path / "x" / "run"), str(tmp_path / "y" / "run")]
    assert run_names(clash) == clash


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_plot_arguments(parser)
    return parser.parse_args(list(argv))


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] > 100 and image.size[1] > 100


def test_plot_overlays_runs_into_one_png_per_metric(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    first, second = tmp_path / "first", tmp_path / "second"
    resumed_run(first)
    write_jsonl(second, [train_row(s, 9.5 - s) for s in range(1, 6)])
    assert run_plot(parse(str(first), str(second)), []) == 0
    written = sorted((first / "plots").iterdir())
    # The curves, and the wall-time breakdown (the first run has a second of wall time).
    names = [f"{key}.png" for key in PLOTTED] + [GOODPUT_PLOT]
    assert [p.name for p in written] == sorted(names)
    for path in written:
        assert_png(path)
    assert capsys.readouterr().out.split() == [str(first / "plots" / n) for n in names]

    out = tmp_path / "elsewhere" / "figures"
    assert run_plot(parse(str(second), "--out", str(out)), []) == 0
    # The second run has no eval rows: no eval_loss.png; all its rows share one time: no
    # wall time, no goodput.png.
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f"{key}.png" for key in PLOTTED if key != "eval_loss"
    )


def test_plot_labels_each_run(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    labels: list[list[str]] = []
    real_savefig = Figure.savefig

    def savefig(self, *args, **kwargs):
        labels.append([line.get_label() for line in self.axes[0].get_lines()])
        return real_savefig(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    a = read_curves(resumed_run(tmp_path / "a"), "run a")
    b = read_curves(write_jsonl(tmp_path / "b", [train_row(1, 2.0)]), "run b")
    paths = plot_runs([a, b], tmp_path / "out")
    assert [p.stem for p in paths] == list(PLOTTED)
    assert labels == [["run a"] if key == "eval_loss" else ["run a", "run b"] for key in PLOTTED]


def test_a_run_dir_without_metrics_is_a_one_line_error(tmp_path):
    resumed_run(tmp_path / "good")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError) as info:
        run_plot(parse(str(tmp_path / "good"), str(tmp_path / "empty")), [])
    message = str(info.value)
    assert str(tmp_path / "empty") in message and "metrics.jsonl" in message
    assert "\n" not in message
    write_jsonl(tmp_path / "events", [{"step": 0, "event": "load_weights", "path": "p"}])
    with pytest.raises(DataError, match="no training or eval rows"):
        run_plot(parse(str(tmp_path / "events")), [])
    with pytest.raises(ConfigError):
        run_plot(parse(str(tmp_path / "good")), ["--train.seed=1"])


def test_without_matplotlib_the_error_names_the_extra(tmp_path, monkeypatch):
    resumed_run(tmp_path / "run")
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    with pytest.raises(DataError) as info:
        run_plot(parse(str(tmp_path / "run")), [])
    assert "pip install 'kempnerforge[plot]'" in str(info.value)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "run" / "plots").exists()


def test_a_grpo_and_a_dpo_run_get_their_objectives_curves(tmp_path):
    pytest.importorskip("matplotlib")
    grpo = write_jsonl(
        tmp_path / "grpo",
        [train_row(s, 0.1, **{"grpo/reward": 0.1 * s, "grpo/kl": 0.01, "grpo/clip_ratio": 0.0})
         for s in range(1, 5)],
    )  # fmt: skip
    dpo = write_jsonl(
        tmp_path / "dpo",
        [train_row(s, 0.6, **{"rewards/margins": s, "rewards/accuracies": 0.5}) for s in (1, 2)],
    )
    curves = [read_curves(grpo, "grpo"), read_curves(dpo, "dpo")]
    assert curves[0].points["grpo/reward"] == [(1, 0.1), (2, 0.2), (3, 0.1 * 3), (4, 0.4)]
    assert "grpo/reward" not in curves[1].points and "rewards/margins" in curves[1].points
    written = [p.name for p in plot_runs(curves, tmp_path / "out")]
    assert written == [f"{key}.png" for key in PLOTTED if key != "eval_loss"] + [
        "rewards_margins.png",
        "rewards_accuracies.png",
        "grpo_reward.png",
        "grpo_kl.png",
        "grpo_clip_ratio.png",
    ]
    for name in written:
        assert_png(tmp_path / "out" / name)
