"""Chat templates: where a tokenizer's template comes from, and rendering a conversation with it
exactly as Hugging Face transformers' ``apply_chat_template`` does.

The Jinja environment below matches transformers 5's (sandboxed, trim_blocks, lstrip_blocks,
the loop controls, ``raise_exception``, a ``tojson`` that does not escape HTML,
``strftime_now``, a ``namespace`` that refuses underscore names, a plain ``dict``), and a
message's reasoning is passed under each name transformers passes it, so a template written
for a model renders here the text it renders there; transformers itself is not needed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from kempnerforge.core.errors import DataError
from kempnerforge.data.tokenizer import TOKENIZER_CONFIG, read_json_object, read_special_tokens

TEMPLATE_FILE = "chat_template.jinja"
# The names transformers gives a message's reasoning, in the order it looks for one; it passes
# the first found as both 'reasoning_content' (what templates read) and 'thinking'.
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")

# The byte tokenizer's texts for its BOS and EOS ids: in a rendered conversation these strings
# are encoded as the special ids, as a Hugging Face tokenizer encodes its special tokens.
BYTE_SPECIAL_TOKENS = {"<|bos|>": 256, "<|eos|>": 257}
# The built-in template of the byte tokenizer: a role header line per turn; an assistant turn
# ends with EOS, its end-of-turn token, so a model learns to stop.
BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template's Jinja source and the special-token variables it is rendered with.

    Plain data, so it travels to prepare-data's worker processes; the compiled template is
    cached per source.
    """

    source: str
    """The Jinja text of the template."""
    where: str
    """Where the template was found (a file, or 'built-in'), for error messages."""
    variables: dict[str, str] = field(default_factory=dict)
    """bos_token, eos_token, ... as the tokenizer names them."""

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The text of ``messages``, as ``apply_chat_template(tokenize=False)`` gives it.

        A template that rejects the conversation (``raise_exception``) or fails raises
        DataError naming the template; callers add where the conversation came from.
        """
        import jinja2

        template = _compile(self.source, self.where)
        try:
            return template.render(
                messages=alias_reasoning(messages),
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.variables,
            )
        except jinja2.TemplateError as exc:
            raise DataError(f"the chat template of {self.where} refused it: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise DataError(f"the chat template of {self.where} failed on it: {exc}") from None


def byte_chat_template() -> ChatTemplate:
    """The byte tokenizer's built-in template."""
    return ChatTemplate(
        BYTE_CHAT_TEMPLATE,
        "the built-in byte template",
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>"},
    )


def load_chat_template(tokenizer_spec: str) -> ChatTemplate:
    """The chat template of ``tokenizer_spec`` ('byte', or a tokenizer.json or its directory).

    As transformers loads it: ``chat_template.jinja`` beside the tokenizer wins over the
    ``chat_template`` of tokenizer_config.json (a list of named templates gives 'default').
    Special-token variables are those the directory names (data.tokenizer's
    read_special_tokens: tokenizer_config.json, special_tokens_map.json). Raises DataError
    when there is no template, saying where it was looked for.
    """
    if tokenizer_spec == "byte":
        return byte_chat_template()
    path = Path(tokenizer_spec).expanduser()
    directory = path if path.is_dir() else path.parent
    config = read_json_object(directory / TOKENIZER_CONFIG)
    named = read_special_tokens(directory)
    variables = {name: text for name, (text, _) in named.items() if text is not None}
    jinja_file = directory / TEMPLATE_FILE
    if jinja_file.is_file():
        try:
            return ChatTemplate(jinja_file.read_text(encoding="utf-8"), str(jinja_file), variables)
        except (OSError, UnicodeDecodeError) as exc:
            raise DataError(f"{jinja_file}: cannot read the chat template ({exc})") from None
    source = _template_of_config(config.get("chat_template"), directory / TOKENIZER_CONFIG)
    if source is None:
        raise DataError(
            f"{directory}: the tokenizer has no chat template (looked for {TEMPLATE_FILE} and "
            f"'chat_template' in {TOKENIZER_CONFIG}); copy them from the model the tokenizer "
            "comes from, or write a chat_template.jinja beside tokenizer.json"
        )
    return ChatTemplate(source, str(directory / TOKENIZER_CONFIG), variables)


def alias_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with a message's reasoning under every name templates read, as
    transformers passes it: the first of REASONING_KEYS a message has becomes its
    'thinking' (placed first) and 'reasoning_content' (placed last)."""
    if not any(key in message for message in messages for key in REASONING_KEYS):
        return messages
    aliased = []
    for message in messages:
        reasoning = next((message[k] for k in REASONING_KEYS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def _template_of_config(value: Any, where: Path) -> str | None:
    """The template of a 'chat_template' entry: a string, or the 'default' of named ones."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise DataError(
            f"{where}: 'chat_template' lists templates {sorted(map(str, named))} but none named "
            "'default'; name the one to use 'default'"
        )
    raise DataError(f"{where}: 'chat_template' is {type(value).__name__}, not a string")


@lru_cache(maxsize=16)
def _compile(source: str, where: str) -> Any:
    """The compiled template, in an environment like transformers' own."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        # Unlike Jinja's own tojson, this leaves HTML characters as they are.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_make_generation_tag(), jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = _private_free_namespace()
    env.globals["dict"] = _TemplateDict()
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise DataError(
            f"{where}: the chat template is not valid Jinja (line {exc.lineno}: {exc.message})"
        ) from None


class _TemplateDict:
    """The ``dict`` a template may call: builds plain dicts, and exposes nothing else of
    the type (as transformers' own)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _private_free_namespace() -> type:
    """Jinja's ``namespace`` refusing attribute names that start with '_': a template comes
    from a model's files, and underscore names are the way into Python's internals."""
    import jinja2.exceptions
    import jinja2.utils

    def check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not set {name!r} on a namespace (names starting with '_' "
                "are refused)"
            )

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:
            # Jinja's signature: the first positional argument is the namespace itself.
            namespace, initial = args[0], dict(*args[1:], **kwargs)
            for name in initial:
                check(name)
            jinja2.utils.Namespace.__init__(namespace, initial)

        def __setitem__(self, name: str, value: Any) -> None:
            check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return Namespace


def _make_generation_tag() -> type:
    """A Jinja extension that accepts ``{% generation %}...{% endgeneration %}`` (which some
    templates use to mark assistant text) and renders its body unchanged."""
    import jinja2.ext
    import jinja2.nodes

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    return GenerationTag
