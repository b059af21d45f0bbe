"""The command-line arguments of `kempnerforge prepare-data`.

Apart from prepare.py so that building the CLI's parser (for `--help`) imports neither
numpy nor a tokenizer.
"""

from __future__ import annotations

import argparse

from kempnerforge.data.sources import SUPPORTED


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value!r}")
    return number


def add_prepare_data_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `kempnerforge prepare-data`."""
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="FILE_OR_DIR",
        help=f"{SUPPORTED}, or directories searched recursively",
    )
    parser.add_argument("--output", required=True, metavar="DIR", help="prepared directory")
    parser.add_argument(
        "--tokenizer", default="byte", help="'byte' (default) or the path of a tokenizer.json"
    )
    parser.add_argument(
        "--text-field",
        default="text",
        help="jsonl field / parquet or dataset column holding the document text",
    )
    parser.add_argument(
        "--text-suffix",
        action="append",
        default=[],
        metavar="SUFFIX",
        help="also read files ending in SUFFIX (e.g. .py, .md; repeatable) as one document "
        "each, like .txt",
    )
    parser.add_argument(
        "--skip-non-utf8",
        action="store_true",
        help="leave out whole-file documents that are not UTF-8 (with a warning) instead of "
        "stopping",
    )
    parser.add_argument(
        "--split",
        default=None,
        help="split of a saved Hugging Face DatasetDict (default: train)",
    )
    parser.add_argument(
        "--workers",
        type=_positive_int,
        default=1,
        metavar="N",
        help="tokenizer processes (default 1); the output is the same for every N",
    )
    parser.add_argument(
        "--bos",
        action="store_true",
        help="start every document with the tokenizer's BOS token (default: EOS only between "
        "documents); needs a tokenizer whose BOS is not its EOS",
    )
    parser.add_argument(
        "--eval-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="fraction of documents held out into --eval-output (default 0: none)",
    )
    parser.add_argument("--eval-output", default=None, metavar="DIR", help="held-out directory")
    parser.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
