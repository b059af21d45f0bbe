"""Downstream tasks: loaded once from `[[eval.tasks]]`, scored in the loop and by
the `eval` command's `--tasks`, the same on every layout.

Loading reads a task's file, renders its examples (few-shot prefix included), tokenizes
them and packs the scoring requests into windows of the model's sequence: done once per
run, so an evaluation is only forwards. Scoring (evaluation/scoring.py) sums each
request's log-likelihood over the data-parallel ranks; the metrics follow from those sums
on every rank alike:

- multiple_choice: each choice's log-likelihood given the prompt (the example's
  description, its subject's few-shot examples and its context); ``acc`` counts the
  examples whose gold choice is the likeliest, ``acc_norm`` those whose gold choice has the
  highest log-likelihood per UTF-8 byte of the choice (longer choices are not penalised
  for their length); examples with a subject also give ``acc/<subject>``;
- bits_per_byte: the documents' negative log-likelihood in bits over their UTF-8 bytes
  (``bpb``), every token after the document's start (evaluation/document_start.py) scored
  once, in overlapping windows (rolling_requests); it compares models whatever their
  tokenizers.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kempnerforge.config.eval import EvalTaskConfig
from kempnerforge.data.tokenizer import Tokenizer
from kempnerforge.evaluation.document_start import DocumentStart
from kempnerforge.evaluation.scoring import TokenLosses, slot_sums
from kempnerforge.evaluation.task_files import (
    ChoiceExample,
    read_choice_examples,
    read_documents,
    with_prompts,
)
from kempnerforge.evaluation.windows import Request, Windows, pack_requests, rolling_requests

logger = logging.getLogger(__name__)


@dataclass
class LoadedTask:
    """A task ready to score: its windows, and what turns slot sums into metrics.

    multiple_choice: slot e * choices + c is example e's choice c (``choices`` the most any
    example has; a missing choice's slot scores nothing); ``gold`` (examples,),
    ``choice_bytes`` (examples, choices), 0 where an example has fewer choices;
    ``subject_index`` (examples,) the position of each example's subject in ``subjects``,
    -1 for none (None when no example has one).
    bits_per_byte: slot d is document d; ``document_bytes`` (documents,)."""

    config: EvalTaskConfig
    slots: int
    examples: int
    windows: Windows = field(default_factory=Windows.empty)
    choices: int = 0
    gold: torch.Tensor | None = None
    choice_bytes: torch.Tensor | None = None
    subjects: list[str] = field(default_factory=list)
    subject_index: torch.Tensor | None = None
    document_bytes: int = 0

    @property
    def name(self) -> str:
        return self.config.name


def load_task(
    task: EvalTaskConfig,
    tokenizer: Tokenizer,
    start: DocumentStart,
    seq_len: int,
    packed: bool = True,
) -> LoadedTask:
    """Read, render, tokenize and pack one task, each text after ``start``; logs how many
    requests lost context. ``packed`` False puts one request a row (for a model that takes
    no document ids)."""
    requests, loaded = (
        _load_documents(task, tokenizer, start, seq_len)
        if task.kind == "bits_per_byte"
        else _load_choices(task, tokenizer, start)
    )
    loaded.windows = pack_requests(requests, seq_len, tokenizer.eos_id, packed=packed)
    if loaded.windows.truncated:
        logger.warning(
            f"eval task {task.name}: {loaded.windows.truncated} of its requests were longer "
            f"than the model's {seq_len} positions and lost tokens at the left"
        )
    return loaded


def load_tasks(
    tasks: list[EvalTaskConfig],
    tokenizer: Tokenizer,
    start: DocumentStart,
    seq_len: int,
    packed: bool = True,
) -> list[LoadedTask]:
    return [load_task(t, tokenizer, start, seq_len, packed) for t in tasks]


def prompted_examples(task: EvalTaskConfig) -> list[ChoiceExample]:
    """A multiple-choice task's examples, each context the whole prompt scored before its
    choices: the example's description, its subject's few-shot examples, its context."""
    examples = read_choice_examples(task.path, task.limit)
    shots = read_choice_examples(task.fewshot_path) if task.num_fewshot else []
    return with_prompts(examples, shots, task.num_fewshot, task.fewshot_path)


def _load_choices(
    task: EvalTaskConfig, tokenizer: Tokenizer, start: DocumentStart
) -> tuple[list[Request], LoadedTask]:
    examples = prompted_examples(task)
    choices = max(len(e.choices) for e in examples)
    requests: list[Request] = []
    choice_bytes = torch.zeros(len(examples), choices, dtype=torch.float64)
    for e, example in enumerate(examples):
        context = start.tokens(tokenizer.encode(example.context))
        for c, choice in enumerate(example.choices):
            ids = tokenizer.encode(choice)
            requests.append(Request(context + ids, len(context), e * choices + c))
            choice_bytes[e, c] = len(choice.encode("utf-8"))
    subjects = sorted({e.subject for e in examples if e.subject is not None})
    position = {name: i for i, name in enumerate(subjects)}
    index = [-1 if e.subject is None else position[e.subject] for e in examples]
    return requests, LoadedTask(
        config=task,
        slots=len(examples) * choices,
        examples=len(examples),
        choices=choices,
        gold=torch.tensor([e.gold for e in examples]),
        choice_bytes=choice_bytes,
        subjects=subjects,
        subject_index=torch.tensor(index) if subjects else None,
    )


def _load_documents(
    task: EvalTaskConfig, tokenizer: Tokenizer, start: DocumentStart, seq_len: int
) -> tuple[list[Request], LoadedTask]:
    documents = read_documents(task.path, task.limit)
    requests: list[Request] = []
    for d, text in enumerate(documents):
        tokens = start.tokens(tokenizer.encode(text))
        if len(tokens) > 1:
            requests.extend(rolling_requests(tokens, seq_len, d))
    return requests, LoadedTask(
        config=task,
        slots=len(documents),
        examples=len(documents),
        document_bytes=sum(len(text.encode("utf-8")) for text in documents),
    )


def task_metrics(task: LoadedTask, sums: torch.Tensor) -> dict[str, float]:
    """The task's metrics from its slot sums (slot_sums), keyed eval/<task>/<metric>."""
    key = f"eval/{task.name}"
    nll, tokens = sums[:, 0].cpu(), sums[:, 1].cpu()
    if task.config.kind == "bits_per_byte":
        return {
            f"{key}/bpb": nll.sum().item() / math.log(2) / max(task.document_bytes, 1),
            f"{key}/tokens": int(tokens.sum().item()),
            f"{key}/bytes": task.document_bytes,
        }
    assert task.gold is not None and task.choice_bytes is not None
    loglik = -nll.view(task.examples, task.choices)
    absent = task.choice_bytes == 0  # examples with fewer choices than the most
    loglik = loglik.masked_fill(absent, -math.inf)
    per_byte = (loglik / task.choice_bytes.clamp(min=1)).masked_fill(absent, -math.inf)
    correct = (loglik.argmax(dim=1) == task.gold).double()
    acc_norm = (per_byte.argmax(dim=1) == task.gold).double().mean().item()
    metrics = {f"{key}/acc": correct.mean().item(), f"{key}/acc_norm": acc_norm}
    for i, subject in enumerate(task.subjects):
        assert task.subject_index is not None
        metrics[f"{key}/acc/{subject}"] = correct[task.subject_index == i].mean().item()
    return metrics


def evaluate_task(
    model: torch.nn.Module,
    task: LoadedTask,
    token_losses: TokenLosses,
    *,
    device: torch.device,
    dp_rank: int = 0,
    dp_size: int = 1,
    global_batch: int,
    rows_per_forward: int,
    whole_forwards: bool = False,
    groups: Sequence[dist.ProcessGroup | None] = (),
) -> dict[str, float]:
    """Score one task on this rank's share (see slot_sums) and return its metrics, the same
    on every rank: the task's own, the examples counted, the requests cut, and the seconds
    it took."""
    began = time.perf_counter()
    sums = slot_sums(
        model,
        task.windows,
        task.slots,
        token_losses,
        device=device,
        dp_rank=dp_rank,
        dp_size=dp_size,
        global_batch=global_batch,
        rows_per_forward=rows_per_forward,
        whole_forwards=whole_forwards,
        groups=groups,
    )
    metrics = task_metrics(task, sums)
    key = f"eval/{task.name}"
    metrics[f"{key}/examples"] = task.examples
    metrics[f"{key}/truncated"] = task.windows.truncated
    metrics[f"{key}/seconds"] = time.perf_counter() - began
    return metrics
