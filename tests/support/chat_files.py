"""Chat test inputs built in tmp_path: a tokenizer directory with a chat template,
conversation files, and loss-masked corpora written with TokenFileWriter."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kempnerforge.data.tokenizer import ByteTokenizer, Tokenizer
from kempnerforge.data.tokens.token_file import TokenFileWriter
from tests.support.data_files import make_hf_tokenizer

CHAT_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>")

# ChatML with a default system turn, written over several lines as the templates models ship
# are, so that trim_blocks, lstrip_blocks and the whitespace controls decide the whitespace.
CHATML = """{%- if messages[0]['role'] != 'system' %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}
        {{- raise_exception('unknown role ' + message['role']) }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# The same rendering, with the assistant's text in {% generation %} blocks, so transformers'
# own assistant mask can be compared with ours.
CHATML_GENERATION = """{%- for message in messages %}
    {%- if message['role'] == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}
        {{- '\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}
"""

CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What does the fox do?"},
    {"role": "assistant", "content": "the quick brown fox jumps"},
    {"role": "user", "content": "And h\u00e9llo in \u65e5\u672c\u8a9e?"},
    {"role": "tool", "content": '{"result": "<b>ok</b>"}'},
    {"role": "assistant", "content": "over the lazy dog \U0001f600\n"},
]


def make_chat_tokenizer_dir(
    path: Path, template: str | None = CHATML, *, template_file: bool = False
) -> Path:
    """A tokenizer directory as a model ships it: tokenizer.json and tokenizer_config.json,
    with ``template`` in the config or (``template_file``) in chat_template.jinja."""
    make_hf_tokenizer(path / "tokenizer.json", specials=CHAT_SPECIALS)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": {"__type": "AddedToken", "content": "<pad>", "special": True},
    }
    if template is not None and template_file:
        (path / "chat_template.jinja").write_text(template, encoding="utf-8")
    elif template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


def write_conversations(path: Path, records: Sequence[Any]) -> Path:
    """One JSON record per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def example_preference_corpus(tmp_path: Path, pairs: int, seq_len: int) -> Path:
    """``tmp_path``/prefs: the example preference pairs of seeds 0 .. pairs - 1
    (examples.chat_conversations), prepared with the byte tokenizer and its chat template
    into windows of ``seq_len`` tokens."""
    from examples.chat_conversations import preference_pair
    from kempnerforge.data.chat import load_chat_template
    from kempnerforge.data.prepare import write_preference_corpus
    from kempnerforge.data.tokenizer import load_tokenizer

    rows = [preference_pair(random.Random(seed)) for seed in range(pairs)]
    source = write_conversations(tmp_path / "pairs.jsonl", rows)
    prefs = tmp_path / "prefs"
    write_preference_corpus(
        [str(source)], str(prefs), load_tokenizer("byte"), load_chat_template("byte"), seq_len
    )
    return prefs


MaskedDocument = tuple[Sequence[int], Sequence[bool]]
"""One document's ids and, per id, whether it is a supervised target."""


def write_masked_dir(
    path: Path | str,
    documents: Sequence[MaskedDocument],
    tokenizer: Tokenizer | None = None,
    bos_per_document: bool = False,
) -> str:
    """A masked prepared directory (a local path or a store URL) of exactly these documents."""
    with TokenFileWriter(str(path), tokenizer or ByteTokenizer(), bos_per_document) as writer:
        for ids, mask in documents:
            writer.add_document(np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool))
        writer.finish(num_sources=1)
    return str(path)


def turns(*parts: tuple[Sequence[int], bool]) -> MaskedDocument:
    """A document of turns, each (ids, whether the assistant says them)."""
    ids = [i for part, _ in parts for i in part]
    mask = [on for part, on in parts for _ in part]
    return ids, mask
