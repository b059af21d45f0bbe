"""End to end: a user prepares three corpora, trains a phased mixture, evaluates, errs.

Everything goes through `python -m kempnerforge` in subprocesses (forked from the warm
server, tests.support.warm_process), configured by a TOML file written the way a user
would write one. Independent subprocesses (the four prepare-data runs, the bad-input runs)
are started together, so their waits overlap.
"""

from __future__ import annotations

import json
import pathlib
import random
import re
import subprocess

import pytest

from tests.e2e.test_train_cli import kempnerforge
from tests.support.data_files import make_hf_tokenizer
from tests.support.metrics_rows import read_rows

pytestmark = pytest.mark.slow

NAMES = ["prose", "code", "nums"]
BATCH, SEQ_LEN, MAX_STEPS = 8, 32, 12
PEAK_LR = 1e-3
# At start_step 4 nums goes to weight 0 and the LR halves; at 8 nums is back, code goes to
# 0 (prose keeps its weight throughout) and the LR is a quarter of the scheduler's.
PHASES = [
    {"start_step": 4, "dataset_weights": {"nums": 0.0}, "lr_scale": 0.5},
    {"start_step": 8, "dataset_weights": {"nums": 2.0, "code": 0.0}, "lr_scale": 0.25},
]
EVAL_INTERVAL = CHECKPOINT_INTERVAL = 6


def start(*args: str, cache: pathlib.Path) -> subprocess.Popen:
    # One thread each: several of these run side by side.
    return kempnerforge(*args, env_extra={"OMP_NUM_THREADS": "1", "KEMPNERFORGE_CACHE": str(cache)})


def finish(proc: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_all(commands: dict[str, list[str]], cache: pathlib.Path) -> dict:
    """Run the commands side by side; their CompletedProcess by key."""
    procs = {key: start(*args, cache=cache) for key, args in commands.items()}
    return {key: finish(proc) for key, proc in procs.items()}


def toml_string(value: object) -> str:
    return json.dumps(str(value))  # a TOML basic string for these plain paths and names


def write_config(
    path: pathlib.Path,
    run_dir: pathlib.Path,
    datasets: list[tuple[str, pathlib.Path, float]],
    phases: list[dict],
    eval_sets: list[tuple[str, pathlib.Path]],
) -> pathlib.Path:
    """A job file with [model]/[train] tables and the mixture, phase and eval-set arrays."""
    lines = [
        "[model]",
        "dim = 32",
        "n_layers = 2",
        "n_heads = 2",
        "multiple_of = 16",
        "max_seq_len = 64",
        "",
        "[train]",
        'name = "mixture"',
        f"run_dir = {toml_string(run_dir)}",
        f"batch_size = {BATCH}",
        f"seq_len = {SEQ_LEN}",
        f"max_steps = {MAX_STEPS}",
        "seed = 7",
        'sample_prompt = ""',
        "",
        "[optimizer]",
        f"lr = {PEAK_LR}",
        "",
        "[scheduler]",
        'name = "constant"',
        "warmup_steps = 0",
        "",
        "[data]",
        'tokenizer = "byte"',
        "mix_temperature = 1.0",
        "",
        "[eval]",
        f"interval = {EVAL_INTERVAL}",
        "steps = 2",
        "",
        "[checkpoint]",
        f"interval = {CHECKPOINT_INTERVAL}",
        "",
        "[metrics]",
        "log_interval = 1",
        'progress = "off"',
    ]
    for name, data_dir, weight in datasets:
        lines += ["", "[[data.datasets]]", f'name = "{name}"', f"path = {toml_string(data_dir)}"]
        lines.append(f"weight = {weight}")
    for phase in phases:
        weights = ", ".join(f"{k} = {v}" for k, v in phase["dataset_weights"].items())
        lines += ["", "[[train.phases]]", f"start_step = {phase['start_step']}"]
        lines += [f"dataset_weights = {{ {weights} }}", f"lr_scale = {phase['lr_scale']}"]
    for name, data_dir in eval_sets:
        lines += ["", "[[eval.sets]]", f'name = "{name}"', f"path = {toml_string(data_dir)}"]
    path.write_text("\n".join(lines) + "\n")
    return path


# --- preparing the corpora -------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache(builtin_cache) -> pathlib.Path:
    return builtin_cache


def _write_inputs(root: pathlib.Path) -> dict[str, list[str]]:
    """Raw corpora of distinguishable text: prose as .txt files, code and numbers as jsonl."""
    rng = random.Random(0)
    words = ["the", "river", "bends", "past", "an", "old", "mill", "where", "herons", "wait"]
    prose = [" ".join(rng.choices(words, k=rng.randint(30, 80))) + "\n" for _ in range(40)]
    (root / "prose").mkdir()
    for i, text in enumerate(prose):
        (root / "prose" / f"page{i:02d}.txt").write_text(text)
    code = [f"def f{i}(x):\n    return x * {i} + {rng.randint(0, 99)}\n" for i in range(200)]
    nums = [" ".join(str(rng.randint(0, 999)) for _ in range(20)) for _ in range(200)]
    for name, texts in (("code", code), ("nums", nums)):
        with open(root / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return {"prose": prose, "code": code, "nums": nums}


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, cache) -> dict:
    """The raw texts, the prepare-data results and the prepared directories by name.

    prose and code get a held-out split (the eval sets); "other" is the nums text prepared
    with a small Hugging Face tokenizer, for the wrong-tokenizer case.
    """
    root = tmp_path_factory.mktemp("corpora")
    texts = _write_inputs(root)
    tokenizer = make_hf_tokenizer(root / "hf" / "tokenizer.json")
    dirs = {name: root / "prepared" / name for name in [*NAMES, "other"]}
    evals = {name: root / "prepared" / f"{name}-eval" for name in ("prose", "code")}
    inputs = {"prose": root / "prose", "code": root / "code.jsonl", "nums": root / "nums.jsonl"}
    commands = {}
    for name in NAMES:
        commands[name] = ["prepare-data", "--input", str(inputs[name]), "--output", str(dirs[name])]
        if name in evals:
            commands[name] += ["--eval-fraction", "0.2", "--eval-output", str(evals[name])]
    commands["other"] = [*commands["nums"][:3], "--output", str(dirs["other"])]
    commands["other"] += ["--tokenizer", tokenizer]
    results = run_all(commands, cache)
    return {"texts": texts, "results": results, "dirs": dirs, "evals": evals}


def test_prepare_data_prints_what_it_wrote_for_each_corpus(corpora):
    """The summary line reports every document and byte: with the byte tokenizer each
    document is its UTF-8 bytes plus one EOS, split between train and held-out."""
    pattern = re.compile(
        r"prepared ([\d,]+) tokens in ([\d,]+) documents \(uint16\) into (\S+)"
        r"(?:; held out ([\d,]+) tokens in ([\d,]+) documents into (\S+))?$"
    )
    for name in NAMES:
        result = corpora["results"][name]
        assert result.returncode == 0, result.stderr[-3000:]
        match = pattern.fullmatch(result.stdout.strip())
        assert match, result.stdout
        numbers = [int(g.replace(",", "")) if g else 0 for g in match.group(1, 2, 4, 5)]
        tokens, docs, held_tokens, held_docs = numbers
        texts = corpora["texts"][name]
        assert docs + held_docs == len(texts)
        assert tokens + held_tokens == sum(len(t.encode()) + 1 for t in texts)
        assert match.group(3) == str(corpora["dirs"][name])
        meta = json.loads((corpora["dirs"][name] / "meta.json").read_text())
        assert (meta["num_tokens"], meta["num_documents"]) == (tokens, docs)
        if name in corpora["evals"]:
            assert match.group(6) == str(corpora["evals"][name])
            assert held_docs > 0 and docs > 0
        else:
            assert match.group(4) is None
    assert corpora["results"]["other"].returncode == 0, corpora["results"]["other"].stderr


# --- training the phased mixture --------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpora, cache) -> dict:
    """A 12-step run over prose:code:nums = 2:1:1 with the two PHASES and two eval sets."""
    root = tmp_path_factory.mktemp("mixture_run")
    run_dir = root / "run"
    dirs, evals = corpora["dirs"], corpora["evals"]
    config = write_config(
        root / "mixture.toml",
        run_dir,
        [("prose", dirs["prose"], 2.0), ("code", dirs["code"], 1.0), ("nums", dirs["nums"], 1.0)],
        PHASES,
        [("prose", evals["prose"]), ("code", evals["code"])],
    )
    result = finish(start("train", str(config), cache=cache))
    return {"config": config, "run_dir": run_dir, "result": result}


def test_training_logs_per_dataset_tokens_and_losses_every_step(trained):
    result, run_dir = trained["result"], trained["run_dir"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"finished at step {MAX_STEPS} ({MAX_STEPS * BATCH * SEQ_LEN:,} tokens)" in result.stdout
    rows = [r for r in read_rows(run_dir) if "loss" in r and "event" not in r]
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1))
    previous = 0
    for row in rows:
        step_tokens, previous = row["tokens_seen"] - previous, row["tokens_seen"]
        assert step_tokens == BATCH * SEQ_LEN
        for name in NAMES:
            tokens = row[f"tokens/{name}"]
            assert tokens % SEQ_LEN == 0  # whole windows of input tokens
            # No rows from a source, no loss: written as null rather than left out.
            assert (row[f"loss/{name}"] is None) == (tokens == 0), (row["step"], name)
        assert sum(row[f"tokens/{name}"] for name in NAMES) == step_tokens, row["step"]


def test_phases_fire_at_their_start_step_and_apply_from_the_next_step(trained):
    """A phase fires once start_step steps are done: its event is logged at start_step,
    and step start_step + 1 is the first drawn with its weights and updated at its LR."""
    assert trained["result"].returncode == 0, trained["result"].stderr[-3000:]
    all_rows = read_rows(trained["run_dir"])
    events = [r for r in all_rows if r.get("event") == "phase"]
    expected = [(p["start_step"], p["start_step"], p["lr_scale"]) for p in PHASES]
    assert [(e["step"], e["start_step"], e["lr_scale"]) for e in events] == expected
    rows = {r["step"]: r for r in all_rows if "loss" in r and "event" not in r}
    # The constant schedule keeps the scheduler's LR at the peak: the row's lr is its scale.
    scales = [1.0] * 4 + [0.5] * 4 + [0.25] * 4
    assert [rows[s]["lr"] for s in range(1, 13)] == pytest.approx([PEAK_LR * f for f in scales])

    def tokens(name: str, steps: range) -> list[int]:
        return [rows[s][f"tokens/{name}"] for s in steps]

    first, second, third = range(1, 5), range(5, 9), range(9, 13)
    assert sum(tokens("nums", first)) > 0 and tokens("nums", second) == [0] * 4
    assert sum(tokens("nums", third)) > 0  # weight 2 again from the second phase
    assert sum(tokens("code", second)) > 0 and tokens("code", third) == [0] * 4
    assert all(sum(tokens("prose", steps)) > 0 for steps in (first, second, third))


def test_each_eval_set_gets_its_own_row_entries_and_checkpoints_are_written(trained):
    assert trained["result"].returncode == 0, trained["result"].stderr[-3000:]
    run_dir = trained["run_dir"]
    evals = [r for r in read_rows(run_dir) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [EVAL_INTERVAL, 2 * EVAL_INTERVAL]
    for row in evals:
        assert row["eval_tokens"] == sum(row[f"eval_tokens/{n}"] for n in ("prose", "code"))
        assert all(row[f"eval_tokens/{n}"] > 0 for n in ("prose", "code"))
        assert row["eval_loss/prose"] != row["eval_loss/code"]  # two different sets
        assert "eval_loss/nums" not in row  # a training source is not an eval set
    for step in (CHECKPOINT_INTERVAL, 2 * CHECKPOINT_INTERVAL):
        assert (run_dir / "checkpoints" / f"step_{step}" / "complete.json").is_file()


def test_eval_of_a_checkpoint_matches_the_eval_the_run_logged(trained, cache):
    assert trained["result"].returncode == 0, trained["result"].stderr[-3000:]
    run_dir = trained["run_dir"]
    (logged,) = [r for r in read_rows(run_dir) if "eval_loss" in r and r["step"] == EVAL_INTERVAL]
    checkpoint = run_dir / "checkpoints" / f"step_{EVAL_INTERVAL}"
    result = finish(
        start("eval", str(trained["config"]), f"--checkpoint={checkpoint}", cache=cache)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    table = [line.split() for line in result.stdout.splitlines()[:4]]
    assert [line[0] for line in table] == ["set", "prose", "code", "all"]
    report = json.loads((checkpoint / "eval.json").read_text())
    assert report["step"] == EVAL_INTERVAL
    for key in ("eval_loss", "eval_loss/prose", "eval_loss/code"):
        assert report["metrics"][key] == pytest.approx(logged[key], abs=1e-6), key
    for key in ("eval_tokens", "eval_tokens/prose", "eval_tokens/code"):
        assert report["metrics"][key] == logged[key], key


# --- bad input --------------------------------------------------------------------------------

MISSING = "does-not-exist"


def _bad_jobs(corpora, root: pathlib.Path) -> dict[str, tuple[list, list]]:
    """Per case, the (datasets, phases) of a job that must be refused at startup."""
    dirs = corpora["dirs"]
    good = [("prose", dirs["prose"], 2.0), ("code", dirs["code"], 1.0)]
    phase = {"start_step": 2, "dataset_weights": {"code": 0.5}, "lr_scale": 1.0}
    return {
        "unknown_phase_dataset": (good, [{**phase, "dataset_weights": {"cdoe": 1.0}}]),
        "negative_phase_weight": (good, [{**phase, "dataset_weights": {"code": -1.0}}]),
        "negative_dataset_weight": ([good[0], ("code", dirs["code"], -1.0)], [phase]),
        "missing_path": ([good[0], ("code", root / MISSING, 1.0)], [phase]),
        "other_tokenizer": ([good[0], ("code", dirs["other"], 1.0)], [phase]),
        "phases_out_of_order": (good, [{**phase, "start_step": 5}, phase]),
        # Each phase alone leaves a weight on, together they leave none: code goes to 0 at
        # step 2 and stays there (sources not named keep the weights in force), prose at 3.
        "phases_zero_every_weight_together": (
            good,
            [
                {**phase, "dataset_weights": {"code": 0.0}},
                {**phase, "start_step": 3, "dataset_weights": {"prose": 0.0}},
            ],
        ),
    }


# case -> (the field the line starts with after "kempnerforge: error: ", text it also holds)
BAD_CASES = {
    "unknown_phase_dataset": ("train.phases[0].dataset_weights.cdoe", "did you mean 'code'?"),
    "negative_phase_weight": ("train.phases[0].dataset_weights.code", "expected a number >= 0"),
    "negative_dataset_weight": ("data.datasets[1].weight", "expected a number >= 0"),
    "missing_path": ("data.datasets[1].path", "{dir} is not a directory"),
    "other_tokenizer": ("data.datasets[1].path", "{dir} was prepared with tokenizer 'hf:"),
    "phases_out_of_order": ("train.phases[1].start_step", "(phases in order)"),
}


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory, corpora, cache) -> dict:
    """Each bad job's train result, and the directory its bad path names (if any)."""
    root = tmp_path_factory.mktemp("bad")
    commands, named = {}, {}
    for case, (datasets, phases) in _bad_jobs(corpora, root).items():
        # With an eval set, so the one line is the error (no eval data would add a warning).
        evals = [("prose", corpora["evals"]["prose"])]
        config = write_config(root / f"{case}.toml", root / case, datasets, phases, evals)
        commands[case] = ["train", str(config)]
        named[case] = datasets[-1][1]
    return {"results": run_all(commands, cache), "dirs": named}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_mixture_input_exits_2_with_one_line_naming_the_field(bad_runs, case):
    result = bad_runs["results"][case]
    field, text = BAD_CASES[case]
    text = text.format(dir=bad_runs["dirs"][case])
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"kempnerforge: error: {field}"), lines[0]
    assert text in lines[0], lines[0]


def test_phases_that_together_zero_every_weight_are_refused_at_startup(bad_runs):
    """docs/data.md: a phase leaving every weight at 0 stops the run at startup (exit 2,
    one line naming train.phases[i].dataset_weights). Weights not named stay as the
    earlier phases left them, so the second phase here leaves nothing to draw."""
    result = bad_runs["results"]["phases_zero_every_weight_together"]
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kempnerforge: error: train.phases[1].dataset_weights"), lines[0]
    assert "at least one weight > 0" in lines[0], lines[0]
