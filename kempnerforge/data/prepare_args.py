"""The command-line arguments of `kempnerforge prepare-data`.

Apart from prepare.py so that building the CLI's parser (for `--help`) imports neither
numpy nor a tokenizer.
"""

from __future__ import annotations

import argparse

from kempnerforge.data.sources import SUPPORTED


def _int_at_least(value: str, least: int) -> int:
    try:
        number = int(value)
    except ValueError:
        number = least - 1
    if number < least:
        raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {value!r}")
    return number


def _positive_int(value: str) -> int:
    return _int_at_least(value, 1)


def _non_negative_int(value: str) -> int:
    return _int_at_least(value, 0)


def add_prepare_data_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `kempnerforge prepare-data`."""
    # --input and --output are required unless --record-max-id is given (run_prepare_data).
    parser.add_argument(
        "--input",
        nargs="+",
        metavar="FILE_OR_DIR",
        help=f"{SUPPORTED}, or directories searched recursively (required)",
    )
    parser.add_argument("--output", metavar="DIR", help="prepared directory (required)")
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
    parser.add_argument(
        "--shard-index",
        type=_non_negative_int,
        default=None,
        metavar="I",
        help="write only shard I of --num-shards N: the I-th contiguous block of the input "
        "files, into DIR/shard-I-of-N of --output (and --eval-output)",
    )
    parser.add_argument(
        "--num-shards",
        type=_positive_int,
        default=None,
        metavar="N",
        help="the number of shards of the corpus (with --shard-index); shards 0..N-1 together "
        "hold what one unsharded run writes",
    )
    parser.add_argument(
        "--record-max-id",
        nargs="+",
        default=None,
        metavar="DIR",
        help="instead of preparing: scan each prepared DIR (each shard of a sharded one) once "
        "and record its largest token id in its meta.json, for directories prepared by an "
        "older version",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
