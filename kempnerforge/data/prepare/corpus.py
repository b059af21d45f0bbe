"""prepare-data: tokenize text inputs, or conversations with their loss masks, into a prepared
directory (tokens.bin + meta.json).

Also splits off a held-out set by document, so train and eval never share a document, writes
one shard of a sharded corpus, and records the largest id of directories prepared before
meta.json held it.
"""

from __future__ import annotations

import functools
import hashlib
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kempnerforge.core.errors import DataError
from kempnerforge.core.logging import get_logger
from kempnerforge.data.chat import (
    ChatTemplate,
    Conversation,
    ConversationPacker,
    ConversationRefused,
    Packing,
)
from kempnerforge.data.prepare.chat_sources import read_conversations
from kempnerforge.data.prepare.refused import RefusedConversations
from kempnerforge.data.prepare.sources import (
    check_text_suffixes,
    discover_input_files,
    is_hf_dataset_dir,
    read_documents,
)
from kempnerforge.data.prepare.tokenize_workers import ChunkEncoder
from kempnerforge.data.tokenizer import Tokenizer
from kempnerforge.data.tokens import (
    Shard,
    TokenFileWriter,
    check_output_dir,
    check_shard_output,
    check_unsharded_output,
)
from kempnerforge.storage.location import is_url

logger = get_logger(__name__)

# Documents are tokenized in batches of about this much text (a Hugging Face tokenizer runs a
# batch on all cores); the batch is the most text ever held at once besides one document.
_BATCH_CHARS = 1 << 20
_BATCH_DOCS = 1024
# Documents per chunk sent to a worker process (--workers N > 1).
_WORKER_CHUNK_DOCS = 256


def is_eval_document(text_bytes: bytes, eval_fraction: float) -> bool:
    """Whether a document belongs to the held-out split.

    Decided by a hash of the text, so the split is the same on every run and machine, and a
    document repeated in the corpus lands on one side only.
    """
    if eval_fraction <= 0.0:
        return False
    digest = hashlib.blake2b(text_bytes, digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64 < eval_fraction


class _Progress:
    """One stderr line, rewritten after each source file."""

    def __init__(self, total_files: int, enabled: bool) -> None:
        self.total_files = total_files
        self.enabled = enabled
        self.start = time.monotonic()
        self.files = 0
        self.text_bytes = 0

    def file_done(self, writers: list[TokenFileWriter]) -> None:
        self.files += 1
        if not self.enabled:
            return
        docs = sum(w.num_documents for w in writers)
        tokens = sum(w.num_tokens for w in writers)
        rate = self.text_bytes / 1e6 / max(time.monotonic() - self.start, 1e-9)
        sys.stderr.write(
            f"\rprepare-data: {self.files}/{self.total_files} files, {docs:,} documents, "
            f"{tokens / 1e6:.1f}M tokens, {rate:.1f} MB/s "
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def write_corpus(
    sources: Iterable[tuple[str, Iterable[Any]]],
    num_sources: int,
    output_dir: str,
    tokenizer: Tokenizer,
    *,
    eval_fraction: float = 0.0,
    eval_output_dir: str | None = None,
    show_progress: bool = False,
    num_workers: int = 1,
    bos_per_document: bool = False,
    allow_empty: bool = False,
    chat_template: ChatTemplate | None = None,
    packing: Packing | None = None,
    stop_on_refused: bool = False,
) -> dict[str, Any]:
    """Tokenize ``(source name, documents)`` pairs into prepared directories.

    Empty documents are skipped; with ``bos_per_document`` each document starts with BOS.
    With ``chat_template`` the documents are conversations: each is rendered with it into one
    document whose loss mask is on for the assistant's tokens (the writer records the
    format, the number of assistant tokens and the longest conversation in meta.json); with
    ``packing`` too, each split's conversations are packed into whole windows
    (data/chat/packing.py).
    A conversation that cannot be written (ConversationRefused) is skipped and counted in
    its split's meta.json, or with ``stop_on_refused`` stops the run.
    Returns the train split's metadata; the eval split's is in
    ``eval_output_dir/meta.json``. Nothing appears under the final names unless every split
    is complete and, without ``allow_empty`` (a shard may hold no documents), non-empty.
    With ``num_workers`` > 1 the documents are tokenized in that many processes and the
    output is byte-identical to one worker's.
    """
    check_outputs(output_dir, eval_fraction, eval_output_dir)
    progress = _Progress(num_sources, show_progress)
    # Workers get small chunks so each has work; one process keeps the large batches.
    max_docs = _BATCH_DOCS if num_workers == 1 else _WORKER_CHUNK_DOCS
    with ExitStack() as stack:
        outputs = [output_dir] + ([eval_output_dir] if eval_fraction > 0.0 else [])
        masked = chat_template is not None
        writers = [
            stack.enter_context(TokenFileWriter(str(out), tokenizer, bos_per_document, masked))
            for out in outputs
        ]
        train, held_out = writers[0], (writers[1] if len(writers) > 1 else None)
        encoder = stack.enter_context(ChunkEncoder(tokenizer, num_workers, chat_template))
        # Each split is packed on its own: its windows hold only its conversations.
        sinks: list[Any] = [
            w if packing is None else ConversationPacker(w, packing) for w in writers
        ]
        refused = RefusedConversations(stop_on_refused)
        try:
            batches = _batches(sources, eval_fraction, progress, max_docs)
            for batch, encoded in encoder.encode(batches, lambda b: b.documents):
                for to_eval, document in zip(batch.to_eval, encoded, strict=True):
                    split = 1 if to_eval and held_out else 0
                    _add_document(sinks[split], document, masked, refused, split)
                for _ in range(batch.files_done):
                    progress.file_done(writers)
        finally:
            progress.close()
        extras = _chat_meta(sinks, refused) if chat_template is not None else [None, None]
        refused.report()
        if not allow_empty:
            refused.check_not_all(writers)
            _check_not_all_dropped(sinks)
            _check_not_empty(train, held_out, output_dir, eval_output_dir, eval_fraction)
        if held_out is not None:
            held_out.finish(num_sources, extras[-1])
        meta = train.finish(num_sources, extras[0])
    logger.info(
        "prepared %s tokens in %s documents into %s (%.1f s)",
        f"{meta['num_tokens']:,}",
        f"{meta['num_documents']:,}",
        output_dir,
        time.monotonic() - progress.start,
    )
    return meta


@dataclass
class _Batch:
    """Documents tokenized together (texts or conversations), their splits, and the sources
    they complete."""

    documents: list[Any] = field(default_factory=list)
    to_eval: list[bool] = field(default_factory=list)
    files_done: int = 0


def _batches(
    sources: Iterable[tuple[str, Iterable[Any]]],
    eval_fraction: float,
    progress: _Progress,
    max_docs: int,
) -> Iterator[_Batch]:
    """Non-empty documents with their split, grouped for batched tokenization.

    A batch may span sources; ``files_done`` counts those whose last document it holds. A
    conversation's split is decided by the hash of its messages (Conversation.key).
    """
    batch, chars = _Batch(), 0
    for _name, documents in sources:
        for document in documents:
            if not document:
                continue
            is_chat = isinstance(document, Conversation)
            data = document.key() if is_chat else document.encode("utf-8")
            progress.text_bytes += len(data)
            batch.documents.append(document)
            batch.to_eval.append(is_eval_document(data, eval_fraction))
            chars += len(data) if is_chat else len(document)
            if chars >= _BATCH_CHARS or len(batch.documents) >= max_docs:
                yield batch
                batch, chars = _Batch(), 0
        batch.files_done += 1
    if batch.documents or batch.files_done:
        yield batch


def check_outputs(
    output_dir: str,
    eval_fraction: float,
    eval_output_dir: str | None,
    shard: Shard | None = None,
) -> tuple[str, str | None]:
    """The directories to write (with ``shard``, its own under each output), checked before
    any input is read.

    Each must be new, empty, or a directory prepare-data wrote before (which is rewritten):
    a file there, or a directory holding anything else, is refused rather than mixed with a
    corpus, and the eval output must be another directory than the training output. An
    output holding shards takes only shards of the same count, and no unsharded corpus.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise DataError(f"eval fraction {eval_fraction} for {output_dir}: expected 0 <= F < 1")
    train_dir = _check_output(output_dir, "--output", shard)
    if eval_fraction <= 0.0:
        return train_dir, None
    if not eval_output_dir:
        raise DataError(
            f"eval fraction {eval_fraction} for {output_dir} needs an eval output directory "
            "(--eval-output DIR)"
        )
    if _same_place(eval_output_dir, output_dir):
        raise DataError(f"{output_dir}: the eval output must be a different directory")
    return train_dir, _check_output(eval_output_dir, "--eval-output", shard)


def _same_place(first: str, second: str) -> bool:
    """Whether two output paths (or store URLs) name the same directory."""
    if is_url(first) or is_url(second):
        return first.rstrip("/") == second.rstrip("/")
    return Path(first).resolve() == Path(second).resolve()


def _check_output(output_dir: str, option: str, shard: Shard | None) -> str:
    if shard is not None:
        return check_shard_output(output_dir, shard, option)
    check_unsharded_output(output_dir, option)
    check_output_dir(output_dir, option)
    return output_dir


def _check_not_empty(
    train: TokenFileWriter,
    held_out: TokenFileWriter | None,
    output_dir: str,
    eval_output_dir: str | None,
    eval_fraction: float,
) -> None:
    total = train.num_documents + (held_out.num_documents if held_out else 0)
    if total == 0:
        raise DataError(
            f"{output_dir}: the inputs hold no text (zero tokens); check the files and the "
            "jsonl text field"
        )
    if train.num_documents == 0:
        raise DataError(
            f"{output_dir}: all {total} documents went to the eval split; lower the eval fraction"
        )
    if held_out is not None and held_out.num_documents == 0:
        raise DataError(
            f"{eval_output_dir}: eval fraction {eval_fraction} selected none of {total} "
            "documents; raise the fraction or add documents"
        )


def _chat_meta(sinks: list[Any], refused: RefusedConversations) -> list[dict[str, Any]]:
    """Each split's chat fields of meta.json: its packing counts and refused conversations."""
    packed = [s.finish() if isinstance(s, ConversationPacker) else {} for s in sinks]
    return [{**fields, **refused.meta(split)} for split, fields in enumerate(packed)]


def _check_not_all_dropped(sinks: list[Any]) -> None:
    """Refuse a packed split whose every conversation was too long for its windows."""
    for sink in sinks:
        packer = isinstance(sink, ConversationPacker)
        if packer and sink.conversations_dropped and sink.writer.num_documents == 0:
            raise DataError(
                f"{sink.writer.output_dir}: all {sink.conversations_dropped} conversations are "
                f"longer than --seq-len {sink.seq_len} (or keep no assistant token when cut) "
                "and were dropped; raise --seq-len or use --long-conversations cut"
            )


def prepare_data(
    inputs: list[str],
    output_dir: str,
    tokenizer: Tokenizer,
    text_field: str | None = None,
    show_progress: bool = False,
    eval_fraction: float = 0.0,
    eval_output_dir: str | None = None,
    split: str | None = None,
    num_workers: int = 1,
    bos_per_document: bool = False,
    text_suffixes: tuple[str, ...] = (),
    skip_non_utf8: bool = False,
    shard: Shard | None = None,
    chat_template: ChatTemplate | None = None,
    packing: Packing | None = None,
    stop_on_refused: bool = False,
) -> dict[str, Any]:
    """Tokenize .txt / .jsonl (optionally .gz) / .parquet files and saved Hugging Face datasets
    (directories walked) into ``output_dir``; files ending in one of ``text_suffixes`` (e.g.
    '.py') are read as whole-file text like .txt, and with ``skip_non_utf8`` such files
    that are not UTF-8 are left out instead of stopping the run.

    Each .txt file is one document; each .jsonl line, parquet row or dataset row one document
    taken from ``text_field`` (default 'text'; a DatasetDict gives its ``split``, default
    'train'). Every document is followed by EOS, and preceded by BOS with ``bos_per_document``. With
    ``eval_fraction`` > 0 about that fraction of the documents goes to ``eval_output_dir``
    instead. ``num_workers`` > 1 tokenizes in that many spawned processes with byte-identical
    output. Returns the train split's metadata.

    With ``shard`` only its contiguous block of the input files (in the order above) is
    prepared, into ``output_dir/shard-I-of-N`` (and ``eval_output_dir/shard-I-of-N``), so
    shards 0..N-1 in order hold exactly the documents of one unsharded run, in its order. A
    shard may be empty (no files, or no held-out documents among its own).

    With ``chat_template`` the inputs are conversations (chat_sources.read_conversations,
    ``text_field`` naming the messages field, default 'messages'), each rendered into one
    document with a loss mask on the assistant's tokens; the writer's BOS is refused, since
    the template writes its own. With ``packing`` as well, the conversations are packed
    into whole windows of ``packing.seq_len`` tokens (data/chat/packing.py); of a sharded corpus
    only the last shard ends the stream with the extra pad token. A conversation that cannot
    be written is skipped and counted (``stop_on_refused``: the run stops; write_corpus).

    The outputs are checked before any input is read (check_outputs); files a directory walk
    leaves out are counted in one warning per directory.
    """
    _check_chat_options(output_dir, chat_template, packing, bos_per_document)
    if packing is not None and shard is not None:
        packing = replace(packing, ends_stream=shard.index == shard.count - 1)
    if text_field is None:
        text_field = "text" if chat_template is None else "messages"
    train_dir, eval_dir = check_outputs(output_dir, eval_fraction, eval_output_dir, shard)
    text_suffixes = check_text_suffixes(text_suffixes)
    files = _shard_files(discover_input_files(inputs, text_suffixes), shard, train_dir)
    if split is not None and not any(is_hf_dataset_dir(f) for f in files):
        logger.warning("--split %s is ignored: no input is a saved Hugging Face dataset", split)
    if chat_template is None:
        read = functools.partial(
            read_documents, text_suffixes=text_suffixes, skip_non_utf8=skip_non_utf8
        )
    else:
        read = read_conversations
    return write_corpus(
        ((str(f), read(f, text_field, split)) for f in files),
        len(files),
        train_dir,
        tokenizer,
        eval_fraction=eval_fraction,
        eval_output_dir=eval_dir,
        show_progress=show_progress,
        num_workers=num_workers,
        bos_per_document=bos_per_document,
        allow_empty=shard is not None,
        chat_template=chat_template,
        packing=packing,
        stop_on_refused=stop_on_refused,
    )


def _check_chat_options(
    output_dir: str, chat_template: ChatTemplate | None, packing: Packing | None, bos: bool
) -> None:
    """Refuse --bos with conversations (their template writes how they start) and packing
    without them."""
    if chat_template is not None and bos:
        raise DataError(
            f"{output_dir}: --bos does not go with --format chat: the chat template writes "
            "the tokens a conversation starts with; leave --bos out"
        )
    if packing is not None and chat_template is None:
        raise DataError(f"{output_dir}: --seq-len packs conversations; it needs --format chat")


def _shard_files(files: list[Path], shard: Shard | None, train_dir: str) -> list[Path]:
    """The input files ``shard`` prepares (all without one); an empty shard is said once."""
    if shard is None:
        return files
    taken = shard.take(files)
    if not taken:
        logger.warning(
            "%s: shard %d of %d gets none of the %d input files; it is written empty",
            train_dir,
            shard.index,
            shard.count,
            len(files),
        )
    return taken


def _add_document(
    sink: Any, document: Any, masked: bool, refused: RefusedConversations, split: int
) -> None:
    """Write one encoded document into its split: a text's ids, a conversation's ids and
    loss mask, or count a conversation its template refused."""
    if not masked:
        sink.add_document(document)
    elif isinstance(document, ConversationRefused):
        refused.add(document, split)
    else:
        sink.add_document(*document)  # the tokens and their loss mask
