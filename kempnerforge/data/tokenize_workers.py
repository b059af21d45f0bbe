"""Tokenizing prepare-data's document chunks in worker processes, results in input order.

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
from typing import TypeVar

import numpy as np

from kempnerforge.core.errors import DataError
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


def _init_worker(spec: str | Tokenizer, identity: str) -> None:
    global _worker_spec, _worker_identity
    # N workers each encode on one core; the tokenizers library's own threads would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_spec, _worker_identity = spec, identity


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


def _encode_chunk(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """One chunk's tokens as a flat array plus document end offsets (one buffer to pickle)."""
    arrays = encode_to_arrays(_worker_tok(), texts)
    ends = np.cumsum([len(a) for a in arrays], dtype=np.int64)
    flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
    return flat, ends


class ChunkEncoder:
    """Encodes chunks of documents inline (one worker) or in a pool of worker processes.

    Use as a context manager: leaving it stops the workers, cancelling chunks not yet encoded.
    Callers that start workers from a script need the usual ``if __name__ == "__main__"``
    guard, since spawned workers import the main module.
    """

    def __init__(self, tokenizer: Tokenizer, num_workers: int = 1) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.tokenizer = tokenizer
        self.num_workers = num_workers
        self._pool: ProcessPoolExecutor | None = None
        if num_workers > 1:
            self._pool = ProcessPoolExecutor(
                max_workers=num_workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=(tokenizer_spec(tokenizer), tokenizer.identity),
            )

    def __enter__(self) -> ChunkEncoder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def encode(
        self, chunks: Iterable[T], texts_of: Callable[[T], list[str]]
    ) -> Iterator[tuple[T, list[np.ndarray]]]:
        """Each chunk with its documents' token arrays, in the order the chunks came.

        At most ``2 * num_workers`` chunks are read ahead of the one being yielded.
        """
        if self._pool is None:
            for chunk in chunks:
                yield chunk, encode_to_arrays(self.tokenizer, texts_of(chunk))
            return
        pending: deque[tuple[T, Future[tuple[np.ndarray, np.ndarray]]]] = deque()
        window = _CHUNKS_PER_WORKER * self.num_workers
        for chunk in chunks:
            pending.append((chunk, self._pool.submit(_encode_chunk, texts_of(chunk))))
            if len(pending) >= window:
                yield _collect(*pending.popleft())
        while pending:
            yield _collect(*pending.popleft())


def _collect(chunk: T, future: Future[tuple[np.ndarray, np.ndarray]]) -> tuple[T, list[np.ndarray]]:
    flat, ends = future.result()
    return chunk, np.split(flat, ends[:-1]) if len(ends) else []
