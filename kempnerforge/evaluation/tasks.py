"""Downstream tasks: loaded once from `[[eval.tasks]]`, scored in the loop and by
the `eval` command's `--tasks`, the same on every layout.

Loading reads a task's file, renders its examples (few-shot prefix included), tokenizes
them and packs the scoring requests into windows of the model's sequence: done once per
run, so an evaluation is only forwards. Scoring (evaluation/scoring.py) sums each
request's log-likelihood over the data-parallel ranks; the metrics follow from those sums
on every rank alike:

- multiple_choice: each choice's log-likelihood given the context; ``acc`` counts the
  examples whose gold choice is the likeliest, ``acc_norm`` those whose gold choice has the
  highest log-likelihood per UTF-8 byte of the choice (longer choices are not penalised
  for their length);
- bits_per_byte: the documents' negative log-likelihood in bits over their UTF-8 bytes
  (``bpb``), every token after the document's start token scored once; it compares models
  whatever their tokenizers.
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
from kempnerforge.evaluation.scoring import TokenLosses, slot_sums
from kempnerforge.evaluation.task_files import read_choice_examples, read_documents, with_shots
from kempnerforge.evaluation.windows import Request, Windows, pack_requests, rolling_requests

logger = logging.getLogger(__name__)


@dataclass
class LoadedTask:
    """A task ready to score: its windows, and what turns slot sums into metrics.

    multiple_choice: slot e * choices + c is example e's choice c (``choices`` the most any
    example has; a missing choice's slot scores nothing); ``gold`` (examples,),
    ``choice_bytes`` (examples, choices), 0 where an example has fewer choices.
    bits_per_byte: slot d is document d; ``document_bytes`` (documents,)."""

    config: EvalTaskConfig
    slots: int
    examples: int
    windows: Windows = field(default_factory=Windows.empty)
    choices: int = 0
    gold: torch.Tensor | None = None
    choice_bytes: torch.Tensor | None = None
    document_bytes: int = 0

    @property
    def name(self) -> str:
        return self.config.name


def load_task(
    task: EvalTaskConfig,
    tokenizer: Tokenizer,
    bos_per_document: bool,
    seq_len: int,
    packed: bool = True,
) -> LoadedTask:
    """Read, render, tokenize and pack one task; logs how many requests lost context.
    ``packed`` False puts one request a row (for a model that takes no document ids)."""
    requests, loaded = (
        _load_documents(task, tokenizer, bos_per_document, seq_len)
        if task.kind == "bits_per_byte"
        else _load_choices(task, tokenizer, bos_per_document)
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
    bos_per_document: bool,
    seq_len: int,
    packed: bool = True,
) -> list[LoadedTask]:
    return [load_task(t, tokenizer, bos_per_document, seq_len, packed) for t in tasks]


def _start_id(tokenizer: Tokenizer, bos_per_document: bool) -> int:
    """The token a document starts after: BOS when the training documents began with one,
    else EOS (what ended the document before)."""
    return tokenizer.bos_id if bos_per_document else tokenizer.eos_id


def _load_choices(
    task: EvalTaskConfig, tokenizer: Tokenizer, bos_per_document: bool
) -> tuple[list[Request], LoadedTask]:
    examples = read_choice_examples(task.path, task.limit)
    if task.num_fewshot:
        shots = read_choice_examples(task.fewshot_path, task.num_fewshot)
        examples = with_shots(examples, shots)
    choices = max(len(e.choices) for e in examples)
    start = _start_id(tokenizer, bos_per_document)
    requests: list[Request] = []
    choice_bytes = torch.zeros(len(examples), choices, dtype=torch.float64)
    for e, example in enumerate(examples):
        context = [start, *tokenizer.encode(example.context)]
        for c, choice in enumerate(example.choices):
            ids = tokenizer.encode(choice)
            requests.append(Request(context + ids, len(context), e * choices + c))
            choice_bytes[e, c] = len(choice.encode("utf-8"))
    return requests, LoadedTask(
        config=task,
        slots=len(examples) * choices,
        examples=len(examples),
        choices=choices,
        gold=torch.tensor([e.gold for e in examples]),
        choice_bytes=choice_bytes,
    )


def _load_documents(
    task: EvalTaskConfig, tokenizer: Tokenizer, bos_per_document: bool, seq_len: int
) -> tuple[list[Request], LoadedTask]:
    documents = read_documents(task.path, task.limit)
    start = _start_id(tokenizer, bos_per_document)
    requests: list[Request] = []
    for d, text in enumerate(documents):
        tokens = [start, *tokenizer.encode(text)]
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
    acc = (loglik.argmax(dim=1) == task.gold).double().mean().item()
    acc_norm = (per_byte.argmax(dim=1) == task.gold).double().mean().item()
    return {f"{key}/acc": acc, f"{key}/acc_norm": acc_norm}


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
