"""A GRPO reward for tests (grpo.reward = "tests.support.rewards:digits"): varied values for
an untrained model's completions, which answer no sum right, so a group's advantages are not
all 0."""

from __future__ import annotations


def digits(completion: str, answer: str, prompt: str) -> float:
    """How many digits the completion holds, mod 3, plus a quarter for an odd length."""
    del answer, prompt
    return float(sum(c.isdigit() for c in completion) % 3) + 0.25 * (len(completion) % 2)
