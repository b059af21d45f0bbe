"""Tokenizers: the built-in byte-level one and Hugging Face tokenizer.json files, with the
special tokens their directory names."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from kempnerforge.core.errors import ConfigError, DataError

if TYPE_CHECKING:
    from collections.abc import Sequence

TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
# The named special tokens transformers reads from a tokenizer directory.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Used only for a lone tokenizer.json (no tokenizer_config.json or special_tokens_map.json
# beside it), and for an EOS a directory does not name: searched in order; the first token
# the vocabulary has wins.
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
        self._stripping: dict[int, tuple[int, bool, bool]] | None = None
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
        self._set_special_ids(read_special_tokens(Path(path).parent))

    def _set_special_ids(self, named: dict[str, tuple[str | None, str]]) -> None:
        """EOS, BOS and PAD as the tokenizer's directory names them (tokenizer_config.json,
        special_tokens_map.json; see read_special_tokens).

        A token named null, or one a directory with those files leaves out, is absent (as
        transformers has it); only a lone tokenizer.json is searched for the candidate
        tokens, and every tokenizer for an EOS. Without a BOS or PAD token EOS stands in (as
        GPT-2 does): both are never predicted.
        """
        directory = Path(self.path).parent
        configured = any((directory / f).is_file() for f in (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP))
        eos = self._named_id(named, "eos_token", EOS_CANDIDATES)
        if eos is None:
            if "eos_token" in named:
                raise DataError(
                    f"{named['eos_token'][1]}: eos_token is null, so {self.path} has no "
                    "end-of-document token; name one of its special tokens there"
                )
            raise DataError(
                f"{self.path}: no end-of-document token found (its directory names no "
                f"eos_token, and none of {', '.join(EOS_CANDIDATES)} is in the vocabulary); "
                f"name it as eos_token in {TOKENIZER_CONFIG} beside it"
            )
        self.eos_id = eos
        # tokenizer.json's padding gives transformers' pad_token when none is named.
        padding = self._tok.padding
        padding_token = str(padding["pad_token"]) if padding else None
        bos = self._named_id(named, "bos_token", () if configured else BOS_CANDIDATES)
        pad = self._named_id(
            named, "pad_token", () if configured else PAD_CANDIDATES, padding_token
        )
        self.bos_id = eos if bos is None else bos
        self.pad_id = eos if pad is None else pad

    def _named_id(
        self,
        named: dict[str, tuple[str | None, str]],
        name: str,
        candidates: tuple[str, ...],
        default: str | None = None,
    ) -> int | None:
        """The id of special token ``name``: the directory's choice when it names one (None
        when it names null), else ``default``'s, else the first of ``candidates`` found."""
        if name not in named:
            found = self._tok.token_to_id(default) if default else None
            return found if found is not None else self._find(candidates)
        text, where = named[name]
        if text is None:
            return None
        token_id = self._tok.token_to_id(text)
        if token_id is None:
            raise DataError(
                f"{where}: {name} {text!r} is not a token of {self.path}; name one of its "
                "tokens, or use the tokenizer files saved together with the model"
            )
        return token_id

    def _find(self, candidates: tuple[str, ...]) -> int | None:
        for token in candidates:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token_id
        return None

    def stripping_tokens(self) -> dict[int, tuple[int, bool, bool]]:
        """Added tokens that take the whitespace beside them (lstrip or rstrip, as Phi-3's
        ``<|assistant|>``): id -> (length of the token's own text, lstrip, rstrip). Their
        offsets cover that whitespace too."""
        if self._stripping is None:
            self._stripping = {
                token_id: (len(token.content), token.lstrip, token.rstrip)
                for token_id, token in self._tok.get_added_tokens_decoder().items()
                if token.lstrip or token.rstrip
            }
        return self._stripping

    def token_text(self, token_id: int) -> str | None:
        """The text of an added (special or control) token, None for any other id."""
        token = self._tok.get_added_tokens_decoder().get(token_id)
        return None if token is None else token.content

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


def read_json_object(path: Path) -> dict[str, Any]:
    """A tokenizer file holding a JSON object (tokenizer_config.json, ...); {} when absent."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: not a readable JSON file ({exc}); fix or remove it") from None
    if not isinstance(value, dict):
        raise DataError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def read_special_tokens(directory: Path) -> dict[str, tuple[str | None, str]]:
    """The special tokens a tokenizer directory names, as transformers reads them: name ->
    (the token's text, None where named null; the file that names it).

    tokenizer_config.json first; special_tokens_map.json then overrides its standard names,
    unless the config holds ``added_tokens_decoder`` (transformers reads the map only for
    configs without it). A value is a string or an added-token object with a 'content'.
    A config's other ``*_token`` strings and ``extra_special_tokens`` (a model's own, like
    Gemma 3's ``image_token``) are kept too: transformers passes them to chat templates.
    """
    config_path = directory / TOKENIZER_CONFIG
    config = read_json_object(config_path)
    named: dict[str, tuple[str | None, str]] = {}
    extra = config.get("extra_special_tokens")
    for name, value in [*config.items(), *(extra.items() if isinstance(extra, dict) else [])]:
        if name in SPECIAL_TOKEN_NAMES:
            named[name] = (_token_text(value, name, config_path), str(config_path))
        elif name.endswith("_token") and isinstance(value, str):
            named[name] = (value, str(config_path))
    map_path = directory / SPECIAL_TOKENS_MAP
    if "added_tokens_decoder" not in config:
        for name, value in read_json_object(map_path).items():
            if name in SPECIAL_TOKEN_NAMES:
                named[name] = (_token_text(value, name, map_path), str(map_path))
    return named


def _token_text(value: Any, name: str, where: Path) -> str | None:
    """The text of a special-token entry: a string, an object's 'content', or None."""
    if isinstance(value, dict):
        value = value.get("content")
    if value is None or isinstance(value, str):
        return value
    raise DataError(f"{where}: {name} is {type(value).__name__}, not a string")


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
