"""Data test inputs built in tmp_path: a Hugging Face tokenizer.json, jsonl files, token dirs."""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from kempnerforge.data.tokenizer import ByteTokenizer, Tokenizer
from kempnerforge.data.tokens.token_file import DTYPES, TokenFileWriter, read_meta

HF_TRAINING_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "the quick brown fox jumps over the lazy dog",
    "h\u00e9llo w\u00f6rld, \u65e5\u672c\u8a9e and emoji \U0001f600",
]


def make_hf_tokenizer(
    path: Path, specials: Sequence[str] = ("<|endoftext|>", "<pad>", "<s>")
) -> str:
    """Train a small byte-level BPE tokenizer and save it as a tokenizer.json."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(HF_TRAINING_TEXT, trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return str(path)


def write_jsonl(path: Path, texts: Sequence[str], field: str = "text") -> Path:
    """One JSON object per line (gzip-compressed when the name ends in .gz)."""
    lines = "".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts))
    data = lines.encode("utf-8")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


def write_token_dir(
    path: Path, documents: Sequence[Sequence[int]], tokenizer: Tokenizer | None = None
) -> str:
    """A prepared directory holding exactly these documents (each followed by EOS)."""
    with TokenFileWriter(str(path), tokenizer or ByteTokenizer()) as writer:
        for doc in documents:
            writer.add_document(np.asarray(doc, dtype=np.int64))
        writer.finish(num_sources=1)
    return str(path)


def prepared_ids(out: Path) -> np.ndarray:
    """Every id of a prepared directory, in order (of a sharded one: its shards' in turn)."""
    if not (out / "meta.json").exists() and any(out.glob("shard-*-of-*")):
        return np.concatenate([prepared_ids(shard) for shard in sorted(out.glob("shard-*"))])
    meta = read_meta(str(out))
    return np.fromfile(out / "tokens.bin", dtype=DTYPES[meta["dtype"]])


def prepared_documents(out: Path, tokenizer: Tokenizer | None = None) -> list[str]:
    """Decode a prepared directory back into its documents (split at EOS)."""
    tokenizer = tokenizer or ByteTokenizer()
    ids = prepared_ids(out).tolist()
    assert ids and ids[-1] == tokenizer.eos_id  # every document, the last too, ends in EOS
    docs, current = [], []
    for i in ids:
        if i == tokenizer.eos_id:
            docs.append(tokenizer.decode(current))
            current = []
        else:
            current.append(i)
    return docs


class IndexDataset(Dataset):
    """Sample i is the tensor [i]: batches show exactly which indices were read."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])
