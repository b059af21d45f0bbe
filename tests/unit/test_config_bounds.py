"""Upper bounds: values that would overflow an int64, a float32 or a C int are ConfigErrors."""

from __future__ import annotations

import dataclasses
import json
import typing

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kempnerforge.config.loader import load_config
from kempnerforge.config.reference import section_classes
from kempnerforge.core.errors import ConfigError


def _fields_of_type(kind: type) -> list[str]:
    """Dotted names of the top-level section fields declared as ``kind`` or ``kind | None``."""
    names = []
    for section, cls in section_classes().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if hints[f.name] in (kind, kind | None):
                names.append(f"{section}.{f.name}")
    return names


INT_FIELDS = _fields_of_type(int)
FLOAT_FIELDS = _fields_of_type(float)


def error_for(text: str) -> ConfigError:
    """The ConfigError that loading and validating ``text`` (a TOML file's body) raises."""
    return error_for_overrides([f"--{line}" for line in text.splitlines()])


def error_for_overrides(overrides: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides).validate(1)
    return info.value


def write_toml(tmp_path, tables: dict[str, dict[str, str]]) -> str:
    """A TOML file of [section] tables of ``key = literal`` lines; returns its path."""
    lines = []
    for section, fields in tables.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {literal}" for key, literal in fields.items()]
    path = tmp_path / "job.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optimizer.lr=1e39", "optimizer.lr = 1e+39: expected a number in (0, 10.0]"),
        ("optimizer.lr=11", "optimizer.lr = 11.0: expected a number in (0, 10.0]"),
        ("optimizer.muon_adam_lr=1e39", "optimizer.muon_adam_lr = 1e+39: expected a number in"),
        ("optimizer.weight_decay=1e39", "optimizer.weight_decay = 1e+39: expected a number in"),
        ("optimizer.eps=2", "optimizer.eps = 2.0: expected a number in (0, 1.0]"),
        ("model.rope_theta=1e39", "model.rope_theta = 1e+39: expected a number in (0, 1e+10]"),
        ("model.ffn_multiplier=1e300", "model.ffn_multiplier = 1e+300: expected a number in"),
        (
            "train.seed=100000000000000000000000",
            "train.seed = 100000000000000000000000: expected an integer in [-2**63, 2**63 - 1]",
        ),
        ("train.seed=-1", "train.seed = -1: expected an integer in [0, 2**63 - 1]"),
        (
            "model.dim=100000000000000000000",
            "model.dim = 100000000000000000000: expected an integer in [-2**63, 2**63 - 1]",
        ),
        ("model.dim=2147483648", "model.dim = 2147483648: expected an integer in [1, 2**31 - 1]"),
        ("model.vocab_size=2147483648", "model.vocab_size = 2147483648: expected an integer in"),
        ("model.n_layers=2147483648", "model.n_layers = 2147483648: expected an integer in"),
        ("train.batch_size=2147483648", "train.batch_size = 2147483648: expected an integer in"),
        ("train.seq_len=2147483648", "train.seq_len = 2147483648: expected an integer in"),
        (
            "train.max_steps=4611686018427387904",
            "train.max_steps = 4611686018427387904: expected an integer in [1, 2**62 - 1]",
        ),
        (
            "checkpoint.interval=4611686018427387904",
            "checkpoint.interval = 4611686018427387904: expected an integer in [0, 2**62 - 1]",
        ),
        ("eval.interval=4611686018427387904", "eval.interval = 4611686018427387904: expected"),
        ("metrics.log_interval=4611686018427387904", "metrics.log_interval = 46116860184273879"),
        ("train.num_threads=65537", "train.num_threads = 65537: expected an integer in [0, 65536]"),
        ("optimizer.muon_ns_steps=101", "optimizer.muon_ns_steps = 101: expected an integer in"),
        ("distributed.timeout_s=1e39", "distributed.timeout_s = 1e+39: expected a number in"),
        ("train.nan_rollback_lr_scale=2", "train.nan_rollback_lr_scale = 2.0: expected a number"),
        (
            "model.dim=2147483647",
            "model.dim = 2147483647: expected a width whose derived SwiGLU hidden size is at "
            "most 2**31 - 1 (dim, ffn_multiplier and multiple_of give 5726623232)",
        ),
        ("optimizer.lr=1" + "0" * 400, "optimizer.lr = 1000"),  # an int past the float range
        # Past Python's 4300-digit limit the override stays text: not an integer.
        ("train.seed=" + "9" * 5000, "train.seed = '9999"),
    ],
)
def test_overflowing_values_name_their_field(override, message):
    assert str(error_for(override)).startswith(message)


def test_the_largest_allowed_values_load():
    config = load_config(
        None,
        [
            "--train.seed=9223372036854775807",
            "--train.max_steps=4611686018427387903",
            "--optimizer.lr=10",
            "--model.vocab_size=2147483647",
            "--scheduler.warmup_steps=0",
        ],
    )
    config.validate(1)
    assert config.train.seed == 2**63 - 1


@pytest.mark.parametrize("field", INT_FIELDS)
def test_every_int_field_refuses_values_beyond_int64(tmp_path, field):
    section, key = field.split(".")
    for value in (2**63, -(2**63) - 1, 10**20, 10**4000):
        with pytest.raises(ConfigError) as info:
            load_config(write_toml(tmp_path, {section: {key: str(value)}}))
        assert info.value.field == field
        assert ": expected an integer in [-2**63, 2**63 - 1]" in str(info.value)


# Where 2**62 is fine: any 63-bit seed is a valid seed.
BEYOND_STEPS_ALLOWED = {"train.seed"}


@pytest.mark.parametrize("field", sorted(set(INT_FIELDS) - BEYOND_STEPS_ALLOWED))
def test_every_count_field_refuses_2_to_the_62(tmp_path, field):
    section, key = field.split(".")
    with pytest.raises(ConfigError) as info:
        load_config(write_toml(tmp_path, {section: {key: str(2**62)}}))
    assert info.value.field == field


# data.mix_temperature is only ever a divisor (weights ** (1 / T)): a huge one is harmless.
FLOAT32_ALLOWED = {"data.mix_temperature"}


@pytest.mark.parametrize("field", sorted(set(FLOAT_FIELDS) - FLOAT32_ALLOWED))
def test_every_float_field_refuses_values_beyond_float32(tmp_path, field):
    section, key = field.split(".")
    for literal in ("3.5e38", "1e39", "1.7e308", "inf", "-inf", "nan"):
        with pytest.raises(ConfigError) as info:
            load_config(write_toml(tmp_path, {section: {key: literal}}))
        assert info.value.field == field, literal


@pytest.mark.parametrize(
    ("phase", "message"),
    [
        (
            "{start_step = 4611686018427387904}",
            "train.phases[0].start_step = 4611686018427387904: expected an integer in",
        ),
        ("{lr_scale = 1e39}", "train.phases[0].lr_scale = 1e+39: expected a number in (0, 10.0]"),
        ("{lr_scale = inf}", "train.phases[0].lr_scale = inf: expected a finite number"),
    ],
)
def test_phase_fields_are_bounded(tmp_path, phase, message):
    path = write_toml(tmp_path, {"train": {"phases": f"[{phase}]"}})
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(message)


MIXTURE = '[{name = "a", path = "x", weight = %s}, {name = "b", path = "y", weight = %s}]'


@pytest.mark.parametrize(
    ("weights", "temperature", "phases", "hint"),
    [
        (("1e10", "1"), "0.01", "[]", "data.datasets weights are {'a': 10000000000.0, 'b': 1.0}"),
        (("0.1", "0.2"), "0.001", "[]", "data.datasets weights are {'a': 0.1, 'b': 0.2}"),
        (
            ("1", "1"),
            "0.05",
            "[{start_step = 5, dataset_weights = {a = 1e300}}]",
            "the weights in force from train.phases[0] are {'a': 1e+300, 'b': 1.0}",
        ),
    ],
    ids=["overflow", "all_underflow", "phase_overflow"],
)
def test_mixture_weights_must_survive_the_temperature(tmp_path, weights, temperature, phases, hint):
    path = write_toml(
        tmp_path,
        {
            "data": {"datasets": MIXTURE % weights, "mix_temperature": temperature},
            "train": {"phases": phases},
        },
    )
    config = load_config(path)
    with pytest.raises(ConfigError) as info:
        config.validate(1)
    assert str(info.value) == (
        f"data.mix_temperature = {float(temperature)!r}: expected a temperature for which every "
        f"weight ** (1 / temperature) and their sum are finite and not all 0 ({hint})"
    )


def test_ordinary_mixture_temperatures_validate(tmp_path):
    for temperature in ("0.1", "0.5", "1", "10", "1e300"):
        data = {"datasets": MIXTURE % ("3e9", "1e9"), "mix_temperature": temperature}
        load_config(write_toml(tmp_path, {"data": data})).validate(1)


# ---- fuzzing a whole TOML file ----------------------------------------------------------

_SECTIONS = {
    section: [f.name for f in dataclasses.fields(cls)] for section, cls in section_classes().items()
}
_ints = st.one_of(
    st.integers(-10, 10_000),
    st.integers(-(10**30), 10**30),
    st.sampled_from([2**31 - 1, 2**31, 2**62, 2**63 - 1, 2**63, -(2**63) - 1, 10**4000]),
).map(str)
_floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(
        lambda x: {"inf": "inf", "-inf": "-inf", "nan": "nan"}.get(repr(x), repr(x))
    ),
    st.sampled_from(["1e39", "3.5e38", "1e-320", "1e308", "-0.0", "0.5"]),
)


def _toml_string(text: str) -> str:
    """A TOML basic string for any text (ASCII, every other character escaped)."""
    escaped = "".join(
        ch if " " <= ch <= "~" and ch not in '"\\' else f"\\U{ord(ch):08x}" for ch in text
    )
    return f'"{escaped}"'


_strings = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",)), max_size=12).map(_toml_string),
    # Literal strings, and now and then an escape TOML refuses.
    st.sampled_from(["'..'", "'a.b:C'"] * 4 + ['"\\ud800"']),
)
_scalars = st.one_of(
    _ints,
    _floats,
    _strings,
    st.sampled_from(["true", "false", "1979-05-27", "07:32:00", "[]"]),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3).map(lambda xs: "[" + ", ".join(xs) + "]"),
        st.dictionaries(
            st.sampled_from(
                ["name", "path", "weight", "start_step", "lr_scale", "dataset_weights", "a", "b"]
            ),
            inner,
            max_size=3,
        ).map(lambda d: "{" + ", ".join(f"{k} = {v}" for k, v in d.items()) + "}"),
    ),
    max_leaves=6,
)
_names = st.sampled_from(["a", "b", "c", "", "a b"]).map(json.dumps)


def _inline_table(**fields: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.fixed_dictionaries({}, optional=fields).map(
        lambda d: "{" + ", ".join(f"{k} = {v}" for k, v in d.items()) + "}"
    )


def _array(item: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.lists(item, max_size=3).map(lambda xs: "[" + ", ".join(xs) + "]")


# A value of the declared kind for some fields, so that files also get past type checks
# into the range, cross-section and mixture rules.
_TYPED: dict[str, st.SearchStrategy[str]] = {
    "datasets": _array(_inline_table(name=_names, path=_names, weight=_floats)),
    "sets": _array(_inline_table(name=_names, path=_names)),
    "phases": _array(
        _inline_table(
            start_step=_ints,
            lr_scale=_floats,
            dataset_weights=_inline_table(a=_floats, b=_floats, c=_floats),
        )
    ),
    "betas": _array(_floats),
    "hooks": _array(st.sampled_from(['"m:C"', '"nocolon"', '""'])),
}


def _value_for(section: str, key: str) -> st.SearchStrategy[str]:
    cls = section_classes().get(section)
    hint = typing.get_type_hints(cls).get(key) if cls else None
    typed = _TYPED.get(key)
    if typed is None and hint in (int, int | None):
        typed = _ints
    elif typed is None and hint is float:
        typed = st.one_of(_floats, _ints)
    elif typed is None and hint is bool:
        typed = st.sampled_from(["true", "false"])
    elif typed is None and hint is str:
        typed = _strings
    return _values if typed is None else st.one_of(typed, _values)


@st.composite
def _toml_files(draw) -> str:
    def rarely(common: list[str], rare: list[str]) -> st.SearchStrategy[str]:
        """Mostly a known name, about one time in ten a wrong one."""
        return st.sampled_from(common * 9 + rare)

    lines = []
    if draw(st.sampled_from([False] * 7 + [True])):
        lines.append(f"include = {draw(_values)}")
    sections = rarely(sorted(_SECTIONS), ["trian", '"x\\ny"'])
    for section in draw(st.lists(sections, max_size=4, unique=True)):
        lines.append(f"[{section}]")
        keys = rarely(_SECTIONS.get(section, ["x"]), ["zz", '"q\\nr"'])
        for key in draw(st.lists(keys, max_size=4, unique=True)):
            lines.append(f"{key} = {draw(_value_for(section, key))}")
    return "\n".join(lines) + "\n"


@settings(max_examples=300, deadline=None)
@given(_toml_files())
# Rules that look at every layer once kept validation busy for minutes on this one.
@example("[model]\nn_layers = 2147483647\n")
def test_fuzzed_toml_files_only_ever_raise_config_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("fuzz") / "job.toml"
    path.write_text(text)
    try:
        load_config(str(path)).validate(1)
    except ConfigError as e:
        assert "\n" not in str(e), str(e)
