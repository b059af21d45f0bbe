"""Named eval sets ([[eval.sets]]): parsing, startup checks and per-set evaluate metrics."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from kempnerforge.config.eval import EvalConfig, EvalSetConfig
from kempnerforge.config.loader import load_config
from kempnerforge.core.errors import ConfigError, DataError
from kempnerforge.data.pipeline_build import build_data_pipeline
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.training.build import build_session
from kempnerforge.training.eval import evaluate
from kempnerforge.training.inference.eval_checkpoint import format_table
from kempnerforge.training.loop import TrainingSession, run_training_loop
from tests.support.metrics_rows import eval_rows


def two_sets(token_dirs) -> list[str]:
    train, evald = token_dirs
    return [
        f'--eval.sets=[{{name = "eval", path = "{evald}"}}, {{name = "train", path = "{train}"}}]'
    ]


def session_with_sets(overrides: list[str]):
    """A built session whose data holds config.eval.sets."""
    config = load_config(None, [*overrides, "--eval.steps=2"])
    config.validate(1)
    return build_session(config, RuntimeContext())


def test_a_training_run_logs_every_named_set(tiny_overrides, token_dirs):
    session = session_with_sets([*tiny_overrides, *two_sets(token_dirs), "--eval.interval=3"])
    with session.tracker:
        run_training_loop(session)
    rows = eval_rows(session.config.run_dir)
    assert [r["step"] for r in rows] == [3, 6]
    for name in ("eval", "train"):
        assert math.isfinite(rows[-1][f"eval_loss/{name}"])


# --- config ------------------------------------------------------------------------------


def test_eval_sets_parse_from_toml_tables(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(
        '[eval]\nsteps = 3\n\n[[eval.sets]]\nname = "code"\npath = "data/code"\n\n'
        '[[eval.sets]]\nname = "web-2"\npath = "data/web"\n'
    )
    sets = load_config(str(path)).eval.sets
    assert sets == [EvalSetConfig("code", "data/code"), EvalSetConfig("web-2", "data/web")]


def test_eval_sets_parse_from_an_override():
    config = load_config(None, ['--eval.sets=[{name = "a_1", path = "/x"}]'])
    assert config.eval.sets == [EvalSetConfig("a_1", "/x")]
    assert load_config(None).eval.sets == []


@pytest.mark.parametrize(
    ("sets", "field"),
    [
        ([("a", "/x"), ("a", "/y")], "eval.sets[1].name"),
        ([("", "/x")], "eval.sets[0].name"),
        ([("ok", "/x"), ("bad name", "/y")], "eval.sets[1].name"),
        ([("a/b", "/x")], "eval.sets[0].name"),
        ([("a", "")], "eval.sets[0].path"),
    ],
)
def test_bad_eval_sets_name_the_field(sets, field):
    with pytest.raises(ConfigError) as info:
        EvalConfig(sets=[EvalSetConfig(n, p) for n, p in sets])
    assert info.value.field == field


def test_an_unknown_key_in_an_eval_set_names_it():
    with pytest.raises(ConfigError, match=r"eval\.sets\[0\]\.pth"):
        load_config(None, ['--eval.sets=[{name = "a", pth = "/x"}]'])


# --- data --------------------------------------------------------------------------------


def _eval_only_pipeline(eval_sets: list[EvalSetConfig]):
    """The default config's data pipeline over ``eval_sets`` alone (no training data), 4
    windows of 32 tokens a batch."""
    return build_data_pipeline(
        load_config(None).data,
        seq_len=32,
        batch_size=4,
        seed=0,
        with_train=False,
        eval_sets=eval_sets,
    )


def test_a_missing_eval_set_path_is_a_data_error_naming_field_and_file(tmp_path, token_dirs):
    missing = tmp_path / "nowhere"
    sets = [EvalSetConfig("ok", token_dirs[1]), EvalSetConfig("gone", str(missing))]
    with pytest.raises(DataError, match=r"eval\.sets\[1\]\.path") as info:
        _eval_only_pipeline(sets)
    assert str(missing) in str(info.value)


def test_an_eval_set_of_another_tokenizer_is_a_data_error(tmp_path, token_dirs):
    other = tmp_path / "other"
    shutil.copytree(token_dirs[1], other)
    meta = json.loads((other / "meta.json").read_text())
    meta["tokenizer"] = "some-other-tokenizer"
    (other / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"eval\.sets\[0\]\.path: .*other.*tokenizer"):
        _eval_only_pipeline([EvalSetConfig("x", str(other))])


def test_pipeline_holds_the_named_sets_in_order(token_dirs):
    train, evald = token_dirs
    pipe = _eval_only_pipeline([EvalSetConfig("b", evald), EvalSetConfig("a", train)])
    assert list(pipe.eval_datasets) == ["b", "a"]
    assert pipe.eval_dataset is pipe.eval_datasets["b"]
    first = next(pipe.eval_batches(1, 2, "a"))["input_ids"]
    assert first.tolist() == [pipe.eval_datasets["a"][k]["input_ids"].tolist() for k in (0, 1)]
    with pytest.raises(KeyError, match="c"):
        pipe.eval_batches(1, 2, "c")


def test_the_default_set_is_named_heldout(tiny_job_config):
    tc = tiny_job_config.train
    pipe = build_data_pipeline(
        tiny_job_config.data, seq_len=tc.seq_len, batch_size=tc.batch_size, seed=0
    )
    assert list(pipe.eval_datasets) == ["heldout"]


# --- evaluate ----------------------------------------------------------------------------


def _evaluate(session: TrainingSession) -> dict[str, float]:
    return evaluate(session.model, session.data, session.config, session.runtime)


def test_evaluate_reports_each_set_and_the_token_weighted_overall(tiny_overrides, token_dirs):
    session = session_with_sets([*tiny_overrides, *two_sets(token_dirs)])
    metrics = _evaluate(session)
    for name in ("eval", "train"):
        for key in ("eval_loss", "eval_ppl", "eval_tokens"):
            assert f"{key}/{name}" in metrics
        assert metrics[f"eval_ppl/{name}"] == pytest.approx(math.exp(metrics[f"eval_loss/{name}"]))
    tokens = {n: metrics[f"eval_tokens/{n}"] for n in ("eval", "train")}
    assert metrics["eval_tokens"] == sum(tokens.values())
    weighted = sum(metrics[f"eval_loss/{n}"] * t for n, t in tokens.items()) / sum(tokens.values())
    assert metrics["eval_loss"] == pytest.approx(weighted, rel=1e-12)
    assert metrics["eval_loss/eval"] != metrics["eval_loss/train"]
    assert _evaluate(session) == metrics  # deterministic
    table = format_table(metrics, ["eval", "train"], named=True)
    assert [line.split()[0] for line in table.splitlines()] == ["set", "eval", "train", "all"]


def test_the_default_single_set_keeps_the_old_keys(tiny_overrides, token_dirs):
    config = load_config(None, [*tiny_overrides, "--eval.steps=2"])
    config.validate(1)
    session = build_session(config, RuntimeContext())
    metrics = _evaluate(session)
    assert set(metrics) == {"eval_loss", "eval_ppl", "eval_tokens"}
    assert _evaluate(session) == metrics
    # The same data as a named set gives the same numbers, now with the per-set keys too.
    named = session_with_sets(
        [*tiny_overrides, f'--eval.sets=[{{name = "h", path = "{token_dirs[1]}"}}]']
    )
    named.model.load_state_dict(session.model.state_dict())
    got = _evaluate(named)
    assert got["eval_loss/h"] == metrics["eval_loss"] == got["eval_loss"]
    assert format_table(metrics, ["heldout"], named=False).splitlines()[1].split()[0] == "heldout"


def test_evaluate_refuses_data_built_without_the_configured_sets(tiny_overrides, token_dirs):
    session = session_with_sets([*tiny_overrides, *two_sets(token_dirs)])
    session.data.eval_datasets.pop("train")
    with pytest.raises(RuntimeError, match="eval_sets=config.eval.sets"):
        _evaluate(session)
