"""`kempnerforge generate --chat`: its arguments, the conversation it reads, the prompt the
chat template gives, the ids that end the reply, and the template an export carries."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import torch

from kempnerforge.cli import main
from kempnerforge.commands.generate import add_generate_arguments, check_arguments
from kempnerforge.config.loader import load_config
from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError, DataError
from kempnerforge.data.chat.encoding import end_of_turn_ids
from kempnerforge.data.chat.template import ChatTemplate, byte_chat_template, load_chat_template
from kempnerforge.data.tokenizer import ByteTokenizer, load_tokenizer
from kempnerforge.model import Transformer, generate
from kempnerforge.training.inference.chat_prompt import chat_prompt, read_conversation
from tests.support.chat_files import CHATML, make_chat_tokenizer_dir

QUESTION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What does the fox do?"},
]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_generate_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture
def chat_tokenizer(tmp_path):
    pytest.importorskip("tokenizers")
    return str(make_chat_tokenizer_dir(tmp_path / "tok"))


# --- Arguments -----------------------------------------------------------------------------


def test_chat_and_prompt_are_one_or_the_other(capsys):
    args = parse("--checkpoint", "c", "--chat", "[]", "--json")
    assert (args.chat, args.prompt, args.json) == ("[]", None, True)
    assert parse("--checkpoint", "c", "--prompt", "x").json is False
    with pytest.raises(SystemExit) as info:
        parse("--checkpoint", "c", "--prompt", "x", "--chat", "[]")
    assert info.value.code == 2
    assert "argument --chat: not allowed with argument --prompt" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        parse("--checkpoint", "c")
    assert info.value.code == 2
    assert "one of the arguments --prompt --chat is required" in capsys.readouterr().err


def test_the_command_line_refuses_neither_or_both_with_code_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "--checkpoint", "c"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "one of the arguments --prompt --chat is required" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "field"),
    [(["--chat", "[]", "--bos"], "--bos"), (["--chat", "[]", "--no-bos"], "--no-bos")],
)
def test_bos_options_are_refused_with_chat(argv, field):
    with pytest.raises(ConfigError) as info:
        check_arguments(parse("--checkpoint", "c", *argv))
    assert info.value.field == field
    assert "the chat template writes the start of the conversation" in str(info.value)


def test_json_needs_chat():
    with pytest.raises(ConfigError) as info:
        check_arguments(parse("--checkpoint", "c", "--prompt", "x", "--json"))
    assert str(info.value) == (
        "--json = True: expected --chat CONVERSATION beside it (--prompt prints plain text)"
    )


def test_a_bad_conversation_exits_2_in_one_line_before_the_checkpoint_is_read(capsys):
    code = main(["generate", "--checkpoint", "nowhere", "--chat", '[{"role": "bot"}]'])
    err = capsys.readouterr().err
    assert code == 2 and "\n" not in err.strip()
    assert "--chat: message 0 has role 'bot'; expected one of system" in err


# --- The conversation ----------------------------------------------------------------------


def test_a_conversation_is_json_text_or_a_json_file(tmp_path):
    assert read_conversation(json.dumps(QUESTION)) == QUESTION
    assert read_conversation(json.dumps({"messages": QUESTION})) == QUESTION
    path = tmp_path / "chat.json"
    path.write_text(json.dumps({"messages": QUESTION}))
    assert read_conversation(str(path)) == QUESTION
    # Null keys are dropped, as prepare-data drops them.
    assert read_conversation('  [{"role": "user", "content": "hi", "name": null}]') == [
        {"role": "user", "content": "hi"}
    ]


def test_conversation_errors_name_chat_and_the_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        read_conversation(str(tmp_path / "missing.json"))
    assert info.value.field == "--chat" and "no such file" in str(info.value)
    with pytest.raises(DataError, match=r"^--chat: not valid JSON \(.*\); expected a JSON list"):
        read_conversation("[{'role': 'user'}]")
    with pytest.raises(DataError, match=r"^--chat: an object without 'messages' \(keys: a\)"):
        read_conversation('{"a": 1}')
    with pytest.raises(DataError, match=r"^--chat: expected a non-empty list of messages"):
        read_conversation("[]")
    path = tmp_path / "chat.json"
    path.write_text('[{"role": "user", "content": 3}]')
    with pytest.raises(DataError) as error:
        read_conversation(str(path))
    assert str(error.value) == f"--chat {path}: message 0 (user): content is int, not a string"


# --- End of turn ---------------------------------------------------------------------------


def test_chatml_turns_end_at_im_end_the_configs_eos(chat_tokenizer):
    import tokenizers

    raw = tokenizers.Tokenizer.from_file(f"{chat_tokenizer}/tokenizer.json")
    tokenizer = load_tokenizer(chat_tokenizer)
    stops = end_of_turn_ids(tokenizer, load_chat_template(chat_tokenizer))
    # tokenizer_config.json names <|im_end|> as eos_token (as Qwen's does), so EOS is it,
    # not <|endoftext|>, which the vocabulary also has.
    assert stops == {raw.token_to_id("<|im_end|>")}
    assert tokenizer.eos_id == raw.token_to_id("<|im_end|>")


def test_byte_template_turns_end_at_eos():
    assert end_of_turn_ids(ByteTokenizer(), byte_chat_template()) == {ByteTokenizer.eos_id}


@pytest.mark.parametrize(
    "source",
    [
        # Turns end with ordinary text: only EOS stops (a newline inside a reply must not).
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n\\n' }}{% endfor %}",
        # The reply is rewritten, so it cannot be found.
        "{% for m in messages %}{{ m['content'] | upper }}{{ eos_token }}{% endfor %}",
        # The template refuses a one-turn conversation.
        "{{ raise_exception('needs a system turn') }}",
    ],
)
def test_a_template_without_an_end_of_turn_token_stops_at_eos_only(source):
    template = ChatTemplate(source, "test", {"eos_token": "<|eos|>"})
    assert end_of_turn_ids(ByteTokenizer(), template) == {ByteTokenizer.eos_id}


def test_a_special_token_after_whitespace_ends_the_turn():
    source = "{% for m in messages %}{{ m['content'] + '  ' + bos_token }}{% endfor %}"
    template = ChatTemplate(source, "test", {"bos_token": "<|bos|>"})
    assert end_of_turn_ids(ByteTokenizer(), template) == {ByteTokenizer.bos_id, 257}


@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_stops_before_any_of_the_stop_ids(use_cache):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(dim=32, n_layers=2, n_heads=2, vocab_size=64, max_seq_len=40))
    prompt = [3, 1, 4, 1, 5]
    tokens = generate(model, prompt, 30, temperature=0, use_cache=use_cache)
    first, second = tokens[3], tokens[6]
    end = min(tokens.index(first), tokens.index(second))  # the first of either
    for kwargs in ({"stop_ids": {first, second}}, {"stop_id": first, "stop_ids": [second]}):
        stopped = generate(model, prompt, 30, temperature=0, use_cache=use_cache, **kwargs)
        assert stopped == tokens[:end]
    assert generate(model, prompt, 30, temperature=0, use_cache=use_cache, stop_ids=()) == tokens


# --- The prompt ----------------------------------------------------------------------------


def test_the_prompt_is_the_templates_render_with_the_assistant_turn_opened(chat_tokenizer):
    transformers = pytest.importorskip("transformers")
    config = load_config(None, [f"--data.tokenizer={chat_tokenizer}", "--model.vocab_size=300"])
    tokenizer = load_tokenizer(chat_tokenizer)
    prompt = chat_prompt(tokenizer, config.model, config.data, QUESTION, max_new_tokens=10)
    hf = transformers.AutoTokenizer.from_pretrained(chat_tokenizer)
    expected = hf.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert expected.endswith("<|im_start|>assistant\n")
    assert prompt.ids == hf(expected, add_special_tokens=False)["input_ids"]
    assert prompt.max_new_tokens == 10
    assert prompt.stop_ids == {hf.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_id}


def test_the_byte_prompt_and_a_prompt_past_the_context(tmp_path):
    config = load_config(None, ["--model.max_seq_len=128"])
    prompt = chat_prompt(ByteTokenizer(), config.model, config.data, QUESTION, max_new_tokens=99)
    text = "<|system|>\nAnswer briefly.\n<|user|>\nWhat does the fox do?\n<|assistant|>\n"
    assert prompt.ids == list(text.encode()) and prompt.stop_ids == {257}
    assert prompt.max_new_tokens == 128 - len(text) < 99
    long = [{"role": "user", "content": "x" * 200}]
    with pytest.raises(ConfigError) as info:
        chat_prompt(ByteTokenizer(), config.model, config.data, long, max_new_tokens=1)
    assert info.value.field == "--chat" and "fewer than model.max_seq_len = 128" in str(info.value)


def test_a_tokenizer_without_a_template_is_named(tmp_path):
    pytest.importorskip("tokenizers")
    folder = make_chat_tokenizer_dir(tmp_path / "plain", template=None)
    config = load_config(None, [f"--data.tokenizer={folder}", "--model.vocab_size=300"])
    with pytest.raises(DataError, match="the tokenizer has no chat template"):
        chat_prompt(
            load_tokenizer(str(folder)), config.model, config.data, QUESTION, max_new_tokens=1
        )


# --- Export --------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["config", "jinja", "lone_file"])
def test_an_export_renders_the_template_as_kempnerforge_does(tmp_path, layout):
    transformers = pytest.importorskip("transformers")
    from kempnerforge.interop.hf import export_hf

    source = make_chat_tokenizer_dir(tmp_path / "tok", CHATML, template_file=layout == "jinja")
    spec = str(source / "tokenizer.json") if layout == "lone_file" else str(source)
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=2, vocab_size=300, max_seq_len=32)
    folder = export_hf(Transformer(cfg), cfg, tmp_path / "hf", spec)
    if layout == "lone_file":
        assert (folder / "chat_template.jinja").read_text() == CHATML
    loaded = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = load_chat_template(spec).render(QUESTION, add_generation_prompt=True)
    assert loaded.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False) == ours
    # transformers' generate stops where generate --chat does: at <|im_end|>, the template's
    # end of turn and the config's EOS.
    generation = transformers.GenerationConfig.from_pretrained(str(folder))
    assert generation.eos_token_id == [loaded.convert_tokens_to_ids("<|im_end|>")]
    assert loaded.eos_token == "<|im_end|>"


def test_an_export_of_a_lone_tokenizer_without_a_template_writes_none(tmp_path):
    pytest.importorskip("tokenizers")
    from kempnerforge.interop.hf import export_hf

    source = make_chat_tokenizer_dir(tmp_path / "tok", template=None)
    lone = tmp_path / "lone" / "tokenizer.json"
    lone.parent.mkdir()
    shutil.copyfile(source / "tokenizer.json", lone)
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=2, vocab_size=300, max_seq_len=32)
    folder = export_hf(Transformer(cfg), cfg, tmp_path / "hf", str(lone))
    assert not (folder / "chat_template.jinja").exists()
    assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())
    assert not (folder / "generation_config.json").exists()
