"""Config loading: TOML + overrides, coercion, each validation rule, message shapes."""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kempnerforge.config.job import JobConfig
from kempnerforge.config.loader import dump_config, load_config, parse_override, save_config
from kempnerforge.config.reference import config_reference_markdown, field_docs, section_classes
from kempnerforge.core.errors import ConfigError


def write(tmp_path, text: str, name: str = "job.toml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_defaults_load_without_a_file():
    assert load_config(None) == JobConfig()


def test_toml_file_and_overrides_layer_in_order(tmp_path):
    path = write(
        tmp_path,
        """
        [train]
        max_steps = 50
        batch_size = 4
        [optimizer]
        lr = 1e-3
        """,
    )
    config = load_config(path, ["--train.max_steps=20", "--optimizer.betas=[0.8,0.9]"])
    assert config.train.max_steps == 20
    assert config.train.batch_size == 4
    assert config.optimizer.lr == 1e-3
    assert config.optimizer.betas == [0.8, 0.9]


@pytest.mark.parametrize(
    ("override", "field", "expected"),
    [
        ("--train.max_steps=20", "train.max_steps", 20),
        ("--optimizer.lr=3e-4", "optimizer.lr", 3e-4),
        ("--optimizer.lr=1", "optimizer.lr", 1.0),
        ('--train.hooks=["a.b:C"]', "train.hooks", ["a.b:C"]),
        ("--train.hooks=[]", "train.hooks", []),
        ("--train.deterministic=true", "train.deterministic", True),
        ("--train.deterministic", "train.deterministic", True),
        ("--train.deterministic=false", "train.deterministic", False),
        ("--train.name=run1", "train.name", "run1"),
        ("--train.name=123", "train.name", "123"),
        ('--train.name="quoted"', "train.name", "quoted"),
        ("--model.n_kv_heads=2", "model.n_kv_heads", 2),
        ("--model.n_kv_heads=none", "model.n_kv_heads", None),
        ("--data.path=/tmp/x y", "data.path", "/tmp/x y"),
    ],
)
def test_override_coerced_to_declared_type(override, field, expected):
    section, name = field.split(".")
    value = getattr(getattr(load_config(None, [override]), section), name)
    assert value == expected
    assert type(value) is type(expected)


def test_parse_override_reads_toml_values():
    assert parse_override("--a.b=[1, 2]")[0] == "a.b"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("--train.max_steps=abc", "train.max_steps = 'abc': expected an integer"),
        ("--train.max_steps=1.5", "train.max_steps = 1.5: expected an integer"),
        ("--train.max_steps=0", "train.max_steps = 0: expected an integer > 0"),
        ("--optimizer.lr=fast", "optimizer.lr = 'fast': expected a number"),
        ("--optimizer.lr=inf", "optimizer.lr = inf: expected a finite number"),
        ("--optimizer.lr=nan", "optimizer.lr = nan: expected a finite number"),
        ("--train.deterministic=maybe", "train.deterministic = 'maybe': expected true or false"),
        ("--train.hooks=x", "train.hooks = 'x': expected a list of strings"),
        ("--model.n_kv_heads=3", "model.n_kv_heads = 3: expected a divisor of model.n_heads = 4"),
        ("--model.n_heads=3", "model.n_heads = 3: expected a divisor of model.dim = 256"),
        ("--optimizer.betas=[0.9]", "optimizer.betas = [0.9]: expected two numbers in [0, 1)"),
        ("--scheduler.min_lr_ratio=2", "scheduler.min_lr_ratio = 2.0: expected a number in"),
        ("--train.device=tpu", "train.device = 'tpu': expected one of 'auto', 'cpu', 'cuda'"),
        ("--train.hooks=['nocolon']", "train.hooks = 'nocolon': expected an import path"),
        ("--scheduler.name=cosin", None),  # registry names are checked at build time
    ],
)
def test_bad_values_raise_config_error_naming_field(override, message):
    if message is None:
        load_config(None, [override])
        return
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert str(info.value).startswith(message)


def test_unknown_key_suggests_closest_name():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["--train.max_stepz=3"])
    assert str(info.value).startswith("train.max_stepz: unknown key, did you mean 'max_steps'?")


def test_unknown_section_in_file_is_rejected(tmp_path):
    path = write(tmp_path, "[trian]\nmax_steps = 3\n")
    with pytest.raises(ConfigError, match="trian: unknown key, did you mean 'train'"):
        load_config(path)


def test_malformed_override_and_missing_file():
    with pytest.raises(ConfigError, match="--section.field=value"):
        load_config(None, ["--nodot=1"])
    with pytest.raises(ConfigError, match="an existing TOML file"):
        load_config("/nonexistent/job.toml")


def test_invalid_toml_names_the_file(tmp_path):
    path = write(tmp_path, "[train\n")
    with pytest.raises(ConfigError, match="job.toml"):
        load_config(path)


def test_include_merges_presets_under_the_file(tmp_path):
    write(tmp_path, "[model]\ndim = 128\nn_heads = 2\n", name="preset.toml")
    path = write(tmp_path, 'include = ["preset.toml"]\n[model]\nn_heads = 4\n')
    config = load_config(path)
    assert (config.model.dim, config.model.n_heads) == (128, 4)


def test_resolved_config_round_trips_through_toml(tmp_path):
    config = load_config(
        None, ["--model.n_kv_heads=2", "--train.hooks=['m:H']", "--optimizer.lr=1e-3"]
    )
    path = str(tmp_path / "config.toml")
    save_config(config, path)
    assert load_config(path) == config
    defaults = JobConfig()
    save_config(defaults, path)
    assert load_config(path) == defaults


def test_dump_leaves_out_none_fields():
    assert "n_kv_heads" not in dump_config(JobConfig())


@pytest.mark.parametrize(
    ("overrides", "world_size", "message"),
    [
        (["--train.seq_len=4096"], 1, "train.seq_len = 4096: expected <= model.max_seq_len"),
        (
            ["--model.num_experts=4", "--distributed.ep=2"],
            1,
            "distributed.ep = 2: expected a divisor of distributed.dp_shard = 1",
        ),
        (
            ["--distributed.dp_shard=3"],
            2,
            "distributed.dp_shard = 3: expected dp_replicate * dp_shard * cp * tp * pp == "
            "world size 2",
        ),
        (
            ["--distributed.tp=3"],
            4,
            "distributed.dp_shard = -1: expected dp_replicate * dp_shard * cp * tp * pp == world",
        ),
        (["--distributed.tp=8"], 8, "distributed.tp = 8: expected a divisor of model.n_heads = 4"),
        (
            ["--distributed.tp=2", "--model.n_kv_heads=1"],
            2,
            "distributed.tp = 2: expected a divisor of model.n_kv_heads = 1",
        ),
        (
            ["--distributed.pp=8", "--train.grad_accum_steps=8"],
            8,
            "distributed.pp = 8: expected pp * stages per rank (8) <= model.n_layers = 4",
        ),
        (
            [
                "--distributed.pp=2",
                "--distributed.pp_schedule=interleaved_1f1b",
                "--model.n_layers=3",
            ],
            2,
            "distributed.pp = 2: expected pp * stages per rank (4) <= model.n_layers = 3",
        ),
        (
            ["--distributed.pp=2", "--distributed.pp_split_points=[4]"],
            2,
            "distributed.pp_split_points = [4]: expected 1 increasing layer indices in [1, 3]",
        ),
        (
            ["--distributed.pp=2"],
            2,
            "train.grad_accum_steps = 1: expected a multiple of distributed.pp = 2",
        ),
        (
            ["--train.global_batch_size=9", "--train.batch_size=3", "--distributed.dp_shard=2"],
            2,
            "train.global_batch_size = 9: expected a multiple of the data-parallel degree 2",
        ),
        (
            ["--train.global_batch_size=10"],
            1,
            "train.global_batch_size = 10: expected batch_size * grad_accum_steps * dp",
        ),
        (
            ["--profiling.enable=true", "--profiling.start_step=2000"],
            1,
            "profiling.start_step = 2000: expected <= train.max_steps",
        ),
    ],
)
def test_validate_cross_section_rules(overrides, world_size, message):
    config = load_config(None, overrides)
    with pytest.raises(ConfigError) as info:
        config.validate(world_size)
    assert str(info.value).startswith(message)


def test_validate_accepts_defaults_and_a_matching_global_batch():
    load_config(None).validate(1)
    load_config(None).validate(2)  # dp_shard = -1 takes the world
    hsdp = ["--distributed.dp_replicate=2", "--distributed.tp=2"]
    load_config(None, hsdp).validate(8)
    pipeline = ["--distributed.pp=2", "--train.grad_accum_steps=4", "--data.document_masking=false"]
    load_config(None, [*pipeline, "--distributed.pp_split_points=[1]"]).validate(2)
    load_config(None, ["--train.global_batch_size=16", "--train.grad_accum_steps=2"]).validate(1)


def test_muon_runs_on_every_layout():
    """Sharded Muon exchanges whole matrices over the ranks that share them whatever the
    mesh dimensions (kempnerforge/optim/muon_sharded.py; checked against one process in
    tests/distributed/test_muon_fsdp.py and by check-parallel), so no layout is refused
    for it: the layouts that refused it before validate."""
    muon = "--optimizer.name=muon"
    pipeline = ["--distributed.pp=2", "--train.grad_accum_steps=2", "--data.document_masking=false"]
    experts = ["--model.num_experts=4", "--model.moe_top_k=2"]
    layouts = [
        (["--distributed.dp_shard=2"], 2),
        (["--distributed.dp_replicate=2", "--distributed.dp_shard=2"], 4),
        (["--distributed.tp=2", "--distributed.dp_shard=2"], 4),
        (["--distributed.tp=2", "--distributed.cp=2"], 4),
        (["--distributed.dp_replicate=2", "--distributed.tp=2"], 4),
        ([*pipeline, "--distributed.tp=2"], 4),
        ([*pipeline, "--distributed.cp=2"], 4),
        ([*experts, "--distributed.ep=2", "--distributed.dp_shard=2"], 2),
    ]
    for overrides, world_size in layouts:
        load_config(None, [muon, *overrides]).validate(world_size)


@pytest.fixture
def config_warnings():
    """Messages of WARNING records from kempnerforge.config, whatever configure_logging did
    to propagation before (so caplog's root handler may see nothing)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("kempnerforge.config")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_warmup_longer_than_the_run_is_accepted_with_one_warning(config_warnings):
    config = load_config(None, ["--scheduler.warmup_steps=20", "--train.max_steps=5"])
    config.validate(1)
    assert [r.getMessage() for r in config_warnings] == [
        "scheduler.warmup_steps = 20 is longer than train.max_steps = 5: warming up over 5 "
        "steps instead, so the learning rate peaks at the last step"
    ]
    assert config.scheduler.warmup_steps == 20  # the config keeps what the user wrote


@pytest.mark.parametrize(
    "overrides",
    [
        ["--scheduler.warmup_steps=5", "--train.max_steps=5"],
        ["--scheduler.warmup_steps=20", "--train.max_steps=5", "--scheduler.name=none"],
    ],
    ids=["warmup_equal_to_run", "schedule_without_warmup"],
)
def test_warmup_that_fits_or_is_ignored_does_not_warn(config_warnings, overrides):
    load_config(None, overrides).validate(1)
    assert config_warnings == []


NO_EVAL_DATA = "eval.interval = 50 but this job has no held-out data, so training skips eval: "


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        (
            ["--data.path=data/mine"],
            "data.path is set and data.eval_path is empty (only the built-in corpus has a "
            "held-out split of its own); set data.eval_path to a prepare-data directory "
            "(prepare-data --eval-fraction F --eval-output DIR writes one) or give "
            "[[eval.sets]]",
        ),
        (
            ['--data.datasets=[{name="a", path="data/a"}]'],
            "data.datasets is set and data.eval_path is empty (only the built-in corpus has "
            "a held-out split of its own); set data.eval_path to a prepare-data directory "
            "(prepare-data --eval-fraction F --eval-output DIR writes one) or give "
            "[[eval.sets]]",
        ),
        (
            ["--vision_encoder.type=random", "--vlm.max_text_len=8", "--vlm.data=pairs.jsonl"],
            "vlm.data is set and vlm.eval_data is empty; set vlm.eval_data to a jsonl index "
            "of held-out image-text pairs",
        ),
    ],
    ids=["data_path", "mixture", "vlm_data"],
)
def test_eval_without_held_out_data_warns_once_naming_what_to_set(config_warnings, overrides, why):
    load_config(None, ["--eval.interval=50", *overrides]).validate(1)
    assert [r.getMessage() for r in config_warnings] == [NO_EVAL_DATA + why]


@pytest.mark.parametrize(
    "overrides",
    [
        [],  # the built-in corpus brings its held-out split
        ["--data.path=data/mine", "--data.eval_path=data/mine-eval"],
        ["--data.path=data/mine", '--eval.sets=[{name="code", path="data/code"}]'],
        ["--data.path=data/mine", "--eval.interval=0"],
        ["--vision_encoder.type=random", "--vlm.max_text_len=8"],  # synthetic held-out pairs
    ],
    ids=["builtin", "eval_path", "eval_sets", "eval_off", "vlm_synthetic"],
)
def test_eval_with_held_out_data_or_turned_off_does_not_warn(config_warnings, overrides):
    load_config(None, ["--eval.interval=50", *overrides]).validate(1)
    assert config_warnings == []


@pytest.mark.parametrize(
    "name",
    ["run1", "123", "debug-mixture", "schedule_free", "v1.2", "_scratch", "a" * 128],
)
def test_safe_run_names_are_accepted(name):
    assert load_config(None, [f"--train.name={name}"]).train.name == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        ".",
        "..",
        ".hidden",
        "-rf",
        "a/b",
        "../escape",
        "a\\b",
        "tab\tname",
        "new\nline",
        "bell\x07",
        "with space",
        "caf\u00e9",
        "a" * 129,
    ],
)
def test_unsafe_run_names_are_refused(tmp_path, name):
    path = tmp_path / "job.toml"
    path.write_text(f"[train]\nname = {json.dumps(name)}\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert info.value.field == "train.name"
    assert str(info.value) == (
        f"train.name = {name!r}: expected 1 to 128 of [A-Za-z0-9._-], not starting with "
        "'.' or '-' (it names runs/<name>)"
    )


def test_public_config_api_imports_without_torch():
    code = (
        "import sys\n"
        "from kempnerforge.config import ConfigError, JobConfig, load_config\n"
        "from kempnerforge.core.errors import ConfigError as E\n"
        "from kempnerforge.config.job import JobConfig as J\n"
        "assert (ConfigError, JobConfig) == (E, J)\n"
        "assert load_config(None) == JobConfig()\n"
        "assert 'torch' not in sys.modules, 'kempnerforge.config imported torch'\n"
    )
    repo = pathlib.Path(__file__).parents[2]
    result = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_field_has_an_attribute_docstring():
    for cls in section_classes().values():
        missing = {f.name for f in dataclasses.fields(cls)} - set(field_docs(cls))
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


def test_docs_config_reference_matches_the_code():
    committed = (pathlib.Path(__file__).parents[2] / "docs" / "config.md").read_text()
    assert committed == config_reference_markdown(), (
        "docs/config.md is stale: python -m kempnerforge.config.reference > docs/config.md"
    )


_field_names = [
    f"{section}.{f.name}"
    for section, cls in section_classes().items()
    for f in dataclasses.fields(cls)
]
_values = st.one_of(
    st.integers(-5, 10_000).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["true", "false", "none", "[]", "[1,2]", "['a:b']", '"x"', "{a=1}", ""]),
    st.text(max_size=12),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.one_of(st.sampled_from(_field_names), st.text(max_size=10)), _values),
        max_size=4,
    )
)
def test_fuzzed_overrides_only_ever_raise_config_error(pairs):
    overrides = [f"--{name}={value}" for name, value in pairs]
    try:
        config = load_config(None, overrides)
        config.validate(1)
    except ConfigError:
        pass


@pytest.mark.parametrize(
    "path",
    sorted((pathlib.Path(__file__).parents[2] / "configs" / "train").glob("*.toml")),
    ids=lambda p: p.stem,
)
def test_every_shipped_training_config_loads_and_validates(path):
    config = load_config(str(path), [])
    config.validate(1)
    assert config.train.name and config.train.max_steps > 0
