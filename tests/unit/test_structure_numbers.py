"""The package's structure numbers, held where the last restructuring left them: each test
fails when a number grows past its bound, naming what grew, so a change that needs more
says so in review instead of drifting.

- training/ takes config sections, not whole configs: parameters typed JobConfig.
- the loop's helpers take what they use: parameters typed TrainingSession.
- functions fit on a screen: none over MAX_FUNCTION_LINES.
- training/'s rooms stack in at most TRAINING_FLOORS floors of imports.
- distributed/ asks a model only through the FamilyModel contract: no getattr/hasattr
  probes of public attributes.
- a folder's leaves live in wings: at most so many modules at a folder's root.
"""

from __future__ import annotations

import ast
import functools
import pathlib

import kempnerforge

PACKAGE = pathlib.Path(kempnerforge.__file__).parent

JOB_CONFIG_PARAMETERS_AT_MOST = 30
SESSION_PARAMETERS_AT_MOST = 36
MAX_FUNCTION_LINES = 80
TRAINING_FLOORS_AT_MOST = 9
ROOT_MODULES_AT_MOST = {"data": 12, "model": 12, "training": 23}
"""Modules at a folder's root (its __init__ included); past this, leaves go into wings."""


def _functions(root: pathlib.Path):
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield path, node


def typed_parameters(root: pathlib.Path, type_name: str) -> list[str]:
    """'file:function' once per parameter annotated ``type_name`` under ``root``."""
    found = []
    for path, fn in _functions(root):
        arguments = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
        for arg in arguments:
            if arg.annotation is not None and ast.unparse(arg.annotation).strip("'\"") == type_name:
                found.append(f"{path.relative_to(root)}:{fn.name}")
    return found


def long_functions(root: pathlib.Path, limit: int) -> list[str]:
    """'file:function: N lines' for every function longer than ``limit`` lines."""
    return [
        f"{path.relative_to(root)}:{fn.name}: {(fn.end_lineno or fn.lineno) - fn.lineno + 1} lines"
        for path, fn in _functions(root)
        if (fn.end_lineno or fn.lineno) - fn.lineno + 1 > limit
    ]


def floors(folder: pathlib.Path, package: str) -> int:
    """The longest chain of imports between ``folder``'s rooms (a module at its root, or a
    sub-folder as one room): 1 for rooms that import no other room."""
    imports: dict[str, set[str]] = {}
    for path in folder.rglob("*.py"):
        room = path.relative_to(folder).with_suffix("").parts[0]
        if room == "__init__":
            continue
        edges = imports.setdefault(room, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(package + "."):
                target = node.module.removeprefix(package + ".").split(".")[0]  # type: ignore[union-attr]
                if target != room:
                    edges.add(target)

    @functools.cache
    def level(room: str) -> int:
        return 1 + max((level(t) for t in imports.get(room, ()) if t in imports), default=0)

    return max((level(room) for room in imports), default=0)


def contract_probes(root: pathlib.Path) -> list[str]:
    """getattr/hasattr calls naming a public attribute: asking a model what it is instead of
    typing it against the FamilyModel contract (FSDP's own private state is not a probe)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id not in ("getattr", "hasattr") or len(node.args) < 2:
                continue
            name = node.args[1]
            if isinstance(name, ast.Constant) and str(name.value).startswith("_"):
                continue
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_training_takes_sections_not_whole_configs():
    found = typed_parameters(PACKAGE / "training", "JobConfig")
    assert len(found) <= JOB_CONFIG_PARAMETERS_AT_MOST, (
        f"{len(found)} parameters typed JobConfig in training/ (at most "
        f"{JOB_CONFIG_PARAMETERS_AT_MOST}); pass the sections a function reads:\n"
        + "\n".join(found)
    )


def test_helpers_take_what_they_use_not_the_session():
    found = typed_parameters(PACKAGE / "training", "TrainingSession")
    assert len(found) <= SESSION_PARAMETERS_AT_MOST, (
        f"{len(found)} parameters typed TrainingSession in training/ (at most "
        f"{SESSION_PARAMETERS_AT_MOST}):\n" + "\n".join(found)
    )


def test_no_function_is_longer_than_a_screen():
    found = long_functions(PACKAGE, MAX_FUNCTION_LINES)
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(found)


def test_training_stacks_in_few_floors():
    assert floors(PACKAGE / "training", "kempnerforge.training") <= TRAINING_FLOORS_AT_MOST


def test_distributed_never_probes_a_model():
    found = contract_probes(PACKAGE / "distributed")
    assert not found, "type against model/contract.py instead:\n" + "\n".join(found)


def test_folders_keep_their_leaves_in_wings():
    for folder, limit in ROOT_MODULES_AT_MOST.items():
        modules = sorted(p.name for p in (PACKAGE / folder).glob("*.py"))
        assert len(modules) <= limit, f"{folder}/ holds {len(modules)} modules: {modules}"


def test_the_counters_find_what_they_count(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "wing").mkdir(parents=True)
    (pkg / "a.py").write_text(
        "def f(config: JobConfig, s: 'TrainingSession') -> None:\n"
        "    getattr(model, 'layers', None)\n    getattr(state, '_private')\n" + "    x = 1\n" * 80
    )
    (pkg / "b.py").write_text("from pkg.a import f\n")
    (pkg / "wing" / "c.py").write_text("from pkg.b import f\n")
    assert typed_parameters(pkg, "JobConfig") == ["a.py:f"]
    assert typed_parameters(pkg, "TrainingSession") == ["a.py:f"]
    assert long_functions(pkg, 80) == ["a.py:f: 83 lines"]
    assert floors(pkg, "pkg") == 3  # wing -> b -> a
    assert contract_probes(pkg) == ["a.py:2: getattr(model, 'layers', None)"]
