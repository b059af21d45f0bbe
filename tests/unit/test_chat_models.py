"""The chat templates of public instruct models, on tokenizer folders laid out as those models
publish them (tests/support/chat_models.py), against transformers' own apply_chat_template:
the same token ids for every conversation it accepts, refusals where it refuses, the
special tokens it reads, and a loss mask on exactly what the assistant says."""

from __future__ import annotations

import unicodedata
from typing import Any

import numpy as np
import pytest

from kempnerforge.data.chat.conversation import conversation_of
from kempnerforge.data.chat.encoding import encode_conversations
from kempnerforge.data.chat.template import load_chat_template
from kempnerforge.data.chat.turns import ConversationRefused
from kempnerforge.data.tokenizer import HFTokenizer, load_tokenizer
from tests.support.chat_models import (
    CONVERSATIONS,
    SETUPS,
    ModelSetup,
    make_model_tokenizer_dir,
    training_texts,
)

transformers = pytest.importorskip("transformers")

# Conversations transformers renders whose assistant turn cannot be located: Mistral v0.3
# moves the system prompt into the last user turn, so the messages before the tool call
# render differently on their own, and its tool-call turn writes no content to find it by.
UNLOCATABLE = {("mistral-v0.3", "tool call")}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each setup's tokenizer folder, built once."""
    root = tmp_path_factory.mktemp("models")
    texts = training_texts()
    return {s.name: make_model_tokenizer_dir(s, root / s.name, texts) for s in SETUPS}


def _ours(folder, messages_list: list[list[dict[str, Any]]]) -> list[Any]:
    tokenizer = load_tokenizer(str(folder))
    template = load_chat_template(str(folder))
    conversations = [conversation_of({"messages": m}, name) for name, m in messages_list]
    return encode_conversations(tokenizer, template, conversations)


def _theirs(reference, messages: list[dict[str, Any]], **options: Any) -> Any:
    """transformers' ids (or its dict with options), None where it refuses."""
    try:
        return reference.apply_chat_template(messages, tokenize=True, **options)
    except Exception:  # a template's raise_exception, or a failure inside the template
        return None


@pytest.mark.parametrize("setup", SETUPS, ids=lambda s: s.name)
def test_token_ids_equal_apply_chat_template(folders, setup):
    reference = transformers.AutoTokenizer.from_pretrained(str(folders[setup.name]))
    ours = _ours(folders[setup.name], list(CONVERSATIONS))
    accepted = 0
    for (name, messages), encoded in zip(CONVERSATIONS, ours, strict=True):
        theirs = _theirs(reference, messages, return_dict=False)
        if theirs is None or (setup.name, name) in UNLOCATABLE:
            assert isinstance(encoded, ConversationRefused), (setup.name, name)
            continue
        assert not isinstance(encoded, ConversationRefused), (setup.name, str(encoded))
        assert encoded[0].tolist() == list(theirs), (setup.name, name)
        accepted += 1
    assert accepted >= 20  # every template accepts most of the conversations


def _named_id(reference, name: str) -> int | None:
    token = getattr(reference, name)
    return None if token is None else reference.convert_tokens_to_ids(token)


@pytest.mark.parametrize("setup", SETUPS, ids=lambda s: s.name)
def test_special_tokens_are_those_transformers_reads(folders, setup):
    folder = folders[setup.name]
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    tokenizer = load_tokenizer(str(folder))
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.eos_id == _named_id(reference, "eos_token")
    # Without a BOS or PAD token EOS stands in.
    for name, ours in (("bos_token", tokenizer.bos_id), ("pad_token", tokenizer.pad_id)):
        theirs = _named_id(reference, name)
        assert ours == (tokenizer.eos_id if theirs is None else theirs), name
    variables = load_chat_template(str(folder)).variables
    passed = reference.special_tokens_map
    assert {name: passed[name] for name in variables} == variables
    for name in ("bos_token", "eos_token", "pad_token"):
        assert (name in variables) == (name in passed)


def _on_runs(reference, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """The text of each run of masked-on tokens, decoded by transformers (special tokens
    kept; an added token is its own text, without whitespace it takes beside it)."""
    runs: list[list[int]] = []
    previous = False
    for token, on in zip(ids.tolist(), mask.tolist(), strict=True):
        if on and previous:
            runs[-1].append(token)
        elif on:
            runs.append([token])
        previous = on
    return [reference.decode(run, skip_special_tokens=False) for run in runs]


def _nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)


def _last_query(messages: list[dict[str, Any]]) -> int:
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    return users[-1] if users else len(messages) - 1


def _turn_text(setup: ModelSetup, messages: list[dict[str, Any]], i: int) -> str:
    """What the template writes for assistant turn i, from its content (the templates'
    rules, read off their text)."""
    message = messages[i]
    content = message["content"]
    if setup.name == "deepseek-r1":
        content = content.split("</think>")[-1]
    if setup.name == "qwen3":
        reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
        if not reasoning and "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
        last = i == len(messages) - 1
        if i > _last_query(messages) and (last or reasoning):
            return f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{content.lstrip(chr(10))}"
    return setup.assistant_text(content)


@pytest.mark.parametrize("setup", SETUPS, ids=lambda s: s.name)
def test_the_mask_is_the_assistants_text_and_its_end_of_turn(folders, setup):
    folder = folders[setup.name]
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = _ours(folder, list(CONVERSATIONS))
    checked = 0
    for (name, messages), encoded in zip(CONVERSATIONS, ours, strict=True):
        if isinstance(encoded, ConversationRefused):
            continue
        runs = _on_runs(reference, *encoded)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        assert len(runs) == len(turns), (name, runs)
        for i, run in zip(turns, runs, strict=True):
            # Every run ends with the template's own end of turn: nothing after it is on.
            assert run.endswith(setup.end_of_turn), (name, run)
            if "tool_calls" not in messages[i]:
                want = _turn_text(setup, messages, i) + setup.end_of_turn
                # Qwen's tokenizer normalizes to NFC (e + U+0301 is é).
                assert _nfc(run).lstrip() == _nfc(want).lstrip(), (name, i)
        checked += 1
    assert checked >= 20


def test_the_mask_equals_transformers_generation_mask(folders):
    """On a template whose assistant text is in {% generation %} blocks, transformers' own
    assistant mask is the reference."""
    folder = folders["llama-3.2-generation"]
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = _ours(folder, list(CONVERSATIONS))
    for (name, messages), encoded in zip(CONVERSATIONS, ours, strict=True):
        options = {"return_dict": True, "return_assistant_tokens_mask": True}
        theirs = _theirs(reference, messages, **options)
        assert theirs is not None and not isinstance(encoded, ConversationRefused), name
        assert encoded[0].tolist() == list(theirs["input_ids"]), name
        assert encoded[1].astype(int).tolist() == list(theirs["assistant_masks"]), name


def test_phi3_leaves_its_header_and_trailing_eos_off(folders):
    """Phi-3's <|assistant|> takes the spaces after it (rstrip), and its template ends a
    conversation with EOS after the last <|end|>: neither is the assistant's."""
    folder = folders["phi-3"]
    tokenizer = load_tokenizer(str(folder))
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "   Hello."}]
    [(ids, mask)] = _ours(folder, [("spaces", messages)])
    assert isinstance(tokenizer, HFTokenizer)
    header = tokenizer._tok.token_to_id("<|assistant|>")
    end, eos = tokenizer._tok.token_to_id("<|end|>"), tokenizer.eos_id
    assert ids[-1] == eos and not mask[-1]
    assert not mask[ids.tolist().index(header)]
    assert mask[ids.tolist().index(end, ids.tolist().index(header))]


def test_qwen3_renders_a_reasoning_key_as_transformers_does(folders):
    folder = folders["qwen3"]
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    messages = dict(CONVERSATIONS)["reasoning"]
    text = load_chat_template(str(folder)).render(messages)
    assert "<think>\nTwo and two.\n</think>" in text
    assert text == reference.apply_chat_template(messages, tokenize=False)
