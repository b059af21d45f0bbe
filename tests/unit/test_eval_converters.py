"""Converters from public sets' released files to evaluation task files: the exact examples
each writes, their one-line errors naming file and line, and `kempnerforge convert-task`."""

from __future__ import annotations

import json
import re

import pytest

from kempnerforge.cli import main
from kempnerforge.evaluation.converters import (
    CONVERTERS,
    ConvertError,
    clean_hellaswag_text,
    convert_arc,
    convert_hellaswag,
    convert_mmlu,
    convert_piqa,
)
from kempnerforge.resilience.exit_codes import CONFIG_ERROR
from tests.support.cli import run_kempnerforge


def _starts(text: str) -> str:
    """A pattern for pytest.raises(match=...) that matches messages starting with ``text``."""
    return "^" + re.escape(text)


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


# HellaSwag: lines as hellaswag_val.jsonl has them (made-up text).

ACTIVITYNET_LINE = {
    "ind": 14,
    "activity_label": "Washing dishes",
    "ctx_a": "A woman stands at a kitchen sink.",
    "ctx_b": "then the Woman",
    "ctx": "A woman stands at a kitchen sink. then the Woman",
    "endings": [
        "rinses a plate under the tap.",
        "sings to the plate.",
        "puts the sink in the cupboard.",
        "dries the window with a fork.",
    ],
    "label": 0,
    "split": "val",
    "split_type": "indomain",
    "source_id": "activitynet~v_made_up",
}
WIKIHOW_LINE = {
    "ind": 27,
    "activity_label": "Home and Garden",
    "ctx_a": "[header] How to water a fern [title] Check the soil.",
    "ctx_b": "",
    "ctx": "[header] How to water a fern [title] Check the soil.",
    "endings": [
        "Wait a day [title] Water when it feels dry.",
        "Use cold water [substeps] Tap water is fine.",
        "Paint the pot blue.",
        "Sing to the fern.",
    ],
    "label": 1,
    "split": "val",
    "split_type": "zeroshot",
    "source_id": "wikihow~42",
}


def test_hellaswag_joins_label_and_context_and_cleans_the_wikihow_tags(tmp_path):
    path = _jsonl(tmp_path / "hellaswag_val.jsonl", [ACTIVITYNET_LINE, WIKIHOW_LINE])
    assert convert_hellaswag([path]) == [
        {
            # ctx_b capitalised as str.capitalize does: the rest lowercased too.
            "context": "Washing dishes: A woman stands at a kitchen sink. Then the woman",
            "choices": [
                " rinses a plate under the tap.",
                " sings to the plate.",
                " puts the sink in the cupboard.",
                " dries the window with a fork.",
            ],
            "gold": 0,
            "id": "14",
        },
        {
            "context": "Home and Garden: How to water a fern. Check the soil.",
            "choices": [
                " Wait a day. Water when it feels dry.",
                " Use cold water Tap water is fine.",
                " Paint the pot blue.",
                " Sing to the fern.",
            ],
            "gold": 1,
            "id": "27",
        },
    ]


def test_hellaswag_cleanup_collapses_double_spaces_in_one_pass_as_the_harnesses_do():
    assert clean_hellaswag_text("  a [title] b [step] c  ") == "a. b c"
    assert clean_hellaswag_text("a   b") == "a  b"


def test_hellaswag_test_split_is_refused_naming_the_line_and_the_validation_file(tmp_path):
    unlabelled = {k: v for k, v in ACTIVITYNET_LINE.items() if k != "label"} | {"split": "test"}
    path = _jsonl(tmp_path / "hellaswag_test.jsonl", [unlabelled])
    with pytest.raises(ConvertError) as error:
        convert_hellaswag([path])
    assert str(error.value) == (
        f"{path}, line 1: no label (HellaSwag's test split is unlabelled); convert the "
        "validation file, hellaswag_val.jsonl, instead"
    )


def test_a_line_that_is_not_json_is_refused_naming_file_and_line(tmp_path):
    path = tmp_path / "hellaswag_val.jsonl"
    path.write_text(json.dumps(ACTIVITYNET_LINE) + "\n\n{not json\n", encoding="utf-8")
    with pytest.raises(ConvertError, match=_starts(f"{path}, line 3: not JSON ")):
        convert_hellaswag([str(path)])


# ARC: lines as ARC-Challenge-Test.jsonl has them, one with digit labels.

ARC_LETTERS = {
    "id": "Made_Up_1",
    "question": {
        "stem": "Water freezes at which temperature (°C)?",
        "choices": [
            {"text": "0", "label": "A"},
            {"text": "50", "label": "B"},
            {"text": "100", "label": "C"},
        ],
    },
    "answerKey": "A",
}
ARC_DIGITS = {
    "id": "Made_Up_2",
    "question": {
        "stem": "How many legs does an insect have?",
        "choices": [
            {"text": "four", "label": "1"},
            {"text": "six", "label": "2"},
            {"text": "eight", "label": "3"},
            {"text": "ten", "label": "4"},
        ],
    },
    "answerKey": "2",
}
ARC_EXAMPLES = [
    {
        "context": "Question: Water freezes at which temperature (°C)?\nAnswer:",
        "choices": [" 0", " 50", " 100"],
        "gold": 0,
        "id": "Made_Up_1",
    },
    {
        "context": "Question: How many legs does an insect have?\nAnswer:",
        "choices": [" four", " six", " eight", " ten"],
        "gold": 1,
        "id": "Made_Up_2",
    },
]


def test_arc_takes_the_gold_from_letter_and_digit_labels(tmp_path):
    path = _jsonl(tmp_path / "ARC-Challenge-Test.jsonl", [ARC_LETTERS, ARC_DIGITS])
    assert convert_arc([path]) == ARC_EXAMPLES


def test_arc_answer_key_not_among_the_labels_is_refused_naming_file_and_line(tmp_path):
    path = _jsonl(tmp_path / "ARC-Easy-Test.jsonl", [ARC_LETTERS, ARC_DIGITS | {"answerKey": "E"}])
    with pytest.raises(ConvertError) as error:
        convert_arc([path])
    assert str(error.value) == (
        f"{path}, line 2: answerKey 'E' is not among the choice labels 1, 2, 3, 4; fix the "
        "line or leave it out"
    )


def test_arc_missing_field_is_refused_naming_its_path_in_the_line(tmp_path):
    broken = {"id": "x", "question": {"stem": "?", "choices": [{"label": "A"}]}, "answerKey": "A"}
    path = _jsonl(tmp_path / "arc.jsonl", [broken])
    with pytest.raises(ConvertError) as error:
        convert_arc([path])
    assert str(error.value) == (
        f"{path}, line 1: no 'question.choices[0].text' field; is this the set's file as released?"
    )


# PIQA: valid.jsonl and valid-labels.lst.

PIQA_LINES = [
    {"goal": "Keep bread fresh", "sol1": "Seal it in a bag.", "sol2": "Leave it in the sun."},
    {"goal": "Cool a hot pan", "sol1": "Put it in the oven.", "sol2": "Let it rest on the hob."},
]


def test_piqa_pairs_each_line_with_its_label(tmp_path):
    valid = _jsonl(tmp_path / "valid.jsonl", PIQA_LINES)
    (tmp_path / "valid-labels.lst").write_text("0\n1\n")
    assert convert_piqa(valid, tmp_path / "valid-labels.lst") == [
        {
            "context": "Question: Keep bread fresh\nAnswer:",
            "choices": [" Seal it in a bag.", " Leave it in the sun."],
            "gold": 0,
        },
        {
            "context": "Question: Cool a hot pan\nAnswer:",
            "choices": [" Put it in the oven.", " Let it rest on the hob."],
            "gold": 1,
        },
    ]


def test_piqa_labels_file_of_another_length_is_refused_naming_the_first_unpaired_line(tmp_path):
    valid = _jsonl(tmp_path / "valid.jsonl", [*PIQA_LINES, PIQA_LINES[0]])
    labels = tmp_path / "valid-labels.lst"
    labels.write_text("0\n1\n")
    with pytest.raises(ConvertError) as error:
        convert_piqa(valid, labels)
    assert str(error.value) == (
        f"{labels} has 2 labels but {valid} has 3 examples ({valid}, line 3 has no label); "
        "give the labels file of the same split (valid-labels.lst for valid.jsonl)"
    )
    labels.write_text("0\n1\n1\n0\n")
    with pytest.raises(ConvertError, match=re.escape(f"{labels}, line 4 has no example")):
        convert_piqa(valid, labels)


def test_piqa_label_other_than_0_or_1_is_refused_naming_its_line(tmp_path):
    valid = _jsonl(tmp_path / "valid.jsonl", PIQA_LINES)
    labels = tmp_path / "valid-labels.lst"
    labels.write_text("0\n2\n")
    with pytest.raises(ConvertError, match=_starts(f"{labels}, line 2: '2' is not a label")):
        convert_piqa(valid, labels)


# MMLU: data/test/SUBJECT_test.csv, no header, quoted fields with commas and line breaks.

MMLU_LEAD = "The following are multiple choice questions (with answers) about "


def _mmlu_folder(tmp_path):
    folder = tmp_path / "data" / "test"
    folder.mkdir(parents=True)
    (folder / "high_school_physics_test.csv").write_text(
        '"A ball, dropped from rest, falls for 2 s. Roughly how far does it fall?",'
        "5 m,10 m,20 m,40 m,C\n"
        '"Which quantity is a vector?\nPick one.",speed,mass,velocity,"energy, kinetic",C\n',
        encoding="utf-8",
    )
    (folder / "astronomy_test.csv").write_text(
        "Which planet is closest to the Sun?,Venus,Mercury,Earth,Mars,B\n", encoding="utf-8"
    )
    return folder


def test_mmlu_reads_a_folder_sorted_with_quoted_commas_and_line_breaks(tmp_path):
    """Each row its question and options as the context, its subject's header as the
    description (the prompt zero-shot: description + context) and its subject."""
    letters = [" A", " B", " C", " D"]
    astronomy = {"subject": "astronomy", "description": f"{MMLU_LEAD}astronomy.\n\n"}
    physics = {
        "subject": "high_school_physics",
        "description": f"{MMLU_LEAD}high school physics.\n\n",
    }
    assert convert_mmlu([_mmlu_folder(tmp_path)]) == [
        {
            "context": "Which planet is closest to the Sun?\n"
            "A. Venus\nB. Mercury\nC. Earth\nD. Mars\nAnswer:",
            "choices": letters,
            "gold": 1,
            "id": "astronomy/1",
            **astronomy,
        },
        {
            "context": "A ball, dropped from rest, falls for 2 s. Roughly how far does it fall?"
            "\nA. 5 m\nB. 10 m\nC. 20 m\nD. 40 m\nAnswer:",
            "choices": letters,
            "gold": 2,
            "id": "high_school_physics/1",
            **physics,
        },
        {
            "context": "Which quantity is a vector?\n"
            "Pick one.\nA. speed\nB. mass\nC. velocity\nD. energy, kinetic\nAnswer:",
            "choices": letters,
            "gold": 2,
            "id": "high_school_physics/2",
            **physics,
        },
    ]


def test_mmlu_bad_rows_and_names_are_refused_naming_file_and_row(tmp_path):
    path = tmp_path / "anatomy_dev.csv"
    path.write_text("Q?,a,b,c,d,A\nQ?,a,b,c,d,E\n", encoding="utf-8")
    with pytest.raises(ConvertError) as error:
        convert_mmlu([path])
    assert str(error.value) == (
        f"{path}, row 2: answer 'E' is not one of A, B, C, D; fix the row or leave it out"
    )
    path.write_text("Q?,a,b,c,A\n", encoding="utf-8")
    with pytest.raises(ConvertError, match=_starts(f"{path}, row 1: 5 columns, expected 6")):
        convert_mmlu([path])
    renamed = tmp_path / "anatomy.csv"
    renamed.write_text("Q?,a,b,c,d,A\n", encoding="utf-8")
    with pytest.raises(ConvertError, match=_starts(f"{renamed}: cannot tell the subject")):
        convert_mmlu([renamed])


def test_a_missing_file_is_a_convert_error_naming_it(tmp_path):
    for name, missing in [
        ("hellaswag", tmp_path / "hellaswag_val.jsonl"),
        ("arc", tmp_path / "ARC-Easy-Test.jsonl"),
        ("mmlu", tmp_path / "anatomy_test.csv"),
    ]:
        with pytest.raises(ConvertError) as error:
            CONVERTERS[name]([missing])
        assert str(error.value) == f"{missing}: no such file; give the path of the set's file"


# The command line.


def test_convert_task_writes_the_task_file_end_to_end(tmp_path):
    source = _jsonl(tmp_path / "ARC-Challenge-Test.jsonl", [ARC_LETTERS, ARC_DIGITS])
    output = tmp_path / "tasks" / "arc.jsonl"
    done = run_kempnerforge("convert-task", "arc", source, "--output", str(output))
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"wrote 2 arc examples to {output}\n"
    text = output.read_text(encoding="utf-8")
    assert "(°C)" in text  # written as UTF-8, not escaped
    assert [json.loads(line) for line in text.splitlines()] == ARC_EXAMPLES


def test_convert_task_bad_file_exits_with_the_user_error_code_in_one_line(tmp_path):
    source = _jsonl(tmp_path / "arc.jsonl", [ARC_DIGITS | {"answerKey": "E"}])
    output = tmp_path / "arc-task.jsonl"
    done = run_kempnerforge("convert-task", "arc", source, "--output", str(output))
    assert done.returncode == CONFIG_ERROR
    assert done.stderr.splitlines() == [
        f"kempnerforge: error: {source}, line 1: answerKey 'E' is not among the choice labels "
        "1, 2, 3, 4; fix the line or leave it out"
    ]
    assert not output.exists()


def test_convert_task_labels_is_required_for_piqa_and_refused_for_the_others(tmp_path, capsys):
    valid = _jsonl(tmp_path / "valid.jsonl", PIQA_LINES)
    (tmp_path / "valid-labels.lst").write_text("0\n1\n")
    output = str(tmp_path / "piqa.jsonl")
    assert main(["convert-task", "piqa", valid, "--output", output]) == CONFIG_ERROR
    assert "convert-task piqa needs --labels LABELS" in capsys.readouterr().err
    labels = str(tmp_path / "valid-labels.lst")
    arc = ["convert-task", "arc", valid, "--output", output, "--labels", labels]
    assert main(arc) == CONFIG_ERROR
    assert "--labels is for piqa only" in capsys.readouterr().err
    assert main(["convert-task", "piqa", valid, "--output", output, "--labels", labels]) == 0
    assert capsys.readouterr().out == f"wrote 2 piqa examples to {output}\n"
