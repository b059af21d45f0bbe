"""Reward functions of verifiable-reward training: a completion scored against the reference
answer of its prompt (prepare-data --format prompts), chosen by grpo.reward: a built-in of
REWARDS or a user's 'module:function'."""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable
from decimal import Decimal
from typing import Any, cast

from kempnerforge.config.imports import import_named
from kempnerforge.config.registry import Registry
from kempnerforge.core.errors import ConfigError

RewardFn = Callable[[str, str, str], float]
"""``fn(completion, answer, prompt)``: the decoded completion (its end-of-turn token left
out), the reference answer's text and the decoded prompt -> the completion's reward."""
RewardBuilder = Callable[[str], RewardFn]
"""Builds a built-in reward from grpo.reward_pattern (which only 'regex' reads)."""

REWARDS: Registry[RewardBuilder] = Registry("grpo.reward")

# A number as answers write it: an optional minus that does not follow a word or a closing
# bracket (so "5-3" is 5 and 3), digits with or without thousands commas, an optional
# fraction. A period with no digit after it ends a sentence, not the number ("= 42.").
NUMBER = re.compile(r"(?:(?<![\w)\]])-)?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
_IMPORTABLE = "a built-in reward or 'module:function' with the module importable from sys.path"


def parse_number(text: str) -> Decimal | None:
    """The value of ``text`` when it is one number (surrounding spaces and a sentence's
    final period allowed), else None."""
    stripped = text.strip()
    if stripped.endswith(".") and not stripped.endswith(".."):
        stripped = stripped[:-1]
    return _value(stripped) if NUMBER.fullmatch(stripped) else None


def last_number(text: str) -> Decimal | None:
    """The value of the last number written in ``text``, or None when it has none."""
    found = NUMBER.findall(text)
    return _value(found[-1]) if found else None


def _value(number: str) -> Decimal:
    # Decimal compares values, not spellings: 3.50 == 3.5 and -0 == 0.
    return Decimal(number.replace(",", ""))


@REWARDS.register("exact_answer")
def build_exact_answer(pattern: str) -> RewardFn:
    """exact_answer (grpo.reward_pattern is not read)."""
    return exact_answer


def exact_answer(completion: str, answer: str, prompt: str) -> float:
    """1.0 when the last number of the completion equals the last number of the answer (as
    values: "1,234" is 1234, "3.50" is 3.5), else 0.0; an answer without a number must
    equal the completion once both are stripped."""
    expected = last_number(answer)
    if expected is None:
        return float(completion.strip() == answer.strip())
    got = last_number(completion)
    return float(got is not None and got == expected)


@REWARDS.register("regex")
def build_regex(pattern: str) -> RewardFn:
    """A reward that searches the completion for ``pattern``, compiled once.

    Without a capture group a match scores 1.0. With one, group 1 (stripped) must equal the
    answer (stripped), or both parse as the same number. A bad pattern is a ConfigError on
    grpo.reward_pattern.
    """
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise ConfigError(
            "grpo.reward_pattern", pattern, "a Python regular expression", str(exc)
        ) from None

    def regex_reward(completion: str, answer: str, prompt: str) -> float:
        match = compiled.search(completion)
        if match is None:
            return 0.0
        if compiled.groups == 0:
            return 1.0
        got = match.group(1)
        if got is None:  # an optional group that took no part in the match
            return 0.0
        if got.strip() == answer.strip():
            return 1.0
        value, expected = parse_number(got), parse_number(answer)
        return float(value is not None and value == expected)

    return regex_reward


def load_reward(name: str, pattern: str) -> RewardFn:
    """The reward grpo.reward names: a built-in of REWARDS (built with ``pattern``, which
    'regex' needs), or 'module:function', imported once here. A ConfigError on grpo.reward
    or grpo.reward_pattern says what to change."""
    if ":" in name:
        return _import_reward(name)
    if name == "regex" and not pattern.strip():
        raise ConfigError(
            "grpo.reward_pattern",
            pattern,
            "a non-empty regular expression with grpo.reward = 'regex'",
            "e.g. '= (-?[0-9]+)' scores a completion whose captured number equals the answer",
        )
    try:
        builder = REWARDS.get(name)
    except ConfigError as exc:
        allowed = f"{exc.allowed}, or 'module:function' naming your own"
        raise ConfigError(exc.field, name, allowed, exc.hint) from None
    return builder(pattern)


def _import_reward(spec: str) -> RewardFn:
    """The function 'module:function' names. Modules are looked up as train.hooks looks
    them up: sys.path, with the working directory first, as ``python -m`` has it."""
    fn: Any = import_named("grpo.reward", spec, _IMPORTABLE)
    if not callable(fn):
        hint = (
            f"{spec.replace(':', '.')} is a {type(fn).__name__}, not a function; define "
            "def reward(completion: str, answer: str, prompt: str) -> float"
        )
        raise ConfigError("grpo.reward", spec, _IMPORTABLE, hint)
    return cast(RewardFn, fn)  # its return values are checked per call (checked_reward)


def checked_reward(fn: RewardFn, completion: str, answer: str, prompt: str, where: str) -> float:
    """``fn(completion, answer, prompt)`` as a float, or ValueError naming ``where`` when it
    is not a finite number (True and False count as 1.0 and 0.0)."""
    value = fn(completion, answer, prompt)
    if isinstance(value, numbers.Real) and math.isfinite(value):
        return float(value)
    raise ValueError(
        f"{where}: the reward function returned {value!r}; a reward is a finite number"
    )
