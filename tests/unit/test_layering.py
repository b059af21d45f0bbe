"""Contract tests: imports point down the package layers; loop.py matches its spec."""

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
    "optim": 2,
    "distributed": 3,
    "checkpoint": 4,
    "metrics": 4,
    "resilience": 4,
    "launch": 4,
    "training": 5,
    "interop": 5,
    "commands": 6,
    "cli": 7,
    "__main__": 8,
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
