"""Reward functions: exact_answer compares the last numbers as values, regex matches (and
checks its capture group against the answer), 'module:function' imports the user's own, and
every mistake in grpo.reward / grpo.reward_pattern is a ConfigError saying what to do."""

from __future__ import annotations

import math
import sys

import pytest

from kempnerforge.core.errors import ConfigError
from kempnerforge.training.objectives import REWARDS, checked_reward, exact_answer, load_reward


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("37 + 5 = 42.", "37 + 5 = 42.", 1.0),
        ("The answer is 42", "42", 1.0),
        ("so it is 42.", "42", 1.0),  # a sentence's final period is not a decimal point
        ("37 + 5 = 43.", "37 + 5 = 42.", 0.0),
        ("5 - 17 = -12.", "-12", 1.0),
        ("5 - 17 = 12.", "-12", 0.0),
        ("it costs 3.50", "3.5", 1.0),
        ("it costs 3.05", "3.5", 0.0),
        ("1,234 apples", "1234", 1.0),
        ("1234 apples", "1,234", 1.0),
        ("12,34", "34", 1.0),  # not a thousands comma: two numbers
        ("5-3=2", "2", 1.0),  # a minus after a digit is an operator
        ("first 42 then 7", "42", 0.0),  # the last number counts
        ("I do not know", "42", 0.0),  # no number in the completion
        ("", "42", 0.0),
        ("  Paris \n", "Paris", 1.0),  # an answer with no number: the stripped texts
        ("paris", "Paris", 0.0),
    ],
)
def test_exact_answer(completion, answer, reward):
    assert exact_answer(completion, answer, "What is it?") == reward
    assert load_reward("exact_answer", "")(completion, answer, "") == reward


@pytest.mark.parametrize(
    ("pattern", "completion", "answer", "reward"),
    [
        (r"= (-?\d+)\.", "37 + 5 = 42.", "42", 1.0),
        (r"= (-?\d+)\.", "37 + 5 = 41.", "42", 0.0),
        (r"= (-?\d+)\.", "no equation", "42", 0.0),
        (r"answer: (.*)", "answer:  Paris ", " Paris", 1.0),  # both sides stripped
        (r"answer: (\S+)", "answer: 1,234", "1234", 1.0),  # equal as numbers
        (r"answer: (\S+)", "answer: 42.0", "42.", 1.0),
        (r"answer: (\S+)", "answer: 43", "42", 0.0),
        (r"(x)?done", "done", "x", 0.0),  # the group took no part in the match
        (r"<answer>", "so <answer> here", "anything", 1.0),  # no group: a match is enough
        (r"<answer>", "so here", "anything", 0.0),
    ],
)
def test_regex(pattern, completion, answer, reward):
    assert load_reward("regex", pattern)(completion, answer, "prompt") == reward


def test_a_regex_pattern_is_compiled_once(monkeypatch):
    import re

    compiled = []
    real_compile = re.compile
    monkeypatch.setattr(re, "compile", lambda p, *a: compiled.append(p) or real_compile(p, *a))
    reward = load_reward("regex", r"= (\d+)")
    for _ in range(3):
        reward("1 + 1 = 2", "2", "")
    assert compiled == [r"= (\d+)"]


def test_regex_needs_a_valid_non_empty_pattern():
    for empty in ("", "  "):
        with pytest.raises(ConfigError) as raised:
            load_reward("regex", empty)
        assert raised.value.field == "grpo.reward_pattern"
        assert "a non-empty regular expression" in str(raised.value)
    with pytest.raises(ConfigError) as raised:
        load_reward("regex", "= (\\d+")
    assert raised.value.field == "grpo.reward_pattern"
    assert "missing ), unterminated subpattern" in str(raised.value)


def test_an_unknown_name_lists_the_built_ins_and_module_function():
    with pytest.raises(ConfigError) as raised:
        load_reward("exact_answr", "")
    message = str(raised.value)
    assert raised.value.field == "grpo.reward"
    assert "exact_answer, regex" in message and "'module:function'" in message
    assert "did you mean 'exact_answer'?" in message
    assert REWARDS.names() == ["exact_answer", "regex"]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module of the user's own on sys.path, with a reward, a non-callable and a reward
    that returns what a reward must not."""
    (tmp_path / "my_rewards.py").write_text(
        "def length_bonus(completion, answer, prompt):\n"
        "    return len(completion) / 10\n"
        "def says_yes(completion, answer, prompt):\n"
        "    return completion == 'yes'\n"
        "def broken(completion, answer, prompt):\n"
        "    return completion\n"
        "THRESHOLD = 0.5\n",
        encoding="utf-8",
    )
    (tmp_path / "needs_missing.py").write_text("import not_installed_dep\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("my_rewards", "needs_missing"):
        sys.modules.pop(name, None)


def test_module_function_is_imported_and_called(user_module):
    reward = load_reward("my_rewards:length_bonus", "")
    assert reward("abcde", "x", "p") == 0.5
    assert checked_reward(reward, "abcde", "x", "p", "step 3") == 0.5


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("no_such_module_here:f", "cannot import 'no_such_module_here'"),
        ("no_such_module_here:f", "is its directory the working directory"),
        ("needs_missing:f", "No module named 'not_installed_dep'"),
        ("my_rewards:lenght_bonus", "no attribute 'lenght_bonus' in 'my_rewards'"),
        ("my_rewards:lenght_bonus", "did you mean 'length_bonus'?"),
        ("my_rewards:THRESHOLD", "my_rewards.THRESHOLD is a float, not a function"),
        ("my_rewards:", "expected exactly one ':'"),
        (":length_bonus", "expected exactly one ':'"),
        ("my_rewards:a:b", "expected exactly one ':'"),
    ],
)
def test_module_function_errors_say_what_to_do(user_module, spec, says):
    with pytest.raises(ConfigError) as raised:
        load_reward(spec, "")
    assert raised.value.field == "grpo.reward"
    assert says in str(raised.value)
    assert "importable from sys.path" in str(raised.value)


def test_a_missing_dependency_is_not_blamed_on_sys_path(user_module):
    with pytest.raises(ConfigError) as raised:
        load_reward("needs_missing:f", "")
    assert "is its directory the working directory" not in str(raised.value)


def test_checked_reward_takes_numbers_and_bools(user_module):
    says_yes = load_reward("my_rewards:says_yes", "")
    assert checked_reward(says_yes, "yes", "", "", "step 1") == 1.0
    assert checked_reward(says_yes, "no", "", "", "step 1") == 0.0
    assert checked_reward(lambda c, a, p: 2, "", "", "", "step 1") == 2.0


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, None, "1.0", [1.0]])
def test_checked_reward_refuses_what_is_not_a_finite_number(value):
    with pytest.raises(ValueError) as raised:
        checked_reward(lambda c, a, p: value, "c", "a", "p", "step 7, completion 2")
    assert str(raised.value) == (
        f"step 7, completion 2: the reward function returned {value!r}; a reward is a finite number"
    )


def test_checked_reward_names_a_user_function_returning_text(user_module):
    broken = load_reward("my_rewards:broken", "")
    with pytest.raises(ValueError, match="returned 'oops'; a reward is a finite number"):
        checked_reward(broken, "oops", "", "", "step 1")
