"""`kempnerforge convert-task`: convert a public multiple-choice set, from the files its
authors release, into an evaluation task file (kempnerforge.evaluation.converters).

Nothing is downloaded; the user names the files they have. A file that cannot be converted
is a ConvertError (a DataError): one line naming the file and line, and exit code 2.
"""

from __future__ import annotations

import argparse

from kempnerforge.evaluation.converters import CONVERTERS

SET_WITH_LABELS_FILE = "piqa"
"""The one set whose answers come in a file of their own (--labels)."""


def add_convert_task_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `kempnerforge convert-task`."""
    parser.add_argument(
        "set_name",
        metavar="SET",
        choices=sorted(CONVERTERS),
        help=f"the public set the files come from: {', '.join(sorted(CONVERTERS))}",
    )
    parser.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="the set's files as released (hellaswag_val.jsonl, ARC-Challenge-Test.jsonl, "
        "valid.jsonl, abstract_algebra_test.csv ...); for mmlu also folders of .csv files",
    )
    parser.add_argument(
        "--output", required=True, metavar="OUT.jsonl", help="the task file to write"
    )
    parser.add_argument(
        "--labels",
        default=None,
        metavar="LABELS",
        help="piqa only (and required there): its labels file, valid-labels.lst",
    )


def run_convert_task(args: argparse.Namespace, overrides: list[str]) -> int:
    """Run `kempnerforge convert-task`; ConvertError (a DataError) propagates to the CLI,
    which takes no overrides for this command (cli.py refuses them)."""
    from kempnerforge.core.errors import DataError
    from kempnerforge.evaluation.converters import convert_piqa, write_examples

    if args.set_name == SET_WITH_LABELS_FILE:
        if args.labels is None:
            raise DataError(
                "convert-task piqa needs --labels LABELS: PIQA keeps its answers in a file of "
                "their own (valid-labels.lst beside valid.jsonl)"
            )
        if len(args.inputs) != 1:
            raise DataError(
                f"convert-task piqa takes one INPUT with its --labels file, got "
                f"{len(args.inputs)}; convert each split on its own"
            )
        examples = convert_piqa(args.inputs[0], args.labels)
    else:
        if args.labels is not None:
            raise DataError(
                f"--labels is for piqa only: {args.set_name}'s files carry their answers; "
                "leave --labels out"
            )
        examples = CONVERTERS[args.set_name](args.inputs)
    write_examples(examples, args.output)
    print(f"wrote {len(examples):,} {args.set_name} examples to {args.output}")
    return 0
