"""`kempnerforge prepare-data`: tokenize text (or, with --format chat, conversations and their
loss masks) into a prepared directory, or record the largest token id of directories prepared
before.

Building the parser (for `--help`) imports neither numpy nor a tokenizer: those come with
the run.
"""

from __future__ import annotations

import argparse

from kempnerforge.data.prepare import SUPPORTED


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
        choices=("text", "chat"),
        default="text",
        help="'text' (default): each input document is text; 'chat': each is a conversation "
        "(messages, or prompt and completion) rendered with the tokenizer's chat template, "
        "with a loss mask on the assistant's tokens",
    )
    parser.add_argument(
        "--seq-len",
        type=_positive_int,
        default=None,
        metavar="N",
        help="with --format chat (required there): pack whole conversations into windows of "
        "N tokens, the training job's train.seq_len, so none crosses a window boundary",
    )
    parser.add_argument(
        "--long-conversations",
        choices=("cut", "drop"),
        default=None,
        help="with --format chat: a conversation longer than --seq-len keeps its first N "
        "tokens ('cut', the default; dropped when that keeps no assistant token) or is left "
        "out ('drop'); both are counted",
    )
    parser.add_argument(
        "--stop-on-refused",
        action="store_true",
        help="with --format chat: stop at the first conversation the chat template refuses "
        "(default: skip it, count it in meta.json and the summary line, and go on)",
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

    from kempnerforge.core.errors import DataError
    from kempnerforge.data.prepare import prepare_data
    from kempnerforge.data.tokenizer import load_tokenizer
    from kempnerforge.data.tokens import Shard, read_meta
    from kempnerforge.storage.location import join

    if overrides:
        raise DataError(f"unrecognized arguments: {' '.join(overrides)}")
    if args.record_max_id:
        if args.input or args.output:
            raise DataError(
                "--record-max-id scans directories already prepared; it takes no --input or "
                "--output (run it on its own)"
            )
        return run_record_max_id(args.record_max_id)
    if not args.input or not args.output:
        raise DataError(
            "prepare-data needs --input FILE_OR_DIR ... and --output DIR (or --record-max-id "
            "DIR to record the largest id of a directory already prepared)"
        )
    if args.eval_output and args.eval_fraction <= 0.0:
        raise DataError(f"--eval-output {args.eval_output} needs --eval-fraction F > 0")
    shard = None
    if args.shard_index is not None or args.num_shards is not None:
        if args.shard_index is None or args.num_shards is None:
            raise DataError(
                "--shard-index I and --num-shards N go together: this process writes shard I "
                "of N (0 <= I < N)"
            )
        shard = Shard(args.shard_index, args.num_shards)
    tokenizer = load_tokenizer(args.tokenizer)  # a wrong path is named before any template
    chat_template = packing = None
    if args.format != "chat" and (args.seq_len or args.long_conversations or args.stop_on_refused):
        option, about = _chat_only_option(args)
        raise DataError(
            f"{option} is about {about}; it goes only with --format chat (leave {option} out "
            "for text)"
        )
    if args.format == "chat":
        from kempnerforge.data.chat import Packing, load_chat_template

        if args.seq_len is None:
            raise DataError(
                "--format chat needs --seq-len N, the training job's train.seq_len: "
                "conversations are packed into windows of N tokens so that none crosses a "
                "window boundary"
            )
        packing = Packing(args.seq_len, args.long_conversations or "cut")

        if args.text_suffix or args.skip_non_utf8:
            option = "--text-suffix" if args.text_suffix else "--skip-non-utf8"
            raise DataError(
                f"{option} is about whole-file text documents; --format chat reads none "
                f"(leave {option} out)"
            )
        chat_template = load_chat_template(args.tokenizer)
    output = join(args.output, shard.name) if shard else args.output
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
    summary = (
        f"prepared {meta['num_tokens']:,} tokens in {meta['num_documents']:,} documents "
        f"({meta['dtype']}{', BOS per document' if args.bos else ''}) into {output}"
    )
    if chat_template is not None:
        summary += (
            f" ({meta['assistant_tokens']:,} assistant tokens; the longest conversation "
            f"{meta['max_document_tokens']:,} tokens; packed into windows of "
            f"{meta['packed_seq_len']:,} with {meta['pad_tokens']:,} pad tokens, "
            f"{meta['conversations_cut']:,} conversations cut and "
            f"{meta['conversations_dropped']:,} dropped as longer; "
            f"{meta['conversations_refused']:,} refused by the chat template and skipped)"
        )
    if args.eval_fraction > 0.0:
        eval_output = join(args.eval_output, shard.name) if shard else args.eval_output
        held_out = read_meta(eval_output)
        summary += (
            f"; held out {held_out['num_tokens']:,} tokens in "
            f"{held_out['num_documents']:,} documents into {eval_output}"
        )
    print(summary)
    return 0


def _chat_only_option(args: argparse.Namespace) -> tuple[str, str]:
    """The first option given that goes only with --format chat, and what it is about."""
    if args.seq_len or args.long_conversations:
        option = "--seq-len" if args.seq_len else "--long-conversations"
        return option, "packing conversations into windows"
    return "--stop-on-refused", "conversations the chat template refuses"


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
