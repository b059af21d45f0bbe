"""Tokenizing prepare-data's document chunks in worker processes, results in input order.

A chunk holds texts, or with a chat template conversations, each encoded into its tokens and
loss mask, or into the ConversationRefused that says why it cannot be.

Workers are started with the spawn context (no forked copy of the parent's threads or open
files) and rebuild the tokenizer from its spec, so any tokenizer ``load_tokenizer`` makes works.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, TypeVar

import numpy as np

from kempnerforge.core.errors import DataError
from kempnerforge.data.chat import (
    ChatTemplate,
    Conversation,
    ConversationRefused,
    encode_conversations,
)
from kempnerforge.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, encode_to_arrays

T = TypeVar("T")
# Chunks in flight per worker: enough to keep every worker busy while the parent writes,
# few enough that the text and tokens held at once stay bounded.
_CHUNKS_PER_WORKER = 2

# Set in each worker by _init_worker; the tokenizer is built on the first chunk so a failure
# reaches the parent as that chunk's exception instead of a broken pool.
_worker_spec: str | Tokenizer | None = None
_worker_identity = ""
_worker_tokenizer: Tokenizer | None = None
_worker_template: ChatTemplate | None = None


def tokenizer_spec(tokenizer: Tokenizer) -> str | Tokenizer:
    """What a worker needs to rebuild ``tokenizer``: 'byte', a tokenizer.json path, or the
    tokenizer itself (any other type travels pickled)."""
    if type(tokenizer) is ByteTokenizer:
        return "byte"
    if type(tokenizer) is HFTokenizer:
        return tokenizer.path
    try:
        pickle.dumps(tokenizer)
    except Exception as exc:  # pickling raises many types (TypeError, PicklingError, ...)
        raise DataError(
            f"tokenizer {tokenizer.identity} cannot be sent to worker processes ({exc}); "
            "use --workers 1"
        ) from None
    return tokenizer


def _init_worker(spec: str | Tokenizer, identity: str, template: ChatTemplate | None) -> None:
    global _worker_spec, _worker_identity, _worker_template
    # N workers each encode on one core; the tokenizers library's own threads would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_spec, _worker_identity, _worker_template = spec, identity, template


def _worker_tok() -> Tokenizer:
    global _worker_tokenizer
    if _worker_tokenizer is None:
        spec = _worker_spec
        assert spec is not None, "worker used before _init_worker"
        if spec == "byte":
            tok: Tokenizer = ByteTokenizer()
        elif isinstance(spec, str):
            tok = HFTokenizer(spec)
        else:
            tok = spec
        if tok.identity != _worker_identity:
            raise DataError(
                f"{spec}: the tokenizer changed while prepare-data ran ({tok.identity}, "
                f"started with {_worker_identity}); rerun it"
            )
        _worker_tokenizer = tok
    return _worker_tokenizer


def encode_documents(
    tokenizer: Tokenizer, template: ChatTemplate | None, documents: list[Any]
) -> list[Any]:
    """Token arrays of texts; with ``template``, (tokens, loss mask) of conversations, or the
    ConversationRefused of one that cannot be written."""
    if template is None:
        return encode_to_arrays(tokenizer, documents)
    return encode_conversations(tokenizer, template, documents)


def _encode_chunk(documents: list[str] | list[Conversation]) -> tuple[Any, ...]:
    """One chunk's tokens as a flat array plus document end offsets (one buffer to pickle),
    and with a chat template the flat loss mask and the refused conversations (position,
    refusal) after them."""
    encoded = encode_documents(_worker_tok(), _worker_template, documents)
    if _worker_template is None:
        return _flatten(encoded)
    refused = [(i, e) for i, e in enumerate(encoded) if isinstance(e, ConversationRefused)]
    pairs = [e for e in encoded if not isinstance(e, ConversationRefused)]
    tokens, ends = _flatten([ids for ids, _ in pairs])
    masks, _ = _flatten([mask for _, mask in pairs], np.bool_)
    return tokens, ends, masks, refused


def _flatten(arrays: list[np.ndarray], dtype: Any = np.int64) -> tuple[np.ndarray, np.ndarray]:
    ends = np.cumsum([len(a) for a in arrays], dtype=np.int64)
    flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)
    return flat, ends


class ChunkEncoder:
    """Encodes chunks of documents inline (one worker) or in a pool of worker processes:
    texts, or with ``chat_template`` conversations.

    Use as a context manager: leaving it stops the workers, cancelling chunks not yet encoded.
    Callers that start workers from a script need the usual ``if __name__ == "__main__"``
    guard, since spawned workers import the main module.
    """

    def __init__(
        self, tokenizer: Tokenizer, num_workers: int = 1, chat_template: ChatTemplate | None = None
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.num_workers = num_workers
        self._pool: ProcessPoolExecutor | None = None
        if num_workers > 1:
            self._pool = ProcessPoolExecutor(
                max_workers=num_workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=(tokenizer_spec(tokenizer), tokenizer.identity, chat_template),
            )

    def __enter__(self) -> ChunkEncoder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def encode(
        self, chunks: Iterable[T], documents_of: Callable[[T], list[Any]]
    ) -> Iterator[tuple[T, list[Any]]]:
        """Each chunk with its documents' token arrays (with a chat template, (tokens, loss
        mask) pairs), in the order the chunks came.

        At most ``2 * num_workers`` chunks are read ahead of the one being yielded.
        """
        if self._pool is None:
            for chunk in chunks:
                documents = documents_of(chunk)
                yield chunk, encode_documents(self.tokenizer, self.chat_template, documents)
            return
        pending: deque[tuple[T, Future[tuple[Any, ...]]]] = deque()
        window = _CHUNKS_PER_WORKER * self.num_workers
        for chunk in chunks:
            pending.append((chunk, self._pool.submit(_encode_chunk, documents_of(chunk))))
            if len(pending) >= window:
                yield _collect(*pending.popleft())
        while pending:
            yield _collect(*pending.popleft())


def _collect(chunk: T, future: Future[tuple[Any, ...]]) -> tuple[T, list[Any]]:
    flat, ends, *chat = future.result()
    tokens = np.split(flat, ends[:-1]) if len(ends) else []
    if not chat:
        return chunk, tokens
    masks, refused = chat
    masks = np.split(masks, ends[:-1]) if len(ends) else []
    documents: list[Any] = list(zip(tokens, masks, strict=True))
    for position, refusal in refused:  # back in their place, in input order
        documents.insert(position, refusal)
    return chunk, documents
