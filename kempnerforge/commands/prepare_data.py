"""`kempnerforge prepare-data`: tokenize text (or, with --format chat, conversations and their
loss masks) into a prepared directory, or record the largest token id of directories prepared
before.

Building the parser (for `--help`) imports neither numpy nor a tokenizer: those come with
the run.
"""

from __future__ import annotations

import argparse
from typing import Any

from kempnerforge.data.prepare import INPUT_FORMATS, SUPPORTED


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
    """Arguments of `kempnerforge prepare-data`, by topic in the order `--help` lists them."""
    _add_input_output_arguments(parser)
    _add_reading_arguments(parser)
    _add_tokenizing_arguments(parser)
    _add_held_out_arguments(parser)
    _add_shard_arguments(parser)
    _add_record_and_progress_arguments(parser)


def _add_input_output_arguments(parser: argparse.ArgumentParser) -> None:
    """What is read and the directory it is prepared into."""
    # --input and --output are required unless --record-max-id is given (run_prepare_data).
    parser.add_argument(
        "--input",
        nargs="+",
        metavar="FILE_OR_DIR",
        help=f"{SUPPORTED}, or directories searched recursively (required)",
    )
    parser.add_argument("--output", metavar="DIR", help="prepared directory (required)")


def _add_reading_arguments(parser: argparse.ArgumentParser) -> None:
    """The tokenizer, and how input files and datasets are read as documents."""
    parser.add_argument(
        "--tokenizer", default="byte", help="'byte' (default) or the path of a tokenizer.json"
    )
    parser.add_argument(
        "--format",
        choices=tuple(INPUT_FORMATS),
        default="text",
        help="; ".join(f"'{f.name}': {f.about}" for f in INPUT_FORMATS.values())
        + " (default 'text')",
    )
    parser.add_argument(
        "--seq-len",
        type=_positive_int,
        default=None,
        metavar="N",
        help="with --format chat (required there): pack whole conversations into windows of "
        "N tokens, the training job's train.seq_len, so none crosses a window boundary; with "
        "--format preference (required there): each response's window; with --format "
        "prompts (required there): each prompt's window, its answer included",
    )
    parser.add_argument(
        "--long-conversations",
        choices=("cut", "drop"),
        default=None,
        help="with --format chat or preference: a conversation longer than --seq-len keeps "
        "its first N tokens ('cut', the default; dropped when that keeps no assistant token) "
        "or is left out ('drop'); both are counted (with --format prompts a row longer than "
        "--seq-len is always dropped: neither a prompt nor its answer is cut)",
    )
    parser.add_argument(
        "--stop-on-refused",
        action="store_true",
        help="with --format chat, preference or prompts: stop at the first conversation the "
        "chat template refuses (default: skip it, count it in meta.json and the summary "
        "line, and go on)",
    )
    parser.add_argument(
        "--text-field",
        default=None,
        help="jsonl field / parquet or dataset column holding the document text (default "
        "'text'), or with --format chat the messages (default 'messages')",
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


def _add_tokenizing_arguments(parser: argparse.ArgumentParser) -> None:
    """How documents are tokenized: worker processes and a leading BOS."""
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


def _add_held_out_arguments(parser: argparse.ArgumentParser) -> None:
    """The held-out split: its fraction of the documents and its directory."""
    parser.add_argument(
        "--eval-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="fraction of documents held out into --eval-output (default 0: none)",
    )
    parser.add_argument("--eval-output", default=None, metavar="DIR", help="held-out directory")


def _add_shard_arguments(parser: argparse.ArgumentParser) -> None:
    """Which shard of a corpus prepared by several processes this one writes."""
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


def _add_record_and_progress_arguments(parser: argparse.ArgumentParser) -> None:
    """The record-max-id mode (instead of preparing) and the progress line."""
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


def run_prepare_data(args: argparse.Namespace, overrides: list[str]) -> int:
    """Run `kempnerforge prepare-data`; DataError and ConfigError propagate to the CLI."""
    import sys

    from kempnerforge.data.prepare import check_format_options, prepare_data
    from kempnerforge.data.tokenizer import load_tokenizer
    from kempnerforge.storage.location import join

    _check_what_to_do(args, overrides)
    if args.record_max_id:
        return run_record_max_id(args.record_max_id)
    shard = _shard(args)
    tokenizer = load_tokenizer(args.tokenizer)  # a wrong path is named before any template
    input_format = check_format_options(args.format, vars(args))
    if input_format.name == "preference":
        return _prepare_preference(args, tokenizer, input_format)
    if input_format.name == "prompts":
        return _prepare_prompts(args, tokenizer, input_format)
    chat_template, packing = _chat_encoding(args) if input_format.name == "chat" else (None, None)
    meta = prepare_data(
        args.input,
        args.output,
        tokenizer,
        text_field=args.text_field,
        show_progress=not args.no_progress and sys.stderr.isatty(),
        eval_fraction=args.eval_fraction,
        eval_output_dir=args.eval_output,
        split=args.split,
        num_workers=args.workers,
        bos_per_document=args.bos,
        text_suffixes=tuple(args.text_suffix),
        skip_non_utf8=args.skip_non_utf8,
        shard=shard,
        chat_template=chat_template,
        packing=packing,
        stop_on_refused=args.stop_on_refused,
    )
    output = join(args.output, shard.name) if shard else args.output
    summary = (
        f"prepared {meta['num_tokens']:,} tokens in {meta['num_documents']:,} documents "
        f"({meta['dtype']}{', BOS per document' if args.bos else ''}) into {output}"
    )
    print(summary + input_format.summary(meta) + _held_out_clause(args, shard))
    return 0


def _prepare_preference(args: argparse.Namespace, tokenizer: Any, input_format: Any) -> int:
    """prepare-data --format preference: pairs into windows of --seq-len (one process, no
    held-out split, no shards)."""
    from kempnerforge.data.prepare import write_preference_corpus

    _refuse_split_options(args, "a preference set", "pairs")
    chat_template, packing = _chat_encoding(args)
    meta = write_preference_corpus(
        args.input,
        args.output,
        tokenizer,
        chat_template,
        packing.seq_len,
        long_conversations=packing.long_conversations,
        stop_on_refused=args.stop_on_refused,
    )
    _print_whole_summary(args, meta, input_format)
    return 0


def _prepare_prompts(args: argparse.Namespace, tokenizer: Any, input_format: Any) -> int:
    """prepare-data --format prompts: each prompt and its reference answer into a window of
    --seq-len (one process, no held-out split, no shards)."""
    from kempnerforge.data.prepare import write_prompts_corpus

    _refuse_split_options(args, "a prompt set", "prompts")
    chat_template, packing = _chat_encoding(args)
    meta = write_prompts_corpus(
        args.input,
        args.output,
        tokenizer,
        chat_template,
        packing.seq_len,
        stop_on_refused=args.stop_on_refused,
    )
    _print_whole_summary(args, meta, input_format)
    return 0


def _refuse_split_options(args: argparse.Namespace, what: str, rows: str) -> None:
    """Refuse the held-out, shard and BOS options for a format written whole by one
    process (``what``, e.g. "a preference set", of ``rows``)."""
    from kempnerforge.core.errors import DataError

    for given, option in ((args.eval_fraction > 0.0, "--eval-fraction"),
                          (args.shard_index is not None, "--shard-index"),
                          (args.bos, "--bos")):  # fmt: skip
        if given:
            raise DataError(
                f"{option} does not go with --format {args.format}: {what} is written "
                f"whole, by one process (prepare held-out {rows} as a directory of their own)"
            )


def _print_whole_summary(args: argparse.Namespace, meta: dict[str, Any], input_format: Any) -> None:
    """The summary line of a corpus written whole (no held-out split, no shards)."""
    print(
        f"prepared {meta['num_tokens']:,} tokens in {meta['num_documents']:,} documents "
        f"({meta['dtype']}) into {args.output}" + input_format.summary(meta)
    )


def _check_what_to_do(args: argparse.Namespace, overrides: list[str]) -> None:
    """Refuse arguments argparse took but no mode uses, and a launch with nothing to do."""
    from kempnerforge.core.errors import DataError

    if overrides:
        raise DataError(f"unrecognized arguments: {' '.join(overrides)}")
    if args.record_max_id:
        if args.input or args.output:
            raise DataError(
                "--record-max-id scans directories already prepared; it takes no --input or "
                "--output (run it on its own)"
            )
        return
    if not args.input or not args.output:
        raise DataError(
            "prepare-data needs --input FILE_OR_DIR ... and --output DIR (or --record-max-id "
            "DIR to record the largest id of a directory already prepared)"
        )
    if args.eval_output and args.eval_fraction <= 0.0:
        raise DataError(f"--eval-output {args.eval_output} needs --eval-fraction F > 0")


def _shard(args: argparse.Namespace) -> Any:
    """The Shard this process writes (--shard-index of --num-shards), or None."""
    from kempnerforge.core.errors import DataError
    from kempnerforge.data.tokens import Shard

    if args.shard_index is None and args.num_shards is None:
        return None
    if args.shard_index is None or args.num_shards is None:
        raise DataError(
            "--shard-index I and --num-shards N go together: this process writes shard I "
            "of N (0 <= I < N)"
        )
    return Shard(args.shard_index, args.num_shards)


def _chat_encoding(args: argparse.Namespace) -> tuple[Any, Any]:
    """(chat template, packing) of --format chat: the tokenizer's template, and windows of
    --seq-len, which it needs."""
    from kempnerforge.core.errors import DataError
    from kempnerforge.data.chat import Packing, load_chat_template

    if args.seq_len is None:
        raise DataError(
            f"--format {args.format} needs --seq-len N, the training job's train.seq_len: "
            "conversations are packed into windows of N tokens so that none crosses a "
            "window boundary"
        )
    return load_chat_template(args.tokenizer), Packing(
        args.seq_len, args.long_conversations or "cut"
    )


def _held_out_clause(args: argparse.Namespace, shard: Any) -> str:
    """The summary's clause on the held-out split, read back from its meta.json."""
    from kempnerforge.data.tokens import read_meta
    from kempnerforge.storage.location import join

    if args.eval_fraction <= 0.0:
        return ""
    eval_output = join(args.eval_output, shard.name) if shard else args.eval_output
    held_out = read_meta(eval_output)
    return (
        f"; held out {held_out['num_tokens']:,} tokens in "
        f"{held_out['num_documents']:,} documents into {eval_output}"
    )


def run_record_max_id(data_dirs: list[str]) -> int:
    """Scan each prepared directory (each shard of a sharded one) once and record its largest
    id in its meta.json, one line each; an id beyond meta.json's vocabulary is then reported
    as opening reports it (it is recorded all the same, so every opening refuses it at once).
    """
    from kempnerforge.data.tokens import check_token_ids, prepared_dirs, scan_and_record

    for data_dir in data_dirs:
        for part in prepared_dirs(data_dir):
            meta, top = scan_and_record(part)
            print(f"{part}: recorded max_token_id {top} ({meta['num_tokens']:,} tokens scanned)")
            check_token_ids(part, meta, None)
    return 0
