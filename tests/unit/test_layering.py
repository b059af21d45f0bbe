"""Contract tests: imports point down the package layers; loop.py matches its spec; no module
outgrows the size limit."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib

import kempnerforge
from kempnerforge.training import loop

PACKAGE = pathlib.Path(kempnerforge.__file__).parent

# Lower numbers are lower layers; a module may import its own package or a lower layer.
LAYERS = {
    "core": 0,
    "config": 1,
    "model": 2,
    "data": 2,
    "storage": 1,
    "optim": 2,
    "distributed": 3,
    "evaluation": 4,
    "checkpoint": 4,
    "metrics": 4,
    "resilience": 4,
    "launch": 4,
    "training": 5,
    "interop": 6,
    "commands": 7,
    "cli": 8,
    "__main__": 9,
}


def _imports(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return [n for n in names if n == "kempnerforge" or n.startswith("kempnerforge.")]


def test_imports_point_down_the_layers():
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts == ("__init__",):
            continue
        own = parts[0]
        for name in _imports(path):
            target = name.split(".")[1]
            if target != own and LAYERS[target] >= LAYERS[own]:
                violations.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not violations, "\n".join(violations)


TRAINING_WINGS = ("faults", "replicas", "inference")
"""training/'s sub-rooms: what wraps the loop's core (training/'s own files)."""
CORE_CALLS_WING = {"loop": "faults"}
"""The one arrow from the core into a wing: the loop hands a step's faults to faults/."""


def test_the_training_core_imports_no_wing():
    """training/'s own files never reach into replicas/ or inference/, which wrap them, nor
    into faults/ but from the loop; a wing imports no other wing."""
    violations = []
    training = PACKAGE / "training"
    for path in sorted(training.rglob("*.py")):
        parts = path.relative_to(training).with_suffix("").parts
        own_wing = parts[0] if len(parts) > 1 else None
        for name in _imports(path):
            target = name.split(".")
            if target[1] != "training" or len(target) < 3 or target[2] not in TRAINING_WINGS:
                continue
            wing = target[2]
            allowed = wing == own_wing or (
                own_wing is None and CORE_CALLS_WING.get(parts[0]) == wing
            )
            if not allowed:
                violations.append(f"training/{path.relative_to(training)} imports {name}")
    assert not violations, "\n".join(violations)


FACED_FOLDERS = ("data", "model", "interop", "training")
"""The folders whose sub-folders (wings) are entered through their faces."""


def _wings() -> list[tuple[str, ...]]:
    """Every sub-folder with an ``__init__`` of a folder in FACED_FOLDERS, as dotted parts."""
    return [
        ("kempnerforge", folder, init.parent.name)
        for folder in FACED_FOLDERS
        for init in sorted((PACKAGE / folder).glob("*/__init__.py"))
    ]


def test_a_wing_is_entered_through_its_face():
    """A module outside a wing imports the names its ``__init__`` exports, never the wing's
    own modules: a wing's modules can be split or renamed without touching its callers."""
    wings = _wings()
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("kempnerforge", *path.relative_to(PACKAGE).with_suffix("").parts)
        for name in _imports(path):
            target = tuple(name.split("."))
            for wing in wings:
                inside_own = parts[: len(wing)] == wing
                if target[: len(wing)] == wing and len(target) > len(wing) and not inside_own:
                    violations.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not violations, "\n".join(violations)


def test_each_wing_has_a_face_that_says_what_it_holds():
    for wing in _wings():
        init = PACKAGE.joinpath(*wing[1:], "__init__.py")
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init} has no docstring"


MAX_MODULE_LINES = 450
"""The house guideline is about 400 lines per module; past this a module is split by
responsibility (the house style), not allowed to drift."""


def _oversized(root: pathlib.Path, limit: int) -> list[str]:
    """'path: N lines' for every .py file under ``root`` longer than ``limit`` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > limit:
            found.append(f"{path.relative_to(root)}: {lines} lines")
    return found


def test_no_module_exceeds_the_size_limit():
    offenders = _oversized(PACKAGE, MAX_MODULE_LINES)
    assert not offenders, (
        f"modules over {MAX_MODULE_LINES} lines; split each by responsibility:\n"
        + "\n".join(offenders)
    )


def test_the_size_check_names_each_module_over_the_limit(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "long.py").write_text("x = 1\n" * 451)
    (tmp_path / "pkg" / "at_limit.py").write_text("x = 1\n" * 450)
    (tmp_path / "notes.txt").write_text("x\n" * 1000)
    assert _oversized(tmp_path, 450) == ["pkg/long.py: 451 lines"]


def test_the_bottom_floor_imports_nothing_from_the_package():
    for path in sorted((PACKAGE / "core").glob("*.py")):
        assert _imports(path) == [], path.name


def _params(fn) -> list[tuple[str, str, object]]:
    return [
        (p.name, p.kind.name, p.default if p.default is not p.empty else "<required>")
        for p in inspect.signature(fn).parameters.values()
    ]


def test_loop_functions_match_the_spec_signatures():
    required = "<required>"
    session_step = [
        ("session", "POSITIONAL_OR_KEYWORD", required),
        ("step", "POSITIONAL_OR_KEYWORD", required),
    ]
    assert _params(loop.run_training_loop) == [
        ("session", "POSITIONAL_OR_KEYWORD", required),
        ("step", "KEYWORD_ONLY", 0),
        ("tokens_seen", "KEYWORD_ONLY", 0),
    ]
    for fn in (loop.text_step, loop.vlm_step, loop.pipeline_step):
        assert _params(fn) == session_step
    assert _params(loop.select_step_fn) == [("config", "POSITIONAL_OR_KEYWORD", required)]
    assert [p[0] for p in _params(loop.clip_grads)] == ["model", "max_norm"]
    assert [p[0] for p in _params(loop.add_moe_losses)] == ["loss", "model", "mc"]
    assert [p[0] for p in _params(loop.checkpoint_extra)] == ["config", "step", "phases"]
    assert inspect.signature(loop.clip_grads).return_annotation in (float, "float")
    assert inspect.signature(loop.run_training_loop).return_annotation in (
        tuple[int, int],
        "tuple[int, int]",
    )


def _fields(cls) -> list[tuple[str, object]]:
    out = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out.append((f.name, f.default))
        elif f.default_factory is not dataclasses.MISSING:
            out.append((f.name, f.default_factory()))
        else:
            out.append((f.name, "<required>"))
    return out


def test_step_result_fields_and_defaults():
    r = "<required>"
    assert _fields(loop.StepResult) == [
        ("loss", r),
        ("grad_norm", r),
        ("text_tokens", None),
        ("dataset_token_counts", {}),
        ("dataset_loss_sums", {}),
        ("dataset_loss_counts", {}),
    ]


def test_training_session_fields_in_spec_order():
    names = [f.name for f in dataclasses.fields(loop.TrainingSession)]
    assert names == [
        "config", "runtime", "model", "optimizer", "scheduler", "loss_fn", "step_fn", "data",
        "phases", "checkpointer", "tracker", "hooks", "nan_detector", "shutdown_handler",
        "pipeline", "eval_dataloader", "profiler",
    ]  # fmt: skip
    defaults = {f.name: f.default for f in dataclasses.fields(loop.TrainingSession)}
    assert defaults["pipeline"] is None
    assert defaults["eval_dataloader"] is None
    assert defaults["profiler"] is None
    assert isinstance(inspect.getattr_static(loop.TrainingSession, "batches"), property)


def test_batch_stream_api():
    for name in ("dataloader", "has_data"):
        assert isinstance(inspect.getattr_static(loop.BatchStream, name), property)
    for name in ("ensure_started", "reset", "next_batch"):
        assert callable(getattr(loop.BatchStream, name))
    assert _params(loop.BatchStream.__init__)[1][0] == "pipeline"
