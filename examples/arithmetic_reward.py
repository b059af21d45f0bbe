"""Example reward for the GRPO recipe (configs/train/grpo_arithmetic.toml): the exact-answer
check, plus partial credit for restating the question's equation.

A model fine-tuned for a few minutes rarely gets a sum right, so the exact-answer reward
alone is 0 for nearly every completion and a group's advantages are all 0: nothing to
learn from. Crediting the first half of the answer's form, the question's own operands
("37 + 5 = "), gives the groups rewards that differ, and an answer written after the right
operands is the one that can be right. Named in the config as
``grpo.reward = "examples.arithmetic_reward:reward"``.
"""

from __future__ import annotations

import re

from kempnerforge.training.objectives import exact_answer

EQUATION = re.compile(r"(-?\d+)\s*([+-])\s*(-?\d+)\s*=")
OPERANDS_CREDIT = 0.25
"""The reward of a completion that restates the question's operands and operator but
answers wrong; a right answer scores 1 + this."""


def reward(completion: str, answer: str, prompt: str) -> float:
    """exact_answer, plus OPERANDS_CREDIT when the completion's equation starts with the
    operands and operator of the prepared answer's."""
    del prompt
    wanted, written = EQUATION.search(answer), EQUATION.search(completion)
    restated = wanted is not None and written is not None and wanted.groups() == written.groups()
    return exact_answer(completion, answer, "") + OPERANDS_CREDIT * restated
