"""The files of a Hugging Face model folder: config.json, safetensors weights, tokenizer files.

Nothing read here can run code: weights come from safetensors files only (a folder that has
only pickled ``*.bin`` weights is refused, never unpickled) and config.json is plain JSON.
Every problem with a folder is an HFFolderError naming the file (and the tensor) at fault.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from kempnerforge.core.errors import DataError
from kempnerforge.data.chat import (
    TEMPLATE_FILE,
    TOKENIZER_CONFIG,
    ChatTemplate,
    load_chat_template,
)

CONFIG_JSON = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
"""Files that make up a Hugging Face tokenizer; those a tokenizer directory has are copied."""


class HFFolderError(DataError):
    """A Hugging Face model folder cannot be read as a model kempnerforge can build.

    A DataError, so the command line prints it as one line and exits with code 2.
    """

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


def read_hf_config(hf_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The folder's config.json as a dict."""
    folder = Path(hf_dir)
    if not folder.is_dir():
        raise HFFolderError(folder, "is not a directory (expected a Hugging Face model folder)")
    path = folder / CONFIG_JSON
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HFFolderError(
            folder, f"has no {CONFIG_JSON}: not a Hugging Face model folder"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFFolderError(path, f"is not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise HFFolderError(path, "holds no JSON object")
    return data


def read_safetensors(hf_dir: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of the folder: model.safetensors, or the shards its index names."""
    folder = Path(hf_dir)
    single, index = folder / WEIGHTS_FILE, folder / WEIGHTS_INDEX
    if single.is_file():
        return _load_file(single)
    if index.is_file():
        return _load_sharded(folder, index)
    pickled = sorted(p.name for p in folder.glob("*.bin"))
    if pickled:
        raise HFFolderError(
            folder,
            f"holds pickled weights ({pickled[0]}) but no {WEIGHTS_FILE}: pickle files are "
            "never read, because loading them can run code; convert the model to safetensors "
            "(save_pretrained(..., safe_serialization=True)) and try again",
        )
    raise HFFolderError(folder, f"has neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX}")


def _load_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as e:  # the library raises its own error types for a damaged file
        raise HFFolderError(path, f"is not a readable safetensors file ({e})") from None


def _load_sharded(folder: Path, index: Path) -> dict[str, torch.Tensor]:
    """The tensors of a sharded folder; each one must sit in the shard the index names."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise HFFolderError(index, f"is not a readable index ({e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise HFFolderError(index, "has no 'weight_map' of tensor name -> shard file name")
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if Path(shard).name != shard or shard.startswith("."):
            raise HFFolderError(index, f"names the shard {shard!r} outside the folder")
        path = folder / shard
        if not path.is_file():
            raise HFFolderError(index, f"names the shard {shard}, which does not exist")
        tensors.update(_load_file(path))
    for name, shard in weight_map.items():
        if name not in tensors:
            raise HFFolderError(folder / shard, f"lacks the tensor {name} that {index.name} lists")
    return tensors


def write_hf_folder(
    out_dir: str | os.PathLike[str], config: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> Path:
    """Write config.json and one model.safetensors (fp32 tensors, as given) into out_dir."""
    from safetensors.torch import save_file

    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    # Contiguous private copies: safetensors refuses views and tensors sharing storage.
    plain = {name: t.detach().contiguous().clone() for name, t in tensors.items()}
    save_file(plain, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    (folder / CONFIG_JSON).write_text(text, encoding="utf-8")
    return folder


def special_token_ids(tokenizer: str | None) -> dict[str, int]:
    """bos/eos/pad ids of data.tokenizer ('byte' or a tokenizer.json path), {} when None."""
    if tokenizer is None:
        return {}
    from kempnerforge.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    return {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}


def copy_tokenizer(tokenizer: str | None, out_dir: str | os.PathLike[str]) -> list[str]:
    """Copy a Hugging Face tokenizer beside the weights; the names of the files written.

    A directory gives every tokenizer file it has, its chat template with them. A lone
    tokenizer.json gets a tokenizer_config.json naming its special tokens, so AutoTokenizer
    loads the folder, and the chat template kempnerforge finds beside it (carried_template)
    as chat_template.jinja. The byte tokenizer (and None) writes nothing: it has no Hugging
    Face form.
    """
    if tokenizer is None or tokenizer == "byte":
        return []
    from kempnerforge.data.tokenizer import HFTokenizer, load_tokenizer

    tok = load_tokenizer(tokenizer)  # a ConfigError / DataError for a bad path
    assert isinstance(tok, HFTokenizer)
    folder = Path(out_dir)
    written = []
    source = Path(tokenizer).expanduser()
    if source.is_dir():
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, folder / name)
                written.append(name)
        return written
    # The tokenizer.json file itself, whatever its name.
    shutil.copyfile(tok.path, folder / "tokenizer.json")
    config = _tokenizer_config(tok)
    template = carried_template(tokenizer)
    if template is not None:
        # The special tokens the template is rendered with, so both render it alike.
        config.update(template.variables)
        (folder / TEMPLATE_FILE).write_text(template.source, encoding="utf-8")
    (folder / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return ["tokenizer.json", TOKENIZER_CONFIG] + ([TEMPLATE_FILE] if template else [])


def write_generation_config(tokenizer: str | None, out_dir: str | os.PathLike[str]) -> bool:
    """Write generation_config.json when the exported tokenizer has a chat template, so
    transformers' ``generate`` ends a reply where `kempnerforge generate --chat` does: at
    the template's end-of-turn token or EOS (its ``eos_token_id`` list). True when written;
    without a template config.json's single EOS stays the stop, as before."""
    if tokenizer is None or tokenizer == "byte":
        return False
    template = carried_template(tokenizer)
    if template is None:
        return False
    from kempnerforge.data.chat import end_of_turn_ids
    from kempnerforge.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    config = {
        "bos_token_id": tok.bos_id,
        "eos_token_id": sorted(end_of_turn_ids(tok, template)),
        "pad_token_id": tok.pad_id,
    }
    text = json.dumps(config, indent=2) + "\n"
    (Path(out_dir) / GENERATION_CONFIG).write_text(text, encoding="utf-8")
    return True


def carried_template(tokenizer: str) -> ChatTemplate | None:
    """The chat template a lone tokenizer.json carries into an export: the one generate
    --chat and prepare-data --format chat use (chat_template.jinja or tokenizer_config.json
    beside it), or None when there is none."""
    try:
        return load_chat_template(tokenizer)
    except DataError:
        return None


def _tokenizer_config(tok: Any) -> dict[str, Any]:
    """A minimal tokenizer_config.json for a tokenizer.json: its class and special tokens."""
    import tokenizers

    raw = tokenizers.Tokenizer.from_file(tok.path)
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key, token_id in (("bos", tok.bos_id), ("eos", tok.eos_id), ("pad", tok.pad_id)):
        token = raw.id_to_token(token_id)
        if token is not None:
            config[f"{key}_token"] = token
    return config
