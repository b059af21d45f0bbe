"""Example data: synthetic conversations for the fine-tuning recipe (configs/train/sft_chat.toml).

Writes ``--count`` conversations, one JSON object per line in the ``messages`` shape that
``prepare-data --format chat`` reads. Each asks for a sum or a difference of two numbers
below 100 and is answered in one fixed form, so a small model fine-tuned on them visibly
learns the assistant's format; a third of them start with a system turn and a fifth have a
second exchange. The same ``--seed`` gives the same file.

With ``--preference`` each line is a preference pair for ``prepare-data --format
preference`` instead: a question as the prompt, the right answer chosen and an answer off
by a few rejected (docs/training.md, "Preference optimisation (DPO)").

With ``--prompts`` each line is a prompt and its reference answer for ``prepare-data --format
prompts``: the question as the prompt (one user message) and the full answer (``"37 + 5 =
42."``) as the answer a reward function checks (docs/data.md, "Prompts and answers").

    python -m examples.chat_conversations --count 4000 --output data/arithmetic.jsonl
    python -m examples.chat_conversations --preference --count 2000 --output data/prefs.jsonl
    python -m examples.chat_conversations --prompts --count 2000 --output data/prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

SYSTEM = "You are a calculator. Answer with the equation."


def exchange(rng: random.Random) -> list[dict[str, str]]:
    """One question and its answer."""
    a, b = rng.randrange(100), rng.randrange(100)
    if rng.random() < 0.5:
        question, answer = f"What is {a} + {b}?", f"{a} + {b} = {a + b}."
    else:
        a, b = max(a, b), min(a, b)
        question, answer = f"What is {a} - {b}?", f"{a} - {b} = {a - b}."
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def conversation(rng: random.Random) -> dict[str, list[dict[str, str]]]:
    messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 1 / 3 else []
    messages += exchange(rng)
    if rng.random() < 0.2:
        messages += exchange(rng)
    return {"messages": messages}


def preference_pair(rng: random.Random) -> dict[str, list[dict[str, str]]]:
    """A question, its right answer (chosen) and the same answer off by 1 to 9 (rejected)."""
    question, answer = exchange(rng)
    left, right = answer["content"].rstrip(".").split(" = ")
    wrong = int(right) + rng.choice([-1, 1]) * rng.randrange(1, 10)
    rejected = {"role": "assistant", "content": f"{left} = {wrong}."}
    return {"prompt": [question], "chosen": [answer], "rejected": [rejected]}


def prompt_row(rng: random.Random) -> dict[str, Any]:
    """A question (one user message) and its full answer, the text a reward checks."""
    question, answer = exchange(rng)
    return {"prompt": [question], "answer": answer["content"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--count", type=int, default=4000, help="conversations to write")
    parser.add_argument("--output", required=True, help="the .jsonl file to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--preference",
        action="store_true",
        help="write preference pairs (prompt, chosen, rejected)",
    )
    parser.add_argument(
        "--prompts",
        action="store_true",
        help="write prompts and their reference answers (prompt, answer)",
    )
    args = parser.parse_args()
    if args.preference and args.prompts:
        parser.error("--preference and --prompts write different files; give one")
    make: Callable[[random.Random], dict[str, Any]] = conversation
    kind = "conversations"
    if args.preference:
        make, kind = preference_pair, "preference pairs"
    elif args.prompts:
        make, kind = prompt_row, "prompts"
    rng = random.Random(args.seed)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("w", encoding="utf-8") as f:
        for _ in range(args.count):
            f.write(json.dumps(make(rng)) + "\n")
    print(f"wrote {args.count} {kind} to {output}")


if __name__ == "__main__":
    main()
