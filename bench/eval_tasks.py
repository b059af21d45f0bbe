"""Downstream task scoring on CPU: the packed scorer against one forward per choice, and
what a task costs when the training loop scores it every eval interval.

A synthetic multiple-choice task is written to a temporary directory (nothing is
downloaded): ``--examples`` examples, each a context of about ``--context-words`` made-up
words and 4 choices of 1 to 6 of them, the gold choice drawn by a seeded RNG; and a
bits-per-byte task, a few KB of the same words. The model is a configs/model preset built
with build_model (random weights: the figures are speeds, not skill), in eval mode, one
process, the byte tokenizer, ``--seq`` positions per window.

Timed, each as the median of ``--repeats`` runs after one warm-up:

- the packed scorer: load_task once (timed on its own), then evaluate_task with
  ``--batch`` windows per forward, as the training loop runs it;
- a naive loop: one forward of [BOS] + context + choice per choice (batch 1, no packing,
  cut from the left to the window as the scorer cuts it), the choice tokens' log-softmax
  summed, the likeliest choice taken; its warm-up is the first example only (every forward
  is alike, and a full pass would double the slowest part). Its accuracy must equal the
  scorer's; examples whose likeliest choice differs are listed, with their margins, as a
  warning on stderr;
- the bits-per-byte task through the packed scorer;
- one training step (forward, backward, AdamW) at ``--train-batch`` sequences of ``--seq``
  tokens, median of 3 after 1 warm-up, run last since it changes the weights. From it the
  in-loop cost share of a task scored every ``--interval`` steps:
  task_s / (interval * step_s + task_s).

Prints one JSON line with every figure and setting, then a Markdown table.

    python bench/eval_tasks.py [--model 125m] [--examples 200] [--context-words 40]
        [--seq 512] [--batch 8] [--repeats 3] [--threads N] [--train-batch 8] [--interval 100]
    python bench/eval_tasks.py --model debug --examples 20 --repeats 1   # a quick check

How long, on 2 CPU cores: the quick check above about a minute and a half; 125m with
--examples 20 --repeats 1 --seq 256 about 8 minutes (the naive loop 3.5 of them, the packed
scorer's two passes 2.5, the four training steps 1.5). The defaults (125m, 200 examples,
3 repeats, --seq 512) grow with examples times repeats: well over an hour there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from kempnerforge.config.eval import EvalTaskConfig
from kempnerforge.config.loader import load_config
from kempnerforge.config.optimizer import OptimizerConfig
from kempnerforge.data.tokenizer import ByteTokenizer
from kempnerforge.evaluation.document_start import DocumentStart
from kempnerforge.evaluation.scoring import slot_sums, whole_model_losses
from kempnerforge.evaluation.task_files import ChoiceExample, read_choice_examples
from kempnerforge.evaluation.tasks import LoadedTask, evaluate_task, load_task
from kempnerforge.model.heads.head_loss import HeadLossSpec
from kempnerforge.model.transformer import Transformer, build_model
from kempnerforge.optim.optimizer import build_optimizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = torch.device("cpu")
T = TypeVar("T")

NUM_CHOICES = 4
BPB_DOCUMENTS = 4
BPB_DOCUMENT_WORDS = 200  # about 1.2 KB a document
TRAIN_STEP_REPEATS = 3

# Two choices within this many nats of each other count as a near-tie: the packed and the
# naive forwards see the same tokens but multiply matrices of other shapes and attend
# through another kernel (a document mask, not is_causal), so fp32 rounding moves each
# token's log-probability by about 1e-6 relative, a few 1e-5 nats over a choice's tokens.
NEAR_TIE_NATS = 1e-3


def made_up_vocabulary(rng: random.Random, size: int = 2000) -> list[str]:
    """Pronounceable nonsense words of 1 to 3 consonant-vowel syllables: text the byte
    tokenizer reads like prose, with no real word a model might know."""
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    return [
        "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(rng.randint(1, 3)))
        for _ in range(size)
    ]


def words(rng: random.Random, vocabulary: list[str], count: int) -> str:
    return " ".join(rng.choice(vocabulary) for _ in range(count))


def write_choice_task(
    directory: str, rng: random.Random, vocabulary: list[str], examples: int, context_words: int
) -> str:
    """A multiple-choice JSONL file; each choice starts with the space that follows the
    context, as the task files written by convert-task do."""
    path = os.path.join(directory, "choices.jsonl")
    low, high = max(1, context_words * 3 // 4), max(1, context_words * 5 // 4)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(examples):
            record = {
                "context": words(rng, vocabulary, rng.randint(low, high)),
                "choices": [
                    " " + words(rng, vocabulary, rng.randint(1, 6)) for _ in range(NUM_CHOICES)
                ],
                "gold": rng.randrange(NUM_CHOICES),
            }
            f.write(json.dumps(record) + "\n")
    return path


def write_documents(directory: str, rng: random.Random, vocabulary: list[str]) -> str:
    """A bits-per-byte JSONL file of a few KB."""
    path = os.path.join(directory, "documents.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(BPB_DOCUMENTS):
            f.write(json.dumps({"text": words(rng, vocabulary, BPB_DOCUMENT_WORDS)}) + "\n")
    return path


def load_model(preset: str, seq_len: int) -> Transformer:
    """The preset's model with max_seq_len raised to seq_len if shorter, in eval mode."""
    cfg = load_config(os.path.join(REPO, "configs", "model", f"{preset}.toml")).model
    cfg = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, seq_len))
    torch.manual_seed(0)
    return build_model(cfg).eval()


def median_seconds(run: Callable[[], T], repeats: int) -> tuple[float, T]:
    """Median wall-clock seconds of ``repeats`` calls (the caller warms up first), and the
    last call's result."""
    seconds = []
    result = None
    for _ in range(repeats):
        began = time.perf_counter()
        result = run()
        seconds.append(time.perf_counter() - began)
    assert result is not None
    return statistics.median(seconds), result


@torch.no_grad()
def naive_logliks(
    model: Transformer, examples: list[ChoiceExample], seq_len: int
) -> tuple[torch.Tensor, int]:
    """(examples, choices) log-likelihoods of each choice given [BOS] + context, one forward
    per choice, and the positions those forwards read. A sequence longer than the window
    loses tokens at the left, as the packed scorer cuts it, so both score the same tokens."""
    tokenizer = ByteTokenizer()
    logliks = torch.zeros(len(examples), NUM_CHOICES, dtype=torch.float64)
    positions = 0
    for e, example in enumerate(examples):
        context = [tokenizer.bos_id, *tokenizer.encode(example.context)]
        for c, choice in enumerate(example.choices):
            tokens = context + tokenizer.encode(choice)
            cut = max(0, len(tokens) - 1 - seq_len)
            tokens, first_scored = tokens[cut:], max(1, len(context) - cut)
            ids = torch.tensor(tokens)
            logits = model(ids[None, :-1])[0]
            log_probs = torch.log_softmax(logits.float(), dim=-1)[first_scored - 1 :]
            targets = ids[first_scored:, None]
            logliks[e, c] = log_probs.gather(1, targets).sum().double()
            positions += len(tokens) - 1
    return logliks, positions


def packed_logliks(model: Transformer, task: LoadedTask, batch: int) -> torch.Tensor:
    """(examples, choices) log-likelihoods from the scorer's slot sums, with the arguments
    evaluate_task is timed with (this call is also its warm-up)."""
    sums = slot_sums(
        model,
        task.windows,
        task.slots,
        whole_model_losses(model, CPU, loss_chunk_tokens=0),
        device=CPU,
        dp_rank=0,
        dp_size=1,
        global_batch=batch,
        rows_per_forward=batch,
    )
    return -sums[:, 0].view(task.examples, task.choices)


def score_task(model: Transformer, task: LoadedTask, batch: int) -> dict[str, float]:
    losses = whole_model_losses(model, CPU, loss_chunk_tokens=0)
    return evaluate_task(
        model, task, losses, device=CPU, global_batch=batch, rows_per_forward=batch
    )


def disagreements(naive: torch.Tensor, packed: torch.Tensor) -> list[dict]:
    """The examples whose likeliest choice differs between the two scorings, each with the
    naive margin between its two likeliest choices (a near-tie when under NEAR_TIE_NATS)."""
    found = []
    for e in torch.nonzero(naive.argmax(1) != packed.argmax(1)).flatten().tolist():
        top_two = naive[e].topk(2).values
        margin = float(top_two[0] - top_two[1])
        found.append(
            {
                "example": e,
                "naive": [round(x, 6) for x in naive[e].tolist()],
                "packed": [round(x, 6) for x in packed[e].tolist()],
                "margin_nats": margin,
                "near_tie": margin < NEAR_TIE_NATS,
            }
        )
    return found


def train_step_seconds(model: Transformer, batch: int, seq_len: int) -> float:
    """Median seconds of one forward + backward + AdamW step on random byte tokens, the
    training's loss head (chunked) included; after one warm-up step."""
    model.train()
    optimizer = build_optimizer(model, OptimizerConfig(name="adamw", lr=3e-4))
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (batch, seq_len + 1), generator=generator)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def step() -> bool:
        optimizer.zero_grad(set_to_none=True)
        result = model(inputs, labels=labels, loss_spec=HeadLossSpec())
        (result.loss_sum / labels.numel()).backward()
        optimizer.step()
        return True

    step()
    seconds, _ = median_seconds(step, TRAIN_STEP_REPEATS)
    model.eval()
    return seconds


def cost_share(task_s: float, step_s: float, interval: int) -> float:
    """The share of a run's time spent on a task scored once every ``interval`` steps."""
    return task_s / (interval * step_s + task_s)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="125m", help="preset in configs/model")
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--context-words", type=int, default=40)
    parser.add_argument("--seq", type=int, default=512, help="positions per window")
    parser.add_argument("--batch", type=int, default=8, help="windows per packed forward")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (median reported)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0: all cores")
    parser.add_argument("--train-batch", type=int, default=8, help="sequences per train step")
    parser.add_argument("--interval", type=int, default=100, help="steps between task evals")
    parser.add_argument("--seed", type=int, default=0, help="seeds the synthetic task")
    args = parser.parse_args()
    if min(args.examples, args.context_words, args.seq, args.batch, args.repeats) < 1:
        parser.error("--examples, --context-words, --seq, --batch and --repeats must be >= 1")
    return args


def measure(args: argparse.Namespace, directory: str) -> dict:
    """Every figure of the report (see the module docstring), as one flat dict."""
    rng = random.Random(args.seed)
    vocabulary = made_up_vocabulary(rng)
    choice_path = write_choice_task(directory, rng, vocabulary, args.examples, args.context_words)
    document_path = write_documents(directory, rng, vocabulary)
    model = load_model(args.model, args.seq)
    tokenizer = ByteTokenizer()
    start = DocumentStart.of(tokenizer, bos=True)  # the naive loop's [BOS] + context

    began = time.perf_counter()
    choice_config = EvalTaskConfig(name="choices", path=choice_path)
    choices = load_task(choice_config, tokenizer, start, args.seq)
    load_s = time.perf_counter() - began
    packed = packed_logliks(model, choices, args.batch)
    packed_s, metrics = median_seconds(lambda: score_task(model, choices, args.batch), args.repeats)

    examples = read_choice_examples(choice_path)
    naive_logliks(model, examples[:1], args.seq)  # warms the same kernels at a fraction
    naive_s, (naive, positions) = median_seconds(
        lambda: naive_logliks(model, examples, args.seq), args.repeats
    )
    naive_acc = (naive.argmax(1) == choices.gold).double().mean().item()

    document_config = EvalTaskConfig(name="documents", path=document_path, kind="bits_per_byte")
    began = time.perf_counter()
    documents = load_task(document_config, tokenizer, start, args.seq)
    bpb_load_s = time.perf_counter() - began
    score_task(model, documents, args.batch)
    bpb_s, bpb_metrics = median_seconds(
        lambda: score_task(model, documents, args.batch), args.repeats
    )

    step_s = train_step_seconds(model, args.train_batch, args.seq)
    return {
        "model": args.model,
        "params": sum(p.numel() for p in model.parameters()),
        "examples": args.examples,
        "context_words": args.context_words,
        "seq": args.seq,
        "batch": args.batch,
        "repeats": args.repeats,
        "train_batch": args.train_batch,
        "interval": args.interval,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "requests": args.examples * NUM_CHOICES,
        "windows": choices.windows.rows,
        "window_fill": positions / (choices.windows.rows * args.seq),
        "truncated": choices.windows.truncated,
        "load_s": load_s,
        "packed_s": packed_s,
        "packed_examples_per_s": args.examples / packed_s,
        "naive_s": naive_s,
        "naive_examples_per_s": args.examples / naive_s,
        "packed_over_naive": naive_s / packed_s,
        "packed_acc": metrics["eval/choices/acc"],
        "packed_acc_norm": metrics["eval/choices/acc_norm"],
        "naive_acc": naive_acc,
        "max_loglik_diff_nats": float((naive - packed).abs().max()),
        "disagreements": disagreements(naive, packed),
        "bpb_load_s": bpb_load_s,
        "bpb_s": bpb_s,
        "bpb_bytes": documents.document_bytes,
        "bpb_bytes_per_s": documents.document_bytes / bpb_s,
        "bpb_windows": documents.windows.rows,
        "bpb": bpb_metrics["eval/documents/bpb"],
        "train_step_s": step_s,
        "choice_task_share": cost_share(packed_s, step_s, args.interval),
        "bpb_task_share": cost_share(bpb_s, step_s, args.interval),
    }


def markdown(r: dict) -> str:
    """The headline figures as a two-column Markdown table."""
    rows = [
        ("load_task (multiple choice)", f"{r['load_s']:.3f} s"),
        (
            f"packed scorer ({r['windows']} windows, fill {r['window_fill']:.0%})",
            f"{r['packed_s']:.2f} s, {r['packed_examples_per_s']:.1f} examples/s",
        ),
        (
            "naive loop (batch 1)",
            f"{r['naive_s']:.2f} s, {r['naive_examples_per_s']:.1f} examples/s",
        ),
        ("packed / naive examples/s", f"{r['packed_over_naive']:.2f}x"),
        ("acc packed / naive", f"{r['packed_acc']:.3f} / {r['naive_acc']:.3f}"),
        (
            f"bits per byte ({r['bpb_bytes']} bytes)",
            f"{r['bpb_s']:.3f} s, {r['bpb_bytes_per_s']:.0f} bytes/s",
        ),
        (f"training step ({r['train_batch']} x {r['seq']})", f"{r['train_step_s']:.2f} s"),
        (
            f"in-loop share every {r['interval']} steps: choices / bpb",
            f"{r['choice_task_share']:.2%} / {r['bpb_task_share']:.2%}",
        ),
    ]
    lines = [
        f"{r['model']}, {r['threads']} threads, torch {r['torch']}",
        "",
        "| figure | value |",
        "|---|---|",
    ]
    return "\n".join(lines + [f"| {name} | {value} |" for name, value in rows])


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as directory:
        report = measure(args, directory)
    if report["packed_acc"] != report["naive_acc"] or report["disagreements"]:
        print(
            f"warning: packed acc {report['packed_acc']} vs naive acc {report['naive_acc']}; "
            f"examples whose likeliest choice differs: {report['disagreements']}",
            file=sys.stderr,
        )
    print(json.dumps(report), flush=True)
    print(markdown(report))


if __name__ == "__main__":
    main()
