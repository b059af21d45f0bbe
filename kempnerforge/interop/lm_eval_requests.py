"""Answering lm-evaluation-harness's three kinds of request with a kempnerforge text model,
the way the native task scorer reads text (evaluation/tasks.py); lm_eval.py wraps these in
the harness's model class.

A scored text is ``start.tokens(encode(context)) + encode(continuation)``, the start
being what the training documents started with (evaluation/document_start.py), as the
native tasks build it. The requests are packed into document-masked windows of
train.seq_len (evaluation/windows.py), so a window costs one forward whatever the
requests' lengths, and a request packed as the native scorer packs it is read the same
way. A whole text (loglikelihood_rolling) is read in the windows the harness's contract
gives (``RollingWindows``, lm_eval.py hands over the harness's own), not the native
bits_per_byte task's overlapping ones.
"""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kempnerforge.data.tokenizer import Tokenizer
from kempnerforge.evaluation.document_start import DocumentStart, training_start
from kempnerforge.evaluation.windows import Request, Windows, pack_requests
from kempnerforge.model.generation import eval_mode, generate
from kempnerforge.model.transformer import Transformer
from kempnerforge.training.families import family_of
from kempnerforge.training.forward import training_autocast
from kempnerforge.training.inference import load_for_inference, open_for_inference

PACK_POSITIONS = 1024 * 2048
"""Token positions packed at once: windows are built for this many and scored before the
next are packed, so a large evaluation never holds all its windows (~64 MB at a time)."""

RollingWindows = Callable[[list[int], int, int], list[tuple[list[int], list[int]]]]
"""(tokens, prefix token, window length) -> (context, continuation) pairs whose
continuations are the tokens, each once, in order, a pair fitting one window."""


@dataclass(frozen=True)
class TextModel:
    """A text model with what reading and writing text needs beside it."""

    model: Transformer
    tokenizer: Tokenizer
    start: DocumentStart
    """What a text starts with: as the training documents started."""
    seq_len: int
    """Positions of a scoring window (train.seq_len, the native scorer's windows)."""
    device: torch.device
    batch_rows: int = 8
    """Windows per forward."""
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    """The precision the forwards run in (the training step's)."""


def load_text_model(
    config: str, checkpoint: str, overrides: Sequence[str], device: str, batch_rows: int
) -> TextModel:
    """The checkpoint's text model with its data's tokenizer, through the inference loader.

    Opened as `generate` opens it: a text model continuing text in one process (a
    vision-language model is refused), the run's parallel layout unchecked since no
    training data is read. The data pipeline is built for its tokenizer, and texts start
    as the training documents did (logged), as the `eval` command's --tasks does.
    """
    job = open_for_inference(
        "generate",
        checkpoint,
        config_path=config,
        overrides=overrides,
        validate=False,
        device=device,
    )
    data = family_of(job.config).build_data(job.config, job.runtime, False)
    model = load_for_inference(job)
    assert isinstance(model, Transformer)  # open_for_inference refused every other family
    tokenizer = data.tokenizer
    return TextModel(
        model=model,
        tokenizer=tokenizer,
        start=training_start(tokenizer, job.config.data, data),
        seq_len=job.config.train.seq_len,
        device=job.runtime.device,
        batch_rows=batch_rows,
        autocast=lambda: training_autocast(job.config.train, job.runtime.device),
    )


def split_overrides(overrides: str | Sequence[str] | None) -> list[str]:
    """Config overrides given as one string (shell words: ``--train.seq_len=512
    --model.x=1``, as a model_args value carries them) or as a list."""
    if not overrides:
        return []
    return shlex.split(overrides) if isinstance(overrides, str) else [str(o) for o in overrides]


def loglikelihoods(lm: TextModel, pairs: Sequence[tuple[str, str]]) -> list[tuple[float, bool]]:
    """Each (context, continuation)'s log-likelihood of the continuation in nats, and
    whether every one of its tokens is the argmax given the tokens before it.

    The tokens are those the native multiple-choice task reads; a context longer than a
    window loses its left end (pack_requests). An empty continuation scores 0, greedy.
    """
    requests = []
    for slot, (context, continuation) in enumerate(pairs):
        prefix = lm.start.tokens(lm.tokenizer.encode(context))
        tokens = prefix + lm.tokenizer.encode(continuation)
        requests.append(Request(tokens, len(prefix), slot))
    logprob, misses = score_requests(lm, requests, len(pairs))
    return [(float(lp), bool(m == 0)) for lp, m in zip(logprob, misses, strict=True)]


def rolling_loglikelihoods(
    lm: TextModel, texts: Sequence[str], windows: RollingWindows
) -> list[float]:
    """Each text's log-likelihood in nats, every token after the first of
    ``lm.start.tokens(encode(text))`` scored once, in the (context, continuation) pairs
    ``windows`` cuts them into, the first token their prefix, windows of lm.seq_len."""
    requests = []
    for slot, text in enumerate(texts):
        tokens = lm.start.tokens(lm.tokenizer.encode(text))
        if len(tokens) < 2:  # an empty text has nothing to score (the native task skips it)
            continue
        for context, continuation in windows(tokens[1:], tokens[0], lm.seq_len):
            requests.append(Request(context + continuation, len(context), slot))
    logprob, _ = score_requests(lm, requests, len(texts))
    return [float(lp) for lp in logprob]


def score_requests(
    lm: TextModel, requests: list[Request], slots: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots,) float64 summed log-probabilities of each slot's scored tokens, and (slots,)
    int64 counts of those tokens that were not the argmax; packed PACK_POSITIONS at a time."""
    logprob = torch.zeros(slots, dtype=torch.float64, device=lm.device)
    misses = torch.zeros(slots, dtype=torch.long, device=lm.device)
    for group in _groups(requests):
        _score_windows(lm, pack_requests(group, lm.seq_len, lm.tokenizer.eos_id), logprob, misses)
    return logprob.cpu(), misses.cpu()


def _groups(requests: list[Request]) -> list[list[Request]]:
    """The requests in order, cut into runs of about PACK_POSITIONS positions."""
    groups: list[list[Request]] = [[]]
    positions = 0
    for request in requests:
        if positions >= PACK_POSITIONS:
            groups.append([])
            positions = 0
        groups[-1].append(request)
        positions += len(request.tokens) - 1
    return [g for g in groups if g]


@torch.no_grad()
def _score_windows(
    lm: TextModel, windows: Windows, logprob: torch.Tensor, misses: torch.Tensor
) -> None:
    """Add each window's scored tokens into their slots: log_softmax of the fp32 logits
    at the label, and 1 in ``misses`` where the label is not the argmax. One forward per
    lm.batch_rows windows, each request its own document (doc_ids)."""
    with eval_mode(lm.model):
        for start in range(0, windows.rows, lm.batch_rows):
            rows = slice(start, start + lm.batch_rows)
            scored = windows.slots[rows] >= 0
            if not bool(scored.any()):
                continue
            input_ids = windows.input_ids[rows].to(lm.device)
            doc_ids = windows.doc_ids[rows].to(lm.device)
            with lm.autocast():
                logits = lm.model(input_ids, doc_ids=doc_ids)
            assert isinstance(logits, torch.Tensor)  # no labels: logits, not a HeadLoss
            scored = scored.to(lm.device)
            labels = windows.labels[rows].to(lm.device)[scored]
            index = windows.slots[rows].to(lm.device)[scored]
            logp = torch.log_softmax(logits[scored].float(), dim=-1)
            picked = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            logprob.index_add_(0, index, picked.double())
            misses.index_add_(0, index, (logp.argmax(dim=-1) != labels).long())


def generate_until(lm: TextModel, context: str, until: Sequence[str], max_gen_toks: int) -> str:
    """The greedy continuation of ``context`` up to the first of the ``until`` strings (not
    included), or of max_gen_toks tokens, or to the end-of-document token.

    The prompt is ``start.tokens(encode(context))``, cut from the left to the
    model.max_seq_len - max_gen_toks tokens the continuation leaves; decoding uses the
    KV cache (model.generate) and stops as soon as a stop string appears. A ValueError
    when max_gen_toks leaves no room for a prompt.
    """
    room = lm.model.cfg.max_seq_len - max_gen_toks
    if room < 1:
        raise ValueError(
            f"max_gen_toks = {max_gen_toks} leaves no room for the prompt in model.max_seq_len "
            f"= {lm.model.cfg.max_seq_len}; ask for fewer new tokens (model_args max_gen_toks "
            "or the task's generation_kwargs)"
        )
    prompt = lm.start.tokens(lm.tokenizer.encode(context))[-room:]
    stops = [s for s in until if s]

    def stop_when(new_ids: list[int]) -> bool:
        text = lm.tokenizer.decode(new_ids)
        return any(s in text for s in stops)

    with lm.autocast():
        new_ids = generate(
            lm.model,
            prompt,
            max_gen_toks,
            temperature=0.0,
            stop_id=lm.tokenizer.eos_id,
            seed=0,
            stop_when=stop_when if stops else None,
        )
    return cut_at_stop(lm.tokenizer.decode(new_ids), stops)


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """``text`` before the earliest occurrence of any of ``stops``; all of it without one."""
    ends = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return text[: min(ends)] if ends else text
