"""Tokenizers: the built-in byte-level one and Hugging Face tokenizer.json files."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from kempnerforge.core.errors import ConfigError, DataError

if TYPE_CHECKING:
    from collections.abc import Sequence

# Searched in order; the first token the vocabulary has wins.
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "<|im_end|>")
BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "<|bos|>")
PAD_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]", "<|padding|>", "<|finetune_right_pad_id|>")


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer.

    ``identity`` names the exact vocabulary: prepared token files record it, and a dataset
    refuses tokens made by a different one.
    """

    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int
    identity: str

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without any special tokens added."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, skipping special ids; invalid UTF-8 becomes U+FFFD."""
        ...


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes of the text; 256, 257, 258 are BOS, EOS and PAD.

    Needs no files, so the built-in corpus and the tests work anywhere.
    """

    vocab_size = 259
    bos_id = 256
    eos_id = 257
    pad_id = 258
    identity = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # Ids past 255 (specials, or a model vocabulary padded beyond ours) carry no bytes.
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer loaded from a local tokenizer.json."""

    def __init__(self, path: str) -> None:
        try:
            import tokenizers
        except ImportError:
            raise DataError(
                f"{path}: reading a tokenizer.json needs the 'tokenizers' package: "
                "pip install kempnerforge[hf] (or use data.tokenizer = 'byte')"
            ) from None
        self.path = path
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise DataError(f"{path}: cannot read the tokenizer file ({exc.strerror})") from None
        try:
            self._tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as exc:  # the library raises plain Exception for a malformed file
            raise DataError(
                f"{path}: not a valid Hugging Face tokenizer.json ({exc}); "
                "point data.tokenizer at the tokenizer.json saved with the model"
            ) from None
        self.identity = "hf:" + hashlib.sha256(raw).hexdigest()[:16]
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eos = self._find(EOS_CANDIDATES)
        if eos is None:
            raise DataError(
                f"{path}: no end-of-document token found (looked for "
                f"{', '.join(EOS_CANDIDATES)}); add one of them to the tokenizer's special tokens"
            )
        self.eos_id = eos
        # Without a BOS or PAD token, EOS stands in (as GPT-2 does): both are never predicted.
        bos = self._find(BOS_CANDIDATES)
        pad = self._find(PAD_CANDIDATES)
        self.bos_id = eos if bos is None else bos
        self.pad_id = eos if pad is None else pad

    def _find(self, candidates: tuple[str, ...]) -> int | None:
        for token in candidates:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token_id
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of ``text`` (no special tokens added) and each token's [start, end)
        characters of ``text``: a conversation's loss mask is mapped onto tokens with them."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def encode_batch_with_offsets(
        self, texts: list[str]
    ) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """encode_with_offsets of many texts at once (parallel inside the tokenizers library,
        as encode_batch)."""
        encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        return [(e.ids, e.offsets) for e in encodings]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of many texts at once (parallel inside the tokenizers library)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def encode_to_arrays(tokenizer: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Token arrays for many documents, taking each tokenizer's fastest path.

    prepare-data spends most of its time here: bytes need no Python-level ints at all, and a
    Hugging Face tokenizer encodes a batch on all cores.
    """
    # Exact types only: a subclass may change encode, and then its encode must be used.
    if type(tokenizer) is ByteTokenizer:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
    if type(tokenizer) is HFTokenizer:
        return [np.asarray(ids, dtype=np.int64) for ids in tokenizer.encode_batch(texts)]
    return [np.asarray(tokenizer.encode(t), dtype=np.int64) for t in texts]


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer named by ``data.tokenizer``: 'byte' or the path of a tokenizer.json.

    A directory is accepted when it holds a tokenizer.json (a saved Hugging Face model).
    """
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(
            "data.tokenizer",
            spec,
            "'byte' or the path of an existing tokenizer.json",
            hint=f"{path} does not exist" if not path.exists() else f"{path} is not a file",
        )
    return HFTokenizer(str(path))
