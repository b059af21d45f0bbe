"""The facts README.md, docs/, scripts/ and configs/ state about the repository hold: every
path they name exists, README's benchmark list is bench/'s scripts, and every parameter
count they write is the count of the model it names, computed by ModelConfig.num_params
(tests/unit/test_config_model_size.py holds that equal to the built model's)."""

from __future__ import annotations

import pathlib
import re
from dataclasses import dataclass
from functools import cache

import pytest

from kempnerforge.config.loader import load_config

REPO = pathlib.Path(__file__).parents[2]
PRESETS = sorted(p.stem for p in (REPO / "configs" / "model").glob("*.toml"))


def prose_files() -> list[pathlib.Path]:
    """What tells a reader about the repository: README, docs, the scripts' READMEs and job
    scripts, the configs (their comments), the Makefile."""
    return [
        REPO / "README.md",
        *sorted((REPO / "docs").glob("*.md")),
        *sorted((REPO / "scripts").rglob("*.md")),
        *sorted((REPO / "scripts").rglob("*.sbatch")),
        *sorted((REPO / "configs").rglob("*.toml")),
        *sorted((REPO / "bench" / "models").glob("*.toml")),
        REPO / "Makefile",
    ]


def _name(path: pathlib.Path) -> str:
    return str(path.relative_to(REPO))


# --- Paths ------------------------------------------------------------------------------

PATH = re.compile(
    r"(?<![\w./$-])((?:configs|bench|scripts|examples|docs|tests|kempnerforge)/[\w./-]*[\w/])"
)
FILE_SUFFIXES = (".toml", ".py", ".md", ".sh", ".sbatch", ".txt", ".json", ".jsonl", ".jinja")


def named_paths(text: str) -> set[str]:
    """Repository paths ``text`` names: a file (by its suffix) or a directory (a trailing
    '/'); placeholders such as ``<date>`` or ``*`` end the path before them."""
    return {p for p in PATH.findall(text) if p.endswith("/") or p.endswith(FILE_SUFFIXES)}


@cache
def ignored_roots() -> tuple[str, ...]:
    """The folders .gitignore anchors at the root (bench/gpu/wheels/, ...): named by the
    docs as where something goes, absent from a checkout."""
    lines = (REPO / ".gitignore").read_text().splitlines()
    return tuple(line.strip("/") + "/" for line in lines if line.startswith("/"))


@pytest.mark.parametrize("path", prose_files(), ids=_name)
def test_every_path_the_docs_name_exists(path):
    missing = sorted(
        p
        for p in named_paths(path.read_text())
        if not (REPO / p).exists() and not p.startswith(ignored_roots())
    )
    assert not missing, f"{_name(path)} names paths that do not exist: {missing}"


def test_every_path_the_code_names_exists():
    """Docstrings, comments and messages of the package, bench/ and examples/ (a preset a
    benchmark loads, the docs page an error points to)."""
    missing = {}
    for folder in ("kempnerforge", "bench", "examples"):
        for path in sorted((REPO / folder).rglob("*.py")):
            absent = [
                p
                for p in named_paths(path.read_text())
                if not (REPO / p).exists() and not p.startswith(ignored_roots())
            ]
            if absent:
                missing[_name(path)] = absent
    assert not missing, f"paths that do not exist: {missing}"


def test_a_missing_path_is_found():
    text = "see `configs/model/7b.toml` and configs/train/debug.toml, runs/x, examples/s"
    assert named_paths(text) == {"configs/model/7b.toml", "configs/train/debug.toml"}
    assert not (REPO / "configs/model/7b.toml").exists()


# --- README's benchmark list --------------------------------------------------------------


def readme_bench_row() -> str:
    [row] = [line for line in (REPO / "README.md").read_text().splitlines() if "| `bench/`" in line]
    return row


def test_readme_names_every_bench_script_and_only_those():
    named = set(re.findall(r"`([\w/]+\.py)`", readme_bench_row()))
    scripts = {p.name for p in (REPO / "bench").glob("*.py")}
    assert scripts - named == set(), f"README's bench/ row does not name {scripts - named}"
    assert named - scripts == set(), f"README's bench/ row names {named - scripts}, not in bench/"
    assert "`bench/gpu/`" in readme_bench_row()


# --- Parameter counts ---------------------------------------------------------------------

NUMBER = r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)\s?([KMB])?"
COUNT = re.compile(
    NUMBER
    + r"(?:(-parameter| parameters?)| (active))"
    + r"|(?:Parameters:|of which) (\d[\d,]*) \(([\d.]+)([KMB])\)( are active)?"
)
"""A written count: ``3.5M-parameter``, ``134M parameters``, ``3.6M active``, or a config
header's exact count with its short form, ``Parameters: 3,542,784 (3.5M)`` (``of which N
(S) are active`` for the active count)."""
SCALE = {None: 1, "K": 10**3, "M": 10**6, "B": 10**9}
MODEL_PATH = re.compile(r"((?:configs/(?:model|train)|bench/models)/[\w-]+\.toml)")
PRESET_NAME = re.compile(
    r"(?i)\b(?:the\s+)?`?(" + "|".join(map(re.escape, PRESETS)) + r")`?\s+(?:preset|model|decoder)"
)
"""A preset named in words: "the debug preset", "`125m` preset", "the dense debug model"."""


def _model_named(match: re.Match[str]) -> str:
    """The config a MODEL_PATH or PRESET_NAME match names."""
    name = match.group(1)
    return name if "/" in name else f"configs/model/{name.lower()}.toml"


@dataclass(frozen=True)
class WrittenCount:
    """A parameter count as the text writes it, and the model it names."""

    where: str
    text: str
    value: float
    unit: int
    """The value of one unit of the last written digit (0.1M for "3.5M", 1 for "3,542")."""
    active: bool
    model: str | None


def _counts_of(where: str, unit_text: str, implied: str | None) -> list[WrittenCount]:
    """The counts of one paragraph or table row, each with the nearest model it names."""
    refs = [] if implied is None else [(-1, implied)]  # a config's own, before its text
    matches = [*MODEL_PATH.finditer(unit_text), *PRESET_NAME.finditer(unit_text)]
    refs += [(m.start(), _model_named(m)) for m in matches]
    found = []
    for m in COUNT.finditer(unit_text):
        number, scale, _, active_word, exact, short, short_scale, are_active = m.groups()
        before = [r for r in refs if r[0] < m.start()]
        after = [r for r in refs if r[0] > m.start()]
        model = max(before)[1] if before else min(after)[1] if after else implied
        active = bool(active_word or are_active)
        # A header's exact count and its short form: both must hold.
        for written, unit_scale in ((number, scale), (exact, None), (short, short_scale)):
            if written is not None:
                value, unit = _value(written, unit_scale)
                found.append(WrittenCount(where, m.group(0), value, unit, active, model))
    return found


def _value(written: str, scale: str | None) -> tuple[float, int]:
    """The number ``written`` (with its K, M or B) stands for, and one unit of its last
    digit."""
    decimals = len(written.split(".")[1]) if "." in written else 0
    return float(written.replace(",", "")) * SCALE[scale], SCALE[scale] // 10**decimals


def _units(text: str) -> list[tuple[int, str]]:
    """(first line, text) of each paragraph, with its lines joined, and of each table row."""
    units, paragraph, start = [], [], 0
    for number, line in enumerate([*text.splitlines(), ""], start=1):
        if line.startswith("|"):
            units.append((number, line))
        elif line.strip():
            paragraph.append(line.lstrip("# "))
            start = start or number
            continue
        if paragraph:
            units.append((start, " ".join(paragraph)))
            paragraph, start = [], 0
    return units


def written_counts(path: pathlib.Path) -> list[WrittenCount]:
    """Every parameter count of ``path``; in a config file, the file's own model unless
    the text names another."""
    implied = _name(path) if path.suffix == ".toml" else None
    text = path.read_text()
    counts = []
    for line, unit_text in _units(text):
        counts += _counts_of(f"{_name(path)}:{line}", unit_text, implied)
    counts += _table_counts(path, text)
    return counts


def _table_counts(path: pathlib.Path, text: str) -> list[WrittenCount]:
    """A table whose column heading is ``parameters`` or ``parameters (active)``: each
    row's cell there, of the model its first cell names."""
    counts, column = [], None
    for number, line in enumerate(text.splitlines(), start=1):
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if "|" in line else []
        if not cells:
            column = None
            continue
        if column is None:
            heads = [c.lower() for c in cells]
            column = next((i for i, c in enumerate(heads) if c.startswith("parameters")), None)
            continue
        ref = MODEL_PATH.search(cells[0]) or PRESET_NAME.search(cells[0])
        model = None if ref is None else _model_named(ref)
        cell = re.fullmatch(NUMBER + r"(?:\s*\(" + NUMBER + r"\))?", cells[column])
        if cell is None:
            continue
        for (written, scale), active in ((cell.group(1, 2), False), (cell.group(3, 4), True)):
            if written is not None:
                value, unit = _value(written, scale)
                where = f"{_name(path)}:{number}"
                counts.append(WrittenCount(where, cells[column], value, unit, active, model))
    return counts


@cache
def model_counts(config: str) -> tuple[int, int]:
    """(parameters, active parameters) of the model of ``config``, from the code."""
    model = load_config(str(REPO / config)).model
    return model.num_params(), model.num_active_params()


COUNTS = [c for path in prose_files() for c in written_counts(path)]


def test_the_counts_of_the_docs_and_configs_are_found():
    models = {c.model for c in COUNTS}
    assert {"configs/model/8b.toml", "configs/train/debug_moe.toml"} <= models
    assert "configs/train/debug.toml" in models  # its header's own count
    assert any(c.active for c in COUNTS) and len(COUNTS) > 20


@pytest.mark.parametrize("count", COUNTS, ids=lambda c: f"{c.where}:{c.text}")
def test_every_parameter_count_written_is_the_models(count):
    assert count.model is not None, (
        f"{count.where}: '{count.text}' names no model: name its config (configs/model/X.toml) "
        "or preset next to it"
    )
    total, active = model_counts(count.model)
    actual = active if count.active else total
    # Written rounded to its last digit: within half a unit of it (exact for a full count).
    assert abs(actual - count.value) <= count.unit / 2, (
        f"{count.where}: '{count.text}' for {count.model}, whose "
        f"{'active ' if count.active else ''}parameters number {actual:,}"
    )


def test_a_wrong_count_is_caught():
    [count] = _counts_of("x", "The default run: a 3.4M-parameter byte-level model", None)
    assert count.model is None and count.unit == 10**5
    [count] = _counts_of("x", "`configs/train/debug.toml`: a 3.4M-parameter model", None)
    total, _ = model_counts(count.model)
    assert abs(total - count.value) > count.unit / 2


def test_a_preset_named_after_a_published_shape_carries_its_size():
    """A preset whose header names the published model it copies (the Llama-3-8B shape) is
    named by that model's size, so `--preset 8b` is the 8B shape."""
    named = {}
    for preset in PRESETS:
        header = (REPO / "configs" / "model" / f"{preset}.toml").read_text().splitlines()[0]
        published = re.search(r"Llama-[\d.]+-(\d+)B", header)
        if published:
            named[preset] = f"{published.group(1)}b"
    assert len(named) >= 3, named
    assert all(preset == size for preset, size in named.items()), named
