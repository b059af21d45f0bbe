"""Contract tests: the model family and pipeline parallelism are each decided in one place
(training/families/registry.py's family_of, by the config section a family registered;
training/layout.py's layout_of); the rest of training/ asks the chosen value instead of
branching on the model type or distributed.pp."""

from __future__ import annotations

import pathlib
import re

import kempnerforge

PACKAGE = pathlib.Path(kempnerforge.__file__).parent

SCANNED = ("training", "commands")
"""The folders whose code may branch on the family or on pipelining only at a seam."""

MAX_SEAM_LINES = 4

_TESTS = r"(is_vlm|is_moe|\.vlm is (not )?None|\.pp\s*[>=!]|pipeline is (not )?None|pp_size\s*>)"
_BRANCH = re.compile(rf"^\s*(if|elif)\b.*({_TESTS}|VisionLanguageModel\))")
_TERNARY = re.compile(rf"\bif\b.*{_TESTS}.*\belse\b")


def _code_lines(folder: str) -> list[tuple[str, int, str]]:
    lines = []
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip().startswith("#"):
                lines.append((str(path.relative_to(PACKAGE)), number, line.strip()))
    return lines


def _family_branches(folders: tuple[str, ...]) -> list[str]:
    return [
        f"{path}:{number}: {line}"
        for folder in folders
        for path, number, line in _code_lines(folder)
        if _BRANCH.search(line) or _TERNARY.search(line)
    ]


def test_family_and_pipeline_are_branched_on_only_at_their_seams():
    found = _family_branches(SCANNED)
    assert len(found) <= MAX_SEAM_LINES, (
        f"{len(found)} lines branch on the model family or on pipeline parallelism (at most "
        f"{MAX_SEAM_LINES}); ask family_of(config) or layout_of(config.distributed) instead:\n"
        + "\n".join(found)
    )


def test_the_seams_are_family_of_and_layout_of():
    # family_of picks by registered section, so it names no family: layout_of is the one
    # line in training/ that branches.
    found = _family_branches(("training",))
    assert [line.split(":")[0] for line in found] == ["training/layout.py"]


def test_the_pattern_finds_the_branches_it_is_meant_to():
    caught = [
        "if config.is_vlm:",
        "elif mc.is_moe:",
        "return vlm_step if config.is_vlm else text_step",
        "if config.distributed.pp > 1:",
        "if dc.pp == 1:",
        "if session.pipeline is not None:",
        "if isinstance(model, VisionLanguageModel):",
        "if config.vlm is None:",
    ]
    missed = [
        "return layout_of(config.distributed).step or family_of(config).step",
        "assert x.vlm is not None",
    ]
    assert all(_BRANCH.search(s) or _TERNARY.search(s) for s in caught)
    assert not any(_BRANCH.search(s) or _TERNARY.search(s) for s in missed)


def test_training_never_asks_whether_the_model_is_moe():
    asking = [
        f"{path}:{number}: {line}"
        for path, number, line in _code_lines("training")
        if re.search(r"\bis_moe\b", line)
    ]
    assert not asking, (
        "model/moe/router_step.py's router functions do nothing for dense models:\n"
        + "\n".join(asking)
    )
