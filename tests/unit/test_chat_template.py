"""Chat templates render a conversation exactly as transformers' apply_chat_template does, and
are found where transformers finds them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kempnerforge.core.errors import DataError
from kempnerforge.data.chat.conversation import Conversation
from kempnerforge.data.chat.encoding import encode_conversation
from kempnerforge.data.chat.template import (
    BYTE_CHAT_TEMPLATE,
    ChatTemplate,
    byte_chat_template,
    load_chat_template,
)
from kempnerforge.data.tokenizer import HFTokenizer
from tests.support.chat_files import CONVERSATION, make_chat_tokenizer_dir


def _transformers_tokenizer(directory):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(directory))


@pytest.mark.parametrize("num_messages", [2, 3, 5, 6])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_rendering_equals_apply_chat_template(tmp_path, num_messages, add_generation_prompt):
    directory = make_chat_tokenizer_dir(tmp_path / "tok")
    reference = _transformers_tokenizer(directory)
    messages = CONVERSATION[:num_messages]
    ours = load_chat_template(str(directory)).render(messages, add_generation_prompt)
    theirs = reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs


@pytest.mark.parametrize("template_file", [False, True])
def test_token_ids_equal_apply_chat_template_tokenized(tmp_path, template_file):
    directory = make_chat_tokenizer_dir(tmp_path / "tok", template_file=template_file)
    reference = _transformers_tokenizer(directory)
    tokenizer = HFTokenizer(str(directory / "tokenizer.json"))
    ids, _ = encode_conversation(
        tokenizer, load_chat_template(str(directory)), Conversation(CONVERSATION)
    )
    theirs = reference.apply_chat_template(CONVERSATION, tokenize=True)
    theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs
    assert ids.tolist() == list(theirs)
    # The template's control tokens are single special ids, not their characters.
    im_end = tokenizer._tok.token_to_id("<|im_end|>")
    assert int(np.sum(ids == im_end)) == len(CONVERSATION)


def test_special_token_variables_come_from_the_tokenizer_config(tmp_path):
    template = "{{ eos_token }}|{{ pad_token }}|{{ messages | length }}"
    directory = make_chat_tokenizer_dir(tmp_path / "tok", template)
    rendered = load_chat_template(str(directory / "tokenizer.json")).render(CONVERSATION)
    assert rendered == f"<|im_end|>|<pad>|{len(CONVERSATION)}"
    assert rendered == _transformers_tokenizer(directory).apply_chat_template(
        CONVERSATION, tokenize=False
    )


def test_tojson_leaves_html_and_unicode_as_they_are(tmp_path):
    template = "{{ messages | tojson }}{{ messages[0] | tojson(indent=2) }}"
    directory = make_chat_tokenizer_dir(tmp_path / "tok", template)
    messages = [{"role": "user", "content": "<b>h\u00e9</b> & \u65e5"}]
    ours = load_chat_template(str(directory)).render(messages)
    assert "<b>h\u00e9</b> & \u65e5" in ours
    assert ours == _transformers_tokenizer(directory).apply_chat_template(messages, tokenize=False)


def test_the_jinja_file_wins_over_the_config(tmp_path):
    directory = make_chat_tokenizer_dir(tmp_path / "tok", "from the config")
    (directory / "chat_template.jinja").write_text("from the file", encoding="utf-8")
    template = load_chat_template(str(directory))
    assert template.render(CONVERSATION) == "from the file"
    assert template.where == str(directory / "chat_template.jinja")


def test_named_templates_use_the_default(tmp_path):
    directory = make_chat_tokenizer_dir(tmp_path / "tok", None)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "plain"},
    ]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_template(str(directory)).render(CONVERSATION) == "plain"


def test_a_tokenizer_without_a_template_says_what_to_do(tmp_path):
    directory = make_chat_tokenizer_dir(tmp_path / "tok", None)
    with pytest.raises(DataError, match="has no chat template") as info:
        load_chat_template(str(directory / "tokenizer.json"))
    message = str(info.value)
    assert str(directory) in message and "chat_template.jinja" in message


def test_invalid_jinja_names_the_template_and_line(tmp_path):
    directory = make_chat_tokenizer_dir(tmp_path / "tok", "ok\n{% for m in messages %}")
    with pytest.raises(DataError, match=r"tokenizer_config.json: the chat template is not valid"):
        load_chat_template(str(directory)).render(CONVERSATION)


def test_raise_exception_in_a_template_is_a_data_error(tmp_path):
    directory = make_chat_tokenizer_dir(tmp_path / "tok")
    bad = [{"role": "narrator", "content": "once upon a time"}]
    with pytest.raises(DataError, match="refused it: unknown role narrator"):
        load_chat_template(str(directory)).render(bad)


def test_the_byte_template_ends_assistant_turns_with_eos():
    template = byte_chat_template()
    assert template.source == BYTE_CHAT_TEMPLATE
    messages = CONVERSATION[1:3]
    assert template.render(messages) == (
        "<|user|>\nWhat does the fox do?\n<|assistant|>\nthe quick brown fox jumps<|eos|>\n"
    )
    prompt = template.render(messages[:1], add_generation_prompt=True)
    assert prompt == "<|user|>\nWhat does the fox do?\n<|assistant|>\n"


def test_a_template_travels_to_worker_processes():
    import pickle

    template = ChatTemplate("{{ messages[0]['content'] }}", "test", {"eos_token": "E"})
    copy = pickle.loads(pickle.dumps(template))
    assert copy == template and copy.render(CONVERSATION) == "Answer briefly."


def test_namespaces_loop_controls_and_the_date_render_as_in_transformers(tmp_path):
    template = (
        "{% set ns = namespace(turns=0) %}"
        "{% for m in messages %}{% if m['role'] == 'tool' %}{% break %}{% endif %}"
        "{% set ns.turns = ns.turns + 1 %}{% endfor %}"
        "{{ ns.turns }} turns, {{ strftime_now('%Y') }}"
    )
    directory = make_chat_tokenizer_dir(tmp_path / "tok", template)
    ours = load_chat_template(str(directory)).render(CONVERSATION)
    assert ours.startswith("4 turns, 2")
    assert ours == _transformers_tokenizer(directory).apply_chat_template(
        CONVERSATION, tokenize=False
    )


def test_a_template_cannot_set_underscore_names_on_a_namespace(tmp_path):
    template = "{% set ns = namespace(a=1) %}{% set ns.__class__ = 2 %}{{ ns.a }}"
    directory = make_chat_tokenizer_dir(tmp_path / "tok", template)
    with pytest.raises(DataError, match="may not set '__class__' on a namespace"):
        load_chat_template(str(directory)).render(CONVERSATION)
