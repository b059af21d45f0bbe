"""Rollouts of GRPO (train.loss_fn = "grpo"): completions the policy samples for prepared prompts,
scored by the reward, turned into the micro-batches the objective reads.

Every grpo.iterations steps, each data-parallel rank takes its next train.batch_size x
train.grad_accum_steps / grpo.group_size prompts (one batch of the prompt corpus's loader:
prepare-data --format prompts) and samples grpo.group_size completions of each with the
weights being trained, through the training forward itself: any layout that runs that
forward (FSDP, tensor, expert parallelism) samples without copying the weights anywhere.
The forward decodes with a key/value cache (model/attention/decode_cache.py): the prompts
run through it once, then each decoding step runs one new token per row (padded to the
tensor-parallel degree, which sequence parallelism splits evenly); every rank of the job
runs the same number of decoding steps (one all-reduce a step says whether any row is
still open), since a sharded forward is collective.

A completion's tokens are drawn from a generator seeded by (train.seed, the rollout's
number, the prompt's tokens, the completion's number), so a prompt's completions do not
depend on which rank samples them or with how many others: a layout samples what one
process samples (to the rounding of the logits). The rollout, its position and its
micro-batches are part of the checkpoint (the train state of each rank), so a resume in the
middle of a rollout's iterations trains on the same samples; a rollout cut short by a stop
is sampled again, identically, from the checkpoint's weights.

An external inference engine (vLLM on GPUs) would replace ``decode_completions``: it takes
the prompts, the seeds and the sampling settings and returns each row's completion tokens;
the policy's weights would be pushed to it after each optimizer step that starts a rollout.
The old log-probabilities are then recomputed by the training forward, as here, so the
ratio is always the trainer's own.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kempnerforge.config.grpo import GRPOConfig
from kempnerforge.core.errors import DataError
from kempnerforge.core.logging import get_logger
from kempnerforge.data.tokenizer import Tokenizer
from kempnerforge.model.attention import DecodeStep
from kempnerforge.model.generation import eval_mode
from kempnerforge.model.heads import IGNORE_INDEX, token_losses
from kempnerforge.training.objectives.grpo import (
    ADVANTAGES,
    OLD_LOGPS,
    REF_TOKEN_LOGPS,
    REWARDS,
)
from kempnerforge.training.objectives.objective import Batch
from kempnerforge.training.objectives.rewards import RewardFn, checked_reward
from kempnerforge.training.objectives.sampling import (
    Decoding,
    Logits,
    decode_completions,
    decoding_span,
)

logger = get_logger(__name__)


ADVANTAGE_EPS = 1e-4
"""Added to a group's reward standard deviation before dividing by it, as TRL does."""


@dataclass(frozen=True)
class Prompt:
    """One prepared prompt: its token ids (the chat template's render up to the assistant's
    turn) and the reference answer's ids."""

    ids: list[int]
    answer_ids: list[int]


def prompts_of(batch: Batch) -> list[Prompt]:
    """The prompts of a batch of prompt-corpus windows: a window holds the prompt, then the
    answer's tokens as its only targets, then padding (data/prepare/prompts.py); the prompt
    is every input up to the one whose label is the answer's first token."""
    prompts = []
    for inputs, labels in zip(batch["input_ids"].tolist(), batch["labels"].tolist(), strict=True):
        targets = [i for i, label in enumerate(labels) if label != IGNORE_INDEX]
        if not targets:
            raise DataError(
                "a window of the prompt corpus holds no answer token: data.path must be a "
                "corpus written by `kempnerforge prepare-data --format prompts`"
            )
        prompts.append(Prompt(inputs[: targets[0] + 1], [labels[i] for i in targets]))
    return prompts


def completion_seed(seed: int, rollout: int, prompt_ids: list[int], index: int) -> int:
    """The sampling seed of completion ``index`` of a prompt in rollout ``rollout``: a stable
    hash of all four, so it does not depend on the rank or the batch that samples it."""
    text = f"grpo:{seed}:{rollout}:{index}:" + ",".join(map(str, prompt_ids))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def rollout_rows(
    prompts: list[list[int]], completions: list[list[int]], width: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), each (rows, width): a row's prompt and completion, padded; its
    labels the completion's tokens (each at the position that predicts it), IGNORE_INDEX
    elsewhere."""
    rows = len(prompts)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    labels = torch.full((rows, width), IGNORE_INDEX, dtype=torch.long)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        tokens = (prompt + completion)[:width]
        input_ids[row, : len(tokens)] = torch.tensor(tokens)
        first, last = len(prompt) - 1, len(tokens) - 1
        if last > first:
            labels[row, first:last] = torch.tensor(tokens[first + 1 :])
    return input_ids, labels


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool) -> torch.Tensor:
    """Each completion's reward minus its group's mean (a group: group_size consecutive
    rows, one prompt's), divided by the group's standard deviation (Bessel-corrected, plus
    ADVANTAGE_EPS) when ``scale``: GRPO's advantages as TRL computes them."""
    groups = rewards.double().view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (groups.std(dim=1, keepdim=True) + ADVANTAGE_EPS)
    return centred.reshape(-1).float()


@torch.no_grad()
def label_logps(
    logits_of: Logits, input_ids: torch.Tensor, labels: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """Each label's log-probability under the forward, (rows, width) fp32 on the host, 0
    where the label is ignored: the per-token losses the training step computes, negated."""
    logits = logits_of(input_ids.to(device))
    return (-token_losses(logits, labels.to(device))).float().cpu()


class Rollouts:
    """The micro-batches of a GRPO rank (a BatchSource of training/session.py's BatchStream):
    those of the current rollout, sampled afresh every grpo.iterations passes over them.

    It draws one batch of the pipeline's loader (which the build sizes to a rollout's
    prompts on this rank) per rollout; this rank's rollout, its number and the micro-batches
    read of it are its state (state_dict, part of each rank's train state in a checkpoint),
    beside the loader's position.
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        reference: nn.Module | None,
        cfg: GRPOConfig,
        reward: RewardFn,
        tokenizer: Tokenizer,
        decoding: Decoding,
        seed: int,
        layout: tuple[int, int, int],
        device: torch.device,
        group: dist.ProcessGroup | None,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> None:
        self._model, self._reference = model, reference
        self._cfg, self._reward, self._tokenizer = cfg, reward, tokenizer
        self._decoding, self._seed = decoding, seed
        self._layout = list(layout)  # [dp rank, dp size, rows per rank]: whose rollout it is
        self._device, self._group, self._autocast = device, group, autocast
        self._rollout: list[Batch] = []  # the current rollout's micro-batches (on the host)
        self._rollouts = 0  # rollouts sampled so far (the next one's number)
        self._read = 0  # micro-batches read from the current rollout, over its passes

    def next_batch(self, read: Callable[[], Batch]) -> Batch:
        """The current rollout's next micro-batch, on the device; a new rollout of the
        prompts ``read`` draws once the last one has served its passes."""
        if self._read >= self._cfg.iterations * len(self._rollout):
            self._rollout = self._sample_rollout(read(), self._rollouts)
            self._rollouts += 1
            self._read = 0
        batch = self._rollout[self._read % len(self._rollout)]
        self._read += 1
        return {key: value.to(self._device) for key, value in batch.items()}

    def windows_per_micro_batch(self, batch_size: int) -> int:
        """A micro-batch of ``batch_size`` completions samples batch_size / group_size
        prompts."""
        return batch_size // self._cfg.group_size

    def micro_batch(self, windows: Batch, number: int) -> Batch:
        """The one micro-batch of a rollout of ``windows``' prompts, numbered ``number``
        (its seeds), on the device: a replica group's slot (grpo.iterations is 1 there,
        so nothing is kept for another step)."""
        (batch,) = self._sample_rollout(windows, number)
        return {key: value.to(self._device) for key, value in batch.items()}

    def state_dict(self) -> dict[str, Any]:
        """This rank's rollout, its number and the micro-batches read of it (plain types and
        tensors: a weights-only load reads it back)."""
        return {
            "rollouts": self._rollouts,
            "read": self._read,
            "rollout": [dict(batch) for batch in self._rollout],
            "layout": list(self._layout),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved rollout where it was left; one sampled by another rank, or
        with another number of rows, is refused while it still has passes to run."""
        rollout = list(state.get("rollout", []))
        read = int(state.get("read", 0))
        unfinished = read < self._cfg.iterations * len(rollout)
        saved, here = list(state.get("layout", [])), self._layout
        if unfinished and saved != here:
            raise DataError(
                "the checkpoint was saved in the middle of a GRPO rollout, sampled by "
                f"data-parallel rank {saved[0]} of {saved[1]} with {saved[2]} rows, and this "
                f"rank is {here[0]} of {here[1]} with {here[2]}: resume it with the saving "
                "run's layout and batch, or from a checkpoint at a rollout's end (a step that "
                "is a multiple of grpo.iterations)"
            )
        self._rollout = rollout if unfinished else []
        self._read = read if unfinished else 0
        self._rollouts = int(state.get("rollouts", 0))

    # --- sampling ------------------------------------------------------------------------

    def _forward(self, model: nn.Module) -> Logits:
        def logits_of(ids: torch.Tensor, decode: DecodeStep | None = None) -> torch.Tensor:
            with self._autocast():
                output = model(ids) if decode is None else model(ids, decode=decode)
            assert isinstance(output, torch.Tensor)
            return output

        return logits_of

    def _sample_rollout(self, prompt_batch: Batch, number: int) -> list[Batch]:
        """The micro-batches of rollout ``number``, of ``prompt_batch``'s prompts."""
        started = time.perf_counter()
        cfg, decoding = self._cfg, self._decoding
        prompts = prompts_of(prompt_batch)
        rows = [p.ids for p in prompts for _ in range(cfg.group_size)]
        seeds = [
            completion_seed(self._seed, number, p.ids, index)
            for p in prompts
            for index in range(cfg.group_size)
        ]
        with eval_mode(self._model):
            policy = self._forward(self._model)
            completions = decode_completions(
                policy, rows, seeds, decoding, self._device, self._group
            )
            # Rows as wide as the longest needs (rounded up as decoding's forwards are), not
            # the whole window: the steps' forwards skip the padding.
            longest = max(len(p) + len(c) for p, c in zip(rows, completions, strict=True))
            width = decoding_span(longest, decoding)
            input_ids, labels = rollout_rows(rows, completions, width, decoding.pad_id)
            old = self._per_micro_batch(policy, input_ids, labels)
        rewards = self._rewards(prompts, completions, number)
        batch: Batch = {
            "input_ids": input_ids,
            "labels": labels,
            OLD_LOGPS: old,
            ADVANTAGES: group_advantages(rewards, cfg.group_size, cfg.scale_rewards),
            REWARDS: rewards,
        }
        if self._reference is not None:
            batch[REF_TOKEN_LOGPS] = self._per_micro_batch(
                self._forward(self._reference), input_ids, labels
            )
        tokens = sum(len(c) for c in completions)
        seconds = time.perf_counter() - started
        logger.info(
            "grpo: rollout %d: %d prompts x %d completions, %d tokens sampled in %.2f s "
            "(%.0f tokens/s), mean reward %.3f",
            number,
            len(prompts),
            cfg.group_size,
            tokens,
            seconds,
            tokens / max(seconds, 1e-9),
            float(rewards.mean()),
        )
        size = decoding.rows_per_forward
        return [
            {key: value[first : first + size].clone() for key, value in batch.items()}
            for first in range(0, input_ids.shape[0], size)
        ]

    def _per_micro_batch(
        self, logits_of: Logits, input_ids: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        """label_logps over the rows, one micro-batch of rows per forward."""
        size = self._decoding.rows_per_forward
        return torch.cat(
            [
                label_logps(logits_of, input_ids[i : i + size], labels[i : i + size], self._device)
                for i in range(0, input_ids.shape[0], size)
            ]
        )

    def _rewards(
        self, prompts: list[Prompt], completions: list[list[int]], number: int
    ) -> torch.Tensor:
        """Each completion's reward, (rows,) fp32: the reward function of its text (its stop
        token left out), its prompt's answer and its prompt's text."""
        decode, stops = self._tokenizer.decode, self._decoding.stop_ids
        values = []
        for row, completion in enumerate(completions):
            prompt = prompts[row // self._cfg.group_size]
            text = completion[:-1] if completion and completion[-1] in stops else completion
            where = f"grpo.reward, rollout {number}, completion {row}"
            values.append(
                checked_reward(
                    self._reward, decode(text), decode(prompt.answer_ids), decode(prompt.ids),
                    where,
                )
            )  # fmt: skip
        return torch.tensor(values, dtype=torch.float32)
