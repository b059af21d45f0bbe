"""Tokenizer folders laid out as public instruct models publish them, with their real chat
templates (tests/fixtures/chat_templates/) and a tiny BPE trained here.

Each ModelSetup says what the model's folder holds: the tokenizer class transformers builds,
the pre-tokenization of its tokenizer.json, its special and control tokens with their flags
(special, lstrip, rstrip, as its tokenizer.json declares them), which named tokens its
tokenizer_config.json and special_tokens_map.json give, and the template's end-of-turn.
Only the vocabulary is made up: a few hundred tokens learnt from the test conversations.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"

# The pre-tokenizer regexes of Llama 3's and Qwen2's tokenizer.json.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class Added:
    """An added token as the model's tokenizer.json declares it."""

    content: str
    special: bool = True
    lstrip: bool = False
    rstrip: bool = False


@dataclass(frozen=True)
class ModelSetup:
    """One model's tokenizer folder: see the module docstring."""

    name: str
    template: str
    tokenizer_class: str
    pipeline: str
    """'byte_level' (a Split regex, then bytes), 'qwen2', 'gpt2', 'metaspace' (SentencePiece
    BPE with byte fallback, as transformers 5 builds LlamaTokenizer) or 'gemma'."""
    added: tuple[Added, ...]
    named: dict[str, Any]
    """bos_token, eos_token, ... and other keys of tokenizer_config.json, as published."""
    end_of_turn: str
    base_vocab: tuple[str, ...] = ()
    """Tokens that open the vocabulary of a SentencePiece model (<unk>, <s>, </s>, ...)."""
    split: str = LLAMA3_SPLIT
    lists_added_tokens: bool = True
    """Whether tokenizer_config.json holds added_tokens_decoder (transformers then ignores
    special_tokens_map.json)."""
    special_tokens_map: tuple[str, ...] = ()
    """Named tokens written to special_tokens_map.json too (as many folders publish)."""
    only_in_map: bool = False
    """The named tokens are in special_tokens_map.json only, not in tokenizer_config.json."""
    trims: bool = False
    """Whether the template writes an assistant's content trimmed."""
    generation_blocks: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def assistant_text(self, content: str) -> str:
        """An assistant's content as the template writes it (leading whitespace aside)."""
        return content.strip() if self.trims else content


LLAMA3_ADDED = tuple(
    Added(t)
    for t in (
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|python_tag|>",
        "<|finetune_right_pad_id|>",
    )
)
LLAMA3_NAMED = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
QWEN_ADDED = (
    Added("<|endoftext|>"),
    Added("<|im_start|>"),
    Added("<|im_end|>"),
    Added("<tool_call>", special=False),
    Added("</tool_call>", special=False),
)
QWEN_NAMED = {
    "bos_token": None,
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "unk_token": None,
    "errors": "replace",
    "split_special_tokens": False,
    "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
}
MISTRAL_CONTROL = (
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
)
SENTENCEPIECE_NAMED = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
GEMMA_BASE = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")
GEMMA_NAMED = {
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "pad_token": "<pad>",
    "unk_token": "<unk>",
}
DEEPSEEK_ADDED = (
    Added("<｜begin▁of▁sentence｜>"),
    Added("<｜end▁of▁sentence｜>"),
    Added("<｜User｜>", special=False),
    Added("<｜Assistant｜>", special=False),
    Added("<think>", special=False),
    Added("</think>", special=False),
    *(
        Added(f"<｜{name}｜>", special=False)
        for name in (
            "tool▁calls▁begin",
            "tool▁calls▁end",
            "tool▁call▁begin",
            "tool▁call▁end",
            "tool▁outputs▁begin",
            "tool▁outputs▁end",
            "tool▁output▁begin",
            "tool▁output▁end",
            "tool▁sep",
        )
    ),
)


def _deepseek_token(content: str) -> dict[str, Any]:
    """A named token as DeepSeek's tokenizer_config.json writes it: an added-token object."""
    return {
        "__type": "AddedToken",
        "content": content,
        "lstrip": False,
        "normalized": True,
        "rstrip": False,
        "single_word": False,
    }


DEEPSEEK_NAMED = {
    "add_bos_token": True,
    "add_eos_token": False,
    "bos_token": _deepseek_token("<｜begin▁of▁sentence｜>"),
    "eos_token": _deepseek_token("<｜end▁of▁sentence｜>"),
    "pad_token": _deepseek_token("<｜end▁of▁sentence｜>"),
    "unk_token": None,
    "legacy": True,
}

SETUPS = (
    ModelSetup(
        "llama-3.1",
        "meta-llama--Llama-3.1-8B-Instruct.jinja",
        "PreTrainedTokenizerFast",
        "byte_level",
        LLAMA3_ADDED,
        LLAMA3_NAMED,
        "<|eot_id|>",
        special_tokens_map=("bos_token", "eos_token"),
        trims=True,
    ),
    ModelSetup(
        "llama-3.1-map-only",
        "meta-llama--Llama-3.1-8B-Instruct.jinja",
        "PreTrainedTokenizerFast",
        "byte_level",
        LLAMA3_ADDED,
        LLAMA3_NAMED,
        "<|eot_id|>",
        lists_added_tokens=False,
        special_tokens_map=("bos_token", "eos_token"),
        only_in_map=True,
        trims=True,
    ),
    ModelSetup(
        "llama-3.2",
        "meta-llama--Llama-3.2-3B-Instruct.jinja",
        "PreTrainedTokenizerFast",
        "byte_level",
        LLAMA3_ADDED,
        LLAMA3_NAMED,
        "<|eot_id|>",
        special_tokens_map=("bos_token", "eos_token"),
        trims=True,
    ),
    ModelSetup(
        "llama-3.2-generation",
        "meta-llama--Llama-3.2-1B-Instruct-generation.jinja",
        "PreTrainedTokenizerFast",
        "byte_level",
        LLAMA3_ADDED,
        LLAMA3_NAMED,
        "<|eot_id|>",
        trims=True,
        generation_blocks=True,
    ),
    ModelSetup(
        "qwen2.5",
        "Qwen--Qwen2.5-7B-Instruct.jinja",
        "Qwen2Tokenizer",
        "qwen2",
        QWEN_ADDED,
        QWEN_NAMED,
        "<|im_end|>",
        split=QWEN2_SPLIT,
    ),
    ModelSetup(
        "qwen3",
        "Qwen--Qwen3-8B.jinja",
        "Qwen2Tokenizer",
        "qwen2",
        (
            *QWEN_ADDED,
            Added("<tool_response>", special=False),
            Added("</tool_response>", special=False),
            Added("<think>", special=False),
            Added("</think>", special=False),
        ),
        QWEN_NAMED,
        "<|im_end|>",
        split=QWEN2_SPLIT,
    ),
    ModelSetup(
        "gemma-2",
        "google--gemma-2-2b-it.jinja",
        "GemmaTokenizer",
        "gemma",
        (Added("<start_of_turn>"), Added("<end_of_turn>")),
        GEMMA_NAMED,
        "<end_of_turn>",
        base_vocab=GEMMA_BASE,
        special_tokens_map=("bos_token", "eos_token", "pad_token", "unk_token"),
        trims=True,
    ),
    ModelSetup(
        "gemma-3",
        "google--gemma-3-1b-it.jinja",
        "GemmaTokenizer",
        "gemma",
        (
            Added("<start_of_turn>"),
            Added("<end_of_turn>"),
            Added("<start_of_image>"),
            Added("<end_of_image>"),
            Added("<image_soft_token>"),
        ),
        {
            **GEMMA_NAMED,
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
        "<end_of_turn>",
        base_vocab=GEMMA_BASE,
        special_tokens_map=("bos_token", "eos_token", "pad_token", "unk_token"),
        trims=True,
    ),
    ModelSetup(
        "mistral-v0.2",
        "mistralai--Mistral-7B-Instruct-v0.2.jinja",
        "LlamaTokenizer",
        "metaspace",
        (),
        {**SENTENCEPIECE_NAMED, "legacy": False},
        "</s>",
        base_vocab=("<unk>", "<s>", "</s>"),
        special_tokens_map=("bos_token", "eos_token", "unk_token"),
    ),
    ModelSetup(
        "mixtral-v0.1",
        "mistralai--Mixtral-8x7B-Instruct-v0.1.jinja",
        "LlamaTokenizer",
        "metaspace",
        (),
        {**SENTENCEPIECE_NAMED, "legacy": False},
        "</s>",
        base_vocab=("<unk>", "<s>", "</s>"),
        special_tokens_map=("bos_token", "eos_token", "unk_token"),
    ),
    ModelSetup(
        "mistral-v0.3",
        "mistralai--Mistral-7B-Instruct-v0.3.jinja",
        "LlamaTokenizer",
        "metaspace",
        tuple(Added(t) for t in MISTRAL_CONTROL),
        {**SENTENCEPIECE_NAMED, "legacy": False},
        "</s>",
        base_vocab=("<unk>", "<s>", "</s>"),
        special_tokens_map=("bos_token", "eos_token", "unk_token"),
        trims=True,
    ),
    ModelSetup(
        "phi-3",
        "microsoft--Phi-3-mini-4k-instruct.jinja",
        "LlamaTokenizer",
        "metaspace",
        (
            Added("<|endoftext|>"),
            Added("<|assistant|>", rstrip=True),
            Added("<|system|>", rstrip=True),
            Added("<|end|>", rstrip=True),
            Added("<|user|>", rstrip=True),
        ),
        {
            **SENTENCEPIECE_NAMED,
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
            "legacy": False,
        },
        "<|end|>",
        base_vocab=("<unk>", "<s>", "</s>"),
        special_tokens_map=("bos_token", "eos_token", "pad_token", "unk_token"),
    ),
    ModelSetup(
        "smollm2",
        "HuggingFaceTB--SmolLM2-1.7B-Instruct.jinja",
        "GPT2Tokenizer",
        "gpt2",
        (Added("<|endoftext|>"), Added("<|im_start|>"), Added("<|im_end|>")),
        {
            "bos_token": "<|im_start|>",
            "eos_token": "<|im_end|>",
            "pad_token": "<|im_end|>",
            "unk_token": "<|endoftext|>",
        },
        "<|im_end|>",
        special_tokens_map=("bos_token", "eos_token", "pad_token", "unk_token"),
    ),
    ModelSetup(
        "deepseek-v3",
        "deepseek-ai--DeepSeek-V3.jinja",
        "LlamaTokenizerFast",
        "byte_level",
        DEEPSEEK_ADDED,
        DEEPSEEK_NAMED,
        "<｜end▁of▁sentence｜>",
        lists_added_tokens=False,
    ),
    ModelSetup(
        "deepseek-r1",
        "deepseek-ai--DeepSeek-R1.jinja",
        "LlamaTokenizerFast",
        "byte_level",
        DEEPSEEK_ADDED,
        DEEPSEEK_NAMED,
        "<｜end▁of▁sentence｜>",
        lists_added_tokens=False,
    ),
)
SETUPS_BY_NAME = {setup.name: setup for setup in SETUPS}


def make_model_tokenizer_dir(setup: ModelSetup, path: Path, texts: list[str]) -> Path:
    """``setup``'s tokenizer folder at ``path``: tokenizer.json (a BPE learnt from
    ``texts`` with the model's added tokens and flags), tokenizer_config.json with its
    template, and special_tokens_map.json where the model publishes one."""
    import tokenizers

    path.mkdir(parents=True, exist_ok=True)
    tok = tokenizers.Tokenizer.from_str(json.dumps(_trained_json(setup, texts)))
    tok.add_tokens([_added_token(a) for a in setup.added if not a.special])
    tok.add_special_tokens(
        [_added_token(Added(t)) for t in setup.base_vocab]
        + [_added_token(a) for a in setup.added if a.special]
    )
    tok.save(str(path / "tokenizer.json"))
    template = (TEMPLATES / setup.template).read_text(encoding="utf-8")
    config: dict[str, Any] = {"tokenizer_class": setup.tokenizer_class, **setup.extra}
    named = {k: v for k, v in setup.named.items() if k not in setup.special_tokens_map}
    config.update(named if setup.only_in_map else setup.named)
    if setup.lists_added_tokens:
        config["added_tokens_decoder"] = {
            str(i): {**_flags(token), "normalized": False, "single_word": False}
            for i, token in sorted(tok.get_added_tokens_decoder().items())
        }
    config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    if setup.special_tokens_map:
        names = {k: setup.named[k] for k in setup.special_tokens_map}
        (path / "special_tokens_map.json").write_text(json.dumps(names), encoding="utf-8")
    return path


def _added_token(added: Added) -> Any:
    import tokenizers

    return tokenizers.AddedToken(
        added.content,
        special=added.special,
        lstrip=added.lstrip,
        rstrip=added.rstrip,
        normalized=False,
    )


def _flags(token: Any) -> dict[str, Any]:
    return {
        "content": token.content,
        "special": token.special,
        "lstrip": token.lstrip,
        "rstrip": token.rstrip,
    }


def _trained_json(setup: ModelSetup, texts: list[str]) -> dict[str, Any]:
    """tokenizer.json of a BPE learnt from ``texts`` with ``setup``'s pipeline."""
    import tokenizers
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    sentencepiece = setup.pipeline in ("metaspace", "gemma")
    if sentencepiece:
        # Learnt word by word, as SentencePiece learns: no piece spans two words.
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    else:
        tok.pre_tokenizer = _byte_level(setup)
        tok.decoder = decoders.ByteLevel()
        if setup.pipeline == "qwen2":
            tok.normalizer = normalizers.NFC()
    alphabet = [] if sentencepiece else pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    if setup.pipeline == "metaspace":  # as transformers 5 builds LlamaTokenizer
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first", split=False
        )
    elif setup.pipeline == "gemma":  # as GemmaTokenizer's tokenizer.json
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    raw = json.loads(tok.to_str())
    if sentencepiece:
        _with_byte_fallback(raw, setup)
    return raw


def _byte_level(setup: ModelSetup) -> Any:
    from tokenizers import Regex, pre_tokenizers

    if setup.pipeline == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(setup.split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _with_byte_fallback(raw: dict[str, Any], setup: ModelSetup) -> None:
    """Make a learnt BPE a SentencePiece-style one: ``setup.base_vocab`` first, then the 256
    byte tokens (<0x00>...), then what was learnt, unknown characters falling back to bytes."""
    learnt = sorted(raw["model"]["vocab"].items(), key=lambda item: item[1])
    vocab: dict[str, int] = {}
    for token in [*setup.base_vocab, *(f"<0x{b:02X}>" for b in range(256))]:
        vocab[token] = len(vocab)
    for token, _ in learnt:
        vocab.setdefault(token, len(vocab))
    raw["model"].update(vocab=vocab, byte_fallback=True, fuse_unk=True, unk_token="<unk>")
    if "<unk>" not in vocab:
        raw["model"]["unk_token"] = None
    replace = {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}
    steps = [replace, {"type": "ByteFallback"}, {"type": "Fuse"}]
    if setup.pipeline == "metaspace":
        steps.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    raw["decoder"] = {"type": "Sequence", "decoders": steps}


def _turns(*pairs: tuple[str, str]) -> list[dict[str, Any]]:
    return [{"role": role, "content": content} for role, content in pairs]


SYSTEM = ("system", "You are terse.")
WEATHER_CALL = {
    "id": "call12345",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
WEATHER_CALL_TEXT = {
    **WEATHER_CALL,
    "function": {**WEATHER_CALL["function"], "arguments": '{"city": "Paris"}'},
}
TOOL_RESULT = {"role": "tool", "content": '{"temperature": 21}', "tool_call_id": "call12345"}

CONVERSATIONS: tuple[tuple[str, list[dict[str, Any]]], ...] = (
    ("one turn", _turns(("user", "What is 2+2?"), ("assistant", "4"))),
    ("system", _turns(SYSTEM, ("user", "Name a colour."), ("assistant", "Blue."))),
    (
        "multi-turn",
        _turns(("user", "Hi"), ("assistant", "Hello."), ("user", "Bye"), ("assistant", "Bye!")),
    ),
    (
        "system multi-turn",
        _turns(
            SYSTEM,
            ("user", "One?"),
            ("assistant", "1"),
            ("user", "Two?"),
            ("assistant", "2"),
            ("user", "Three?"),
            ("assistant", "3"),
        ),
    ),
    (
        "assistant first",
        _turns(("assistant", "Welcome!"), ("user", "Hi"), ("assistant", "Hello.")),
    ),
    (
        "system, assistant first",
        _turns(SYSTEM, ("assistant", "Welcome!"), ("user", "Hi"), ("assistant", "Hello.")),
    ),
    (
        "edge whitespace",
        _turns(("user", "  padded question \n"), ("assistant", "  Hello there.  \n")),
    ),
    ("leading newlines", _turns(("user", "Go"), ("assistant", "\n\nGone."))),
    ("trailing newlines", _turns(("user", "Go"), ("assistant", "Gone.\n\n"))),
    ("tab and spaces", _turns(("user", "\tTab"), ("assistant", " \t indented\n  code"))),
    ("empty answer", _turns(("user", "Say nothing."), ("assistant", ""))),
    ("blank answer", _turns(("user", "Say nothing."), ("assistant", "   "))),
    (
        "unicode",
        _turns(
            ("user", "h\u00e9llo, \u65e5\u672c\u8a9e?"),
            ("assistant", "\u3053\u3093\u306b\u3061\u306f \U0001f600 na\u00efve caf\u00e9"),
        ),
    ),
    (
        "combining and right-to-left",
        _turns(
            ("user", "e\u0301?"),
            ("assistant", "e\u0301 \u05e9\u05dc\u05d5\u05dd \u0645\u0631\u062d\u0628\u0627"),
        ),
    ),
    (
        "emoji sequences",
        _turns(
            ("user", "Family?"),
            ("assistant", "\U0001f469\u200d\U0001f469\u200d\U0001f467 \U0001f1eb\U0001f1f7"),
        ),
    ),
    ("markup", _turns(("user", "HTML?"), ("assistant", '<b>bold</b> & {"json": [1, 2]}'))),
    ("code", _turns(("user", "Code?"), ("assistant", "```python\nprint('hi')\n```"))),
    (
        "long",
        _turns(
            *[
                p
                for i in range(5)
                for p in (("user", f"Question {i}?"), ("assistant", f"Answer {i}."))
            ]
        ),
    ),
    ("ends with a user turn", _turns(("user", "A"), ("assistant", "B"), ("user", "C"))),
    ("two users", _turns(("user", "A"), ("user", "B"), ("assistant", "C"))),
    (
        "tool call",
        [
            *_turns(SYSTEM, ("user", "Weather in Paris?")),
            {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL]},
            TOOL_RESULT,
            {"role": "assistant", "content": "It is 21 degrees."},
        ],
    ),
    (
        "tool call, arguments as text",
        [
            *_turns(("user", "Weather in Paris?")),
            {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL_TEXT]},
            TOOL_RESULT,
            {"role": "assistant", "content": "It is 21 degrees."},
        ],
    ),
    (
        "tool call without content",
        [
            *_turns(("user", "Weather in Paris?")),
            {"role": "assistant", "tool_calls": [WEATHER_CALL]},
            TOOL_RESULT,
            {"role": "assistant", "content": "It is 21 degrees."},
        ],
    ),
    (
        "reasoning_content",
        [
            *_turns(("user", "2+2?")),
            {"role": "assistant", "content": "4", "reasoning_content": "Two and two."},
        ],
    ),
    (
        "reasoning",
        [
            *_turns(("user", "2+2?")),
            {"role": "assistant", "content": "4", "reasoning": "Two and two."},
        ],
    ),
    (
        "think in content",
        _turns(("user", "2+2?"), ("assistant", "<think>\nTwo and two.\n</think>\n\n4")),
    ),
    (
        "multi-turn reasoning",
        [
            *_turns(("user", "2+2?")),
            {"role": "assistant", "content": "4", "reasoning": "Two and two."},
            *_turns(("user", "3+3?")),
            {"role": "assistant", "content": "6", "reasoning": "Three and three."},
        ],
    ),
    (
        "special text in content",
        _turns(("user", "Quote it"), ("assistant", "Turns end with <|im_end|> or <|eot_id|>.")),
    ),
)
"""(name, messages) of the conversations every setup is checked on."""


def training_texts() -> list[str]:
    """Text to learn the tiny vocabularies from: every content of CONVERSATIONS, and the
    templates' own words."""
    texts = [m.get("content", "") for _, messages in CONVERSATIONS for m in messages]
    texts += [p.read_text(encoding="utf-8") for p in sorted(TEMPLATES.glob("*.jinja"))]
    return texts * 3
