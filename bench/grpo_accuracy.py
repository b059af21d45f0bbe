"""Held-out accuracy of checkpoints on a prompt corpus: each prompt answered greedily, scored by
a reward (the exact-answer checker by default), for the GRPO recipe's curve
(configs/train/grpo_arithmetic.toml).

Each checkpoint's model is loaded as `generate` loads one (weights only, one process) and
decodes every prompt's completion with the rollouts' own decoder at temperature 0 (argmax),
stopping at the chat template's end of turn or EOS; the accuracy is the mean reward.

    python bench/grpo_accuracy.py --prompts data/prompts-eval --count 200 \
        runs/sft-chat/checkpoints/step_1200 runs/grpo-arithmetic/checkpoints/step_20 ...

Prints one JSON line per checkpoint: its path, step, the prompts scored and the accuracy.
"""

from __future__ import annotations

import argparse
import json

import torch

from kempnerforge.data.chat import end_of_turn_ids, load_chat_template
from kempnerforge.data.dataset import MemoryMappedDataset
from kempnerforge.data.tokenizer import load_tokenizer
from kempnerforge.training.inference.loading import load_for_inference, open_for_inference
from kempnerforge.training.objectives.rewards import checked_reward, load_reward
from kempnerforge.training.objectives.rollouts import prompts_of
from kempnerforge.training.objectives.sampling import Decoding, decode_completions


def accuracy(checkpoint: str, prompts_dir: str, count: int, reward_name: str) -> dict:
    job = open_for_inference("generate", checkpoint, validate=False)
    model = load_for_inference(job)
    config = job.config
    seq_len = config.train.seq_len
    dataset = MemoryMappedDataset(prompts_dir, seq_len)
    windows = [dataset[i] for i in range(min(count, len(dataset)))]
    batch = {k: torch.stack([w[k] for w in windows]) for k in ("input_ids", "labels")}
    prompts = prompts_of(batch)
    tokenizer = load_tokenizer(config.data.tokenizer)
    stops = end_of_turn_ids(tokenizer, load_chat_template(config.data.tokenizer))
    decoding = Decoding(
        max_new_tokens=config.grpo.max_new_tokens,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        stop_ids=frozenset({*stops, tokenizer.eos_id}),
        pad_id=tokenizer.pad_id,
        width=seq_len,
        rows_per_forward=64,
    )
    rows = [p.ids for p in prompts]
    with torch.no_grad():
        completions = decode_completions(
            model, rows, [0] * len(rows), decoding, job.runtime.device, None
        )
    reward = load_reward(reward_name, config.grpo.reward_pattern)
    scores = []
    for prompt, completion in zip(prompts, completions, strict=True):
        text = completion[:-1] if completion and completion[-1] in decoding.stop_ids else completion
        scores.append(
            checked_reward(
                reward, tokenizer.decode(text), tokenizer.decode(prompt.answer_ids),
                tokenizer.decode(prompt.ids), checkpoint,
            )
        )  # fmt: skip
    return {
        "checkpoint": checkpoint,
        "step": job.step,
        "prompts": len(scores),
        "accuracy": sum(scores) / max(len(scores), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("checkpoints", nargs="+", help="step_<N> directories or run directories")
    parser.add_argument("--prompts", required=True, help="a prepare-data --format prompts dir")
    parser.add_argument("--count", type=int, default=200, help="prompts scored (the first N)")
    parser.add_argument("--reward", default="exact_answer", help="a built-in reward's name")
    args = parser.parse_args()
    for checkpoint in args.checkpoints:
        print(json.dumps(accuracy(checkpoint, args.prompts, args.count, args.reward)), flush=True)


if __name__ == "__main__":
    main()
