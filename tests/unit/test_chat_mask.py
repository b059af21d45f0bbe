"""A conversation's loss mask is on for exactly the assistant's text and end-of-turn token;
conversations are checked with errors that name where they came from."""

from __future__ import annotations

import numpy as np
import pytest

from kempnerforge.core.errors import DataError
from kempnerforge.data.chat.conversation import Conversation, conversation_of
from kempnerforge.data.chat.encoding import encode_conversation
from kempnerforge.data.chat.template import ChatTemplate, byte_chat_template, load_chat_template
from kempnerforge.data.chat.turns import ConversationRefused, assistant_spans
from kempnerforge.data.tokenizer import ByteTokenizer, HFTokenizer
from tests.support.chat_files import CHATML_GENERATION, CONVERSATION, make_chat_tokenizer_dir


def _hf(tmp_path, template=None):
    directory = make_chat_tokenizer_dir(tmp_path / "tok", template or CHATML_GENERATION)
    tokenizer = HFTokenizer(str(directory / "tokenizer.json"))
    return directory, tokenizer, load_chat_template(str(directory))


def _on_text(tokenizer: HFTokenizer, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """The text of each run of on tokens, special tokens included."""
    runs, start = [], None
    for i, on in enumerate([*mask.tolist(), False]):
        if on and start is None:
            start = i
        elif not on and start is not None:
            runs.append(tokenizer._tok.decode(ids[start:i].tolist(), skip_special_tokens=False))
            start = None
    return runs


def test_only_the_assistant_text_and_its_end_of_turn_are_on(tmp_path):
    _, tokenizer, template = _hf(tmp_path)
    ids, mask = encode_conversation(tokenizer, template, Conversation(CONVERSATION))
    assert mask.dtype == np.bool_ and len(mask) == len(ids)
    assert _on_text(tokenizer, ids, mask) == [
        "the quick brown fox jumps<|im_end|>",
        "over the lazy dog \U0001f600\n<|im_end|>",
    ]


def test_the_mask_equals_transformers_assistant_mask(tmp_path):
    transformers = pytest.importorskip("transformers")
    directory, tokenizer, template = _hf(tmp_path)
    reference = transformers.AutoTokenizer.from_pretrained(str(directory))
    out = reference.apply_chat_template(
        CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = encode_conversation(tokenizer, template, Conversation(CONVERSATION))
    assert ids.tolist() == list(out["input_ids"])
    assert mask.astype(int).tolist() == list(out["assistant_masks"])


def test_trailing_scaffolding_after_the_end_of_turn_is_off(tmp_path):
    template = ChatTemplate(byte_chat_template().source, "test", {"eos_token": "<|eos|>"})
    text, spans = assistant_spans(template, Conversation(CONVERSATION[1:3]))
    assert [text[s.start : s.stop] for s in spans] == ["the quick brown fox jumps<|eos|>"]
    assert text.endswith("<|eos|>\n")


def test_the_byte_tokenizer_masks_the_answer_bytes_and_its_eos():
    tokenizer = ByteTokenizer()
    ids, mask = encode_conversation(tokenizer, byte_chat_template(), Conversation(CONVERSATION))
    on = ids[mask]
    assert on.tolist().count(tokenizer.eos_id) == 2 and ids.tolist().count(tokenizer.eos_id) == 2
    answers = bytes(i for i in on.tolist() if i < 256).decode("utf-8")
    assert answers == "the quick brown fox jumpsover the lazy dog \U0001f600\n"
    # Everything else is the rendered text, byte for byte.
    text = byte_chat_template().render(CONVERSATION)
    assert bytes(i for i in ids.tolist() if i < 256) == text.replace("<|eos|>", "").encode()


def test_a_prompt_completion_record_trains_on_the_completion_only():
    record = {"prompt": "What is 2+2?", "completion": "4"}
    conversation = conversation_of(record, "f.jsonl:1")
    assert conversation.messages == [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    ids, mask = encode_conversation(ByteTokenizer(), byte_chat_template(), conversation)
    assert ids[mask].tolist() == [ord("4"), ByteTokenizer.eos_id]


def test_conversational_prompt_completion_leaves_prompt_assistant_turns_off():
    record = {"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:]}
    conversation = conversation_of(record, "f.jsonl:1")
    assert conversation.messages == CONVERSATION and conversation.num_prompt_messages == 4
    ids, mask = encode_conversation(ByteTokenizer(), byte_chat_template(), conversation)
    answer = bytes(i for i in ids[mask].tolist() if i < 256).decode("utf-8")
    assert answer == "over the lazy dog \U0001f600\n"


def test_a_template_that_drops_earlier_content_refuses_the_conversation():
    # Like templates that drop the reasoning of earlier turns, but here all of their text:
    # an earlier assistant turn writes nothing to train on.
    rewriting = (
        "{% for m in messages %}{{ m['role'] }}: "
        "{% if loop.last %}{{ m['content'] }}{% else %}...{% endif %}\n{% endfor %}"
    )
    template = ChatTemplate(rewriting, "rewriting.jinja")
    conversation = Conversation(CONVERSATION[1:4], where="f.jsonl:3")
    with pytest.raises(ConversationRefused) as info:
        encode_conversation(ByteTokenizer(), template, conversation)
    message = str(info.value)
    assert message.startswith("f.jsonl:3: message 1, an assistant turn, cannot be found")
    assert message.endswith("the template does not write its content")


def test_a_turn_written_otherwise_once_later_turns_follow_is_masked_where_it_stands():
    # Like Qwen3, which writes an empty reasoning block into the last assistant turn only.
    template = ChatTemplate(
        "{% for m in messages %}<|{{ m['role'] }}|>\n"
        "{% if loop.last and m['role'] == 'assistant' %}(final) {% endif %}"
        "{{ m['content'] }}{% if m['role'] == 'assistant' %}<|eos|>{% endif %}"
        "{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
        "rewriting.jinja",
    )
    messages = CONVERSATION[1:3] + [CONVERSATION[1], CONVERSATION[2]]
    ids, mask = encode_conversation(ByteTokenizer(), template, Conversation(messages))
    eos = ByteTokenizer.eos_id
    on = bytes(i for i in ids[mask].tolist() if i < 256).decode()
    assert on == "the quick brown fox jumps" + "(final) the quick brown fox jumps"
    assert ids[mask].tolist().count(eos) == 2 and not mask[-1]


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        ({"messages": [{"role": "bot", "content": "hi"}]}, "message 0 has role 'bot'; expected"),
        ({"messages": []}, "expected a non-empty list of messages, found an empty list"),
        ({"messages": "hello"}, "expected a non-empty list of messages, found str"),
        ({"messages": [{"role": "user"}]}, r"message 0 \(user\): content is missing"),
        ({"messages": [{"role": "user", "content": 3}]}, "content is int, not a string"),
        ({"messages": ["hi"]}, "message 0 is str, not an object"),
        ({"text": "hi"}, r"no 'messages' field and no 'prompt' and 'completion' fields \(keys"),
        ({"prompt": "q", "completion": ["a"]}, "'prompt' is str and 'completion' list"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message to train on"),
        ({"prompt": [CONVERSATION[2]], "completion": [CONVERSATION[1]]}, "no assistant message"),
        (["a list"], "expected a JSON object, found list"),
    ],
)
def test_bad_conversations_name_the_file_and_line(record, expected):
    with pytest.raises(DataError, match=expected) as info:
        conversation_of(record, "chats.jsonl:7")
    assert str(info.value).startswith("chats.jsonl:7")


def test_the_messages_field_can_be_renamed():
    record = {"conversation": CONVERSATION[1:3]}
    assert conversation_of(record, "f", "conversation").messages == CONVERSATION[1:3]


def test_a_tokenizer_without_offsets_is_refused():
    class Plain(ByteTokenizer):
        identity = "plain"

    with pytest.raises(DataError, match="tokenizer plain: conversations need token offsets"):
        encode_conversation(Plain(), byte_chat_template(), Conversation(CONVERSATION))


def test_null_keys_are_dropped_as_transformers_drops_them():
    messages = [{"role": "user", "content": "hi", "name": None}, CONVERSATION[2]]
    conversation = conversation_of({"messages": messages}, "f")
    assert conversation.messages[0] == {"role": "user", "content": "hi"}
    with pytest.raises(DataError, match=r"message 0 \(user\): content is missing"):
        conversation_of({"messages": [{"role": "user", "content": None}]}, "f")
