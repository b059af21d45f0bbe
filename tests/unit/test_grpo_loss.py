"""GRPO's pieces on fixed inputs against hand-written references: the clipped per-token loss,
its gradient and metrics, the group-normalised advantages, the rows a rollout trains on, and
the batched decoder against the key/value-cache generator with the same seeds."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kempnerforge.config.grpo import GRPOConfig
from kempnerforge.config.loader import load_config
from kempnerforge.core.errors import ConfigError, DataError
from kempnerforge.data.tokenizer import load_tokenizer
from kempnerforge.model.generation import generate
from kempnerforge.model.heads import IGNORE_INDEX, logits_head_loss
from kempnerforge.model.transformer import Transformer
from kempnerforge.training.objectives.grpo import (
    ADVANTAGES,
    OLD_LOGPS,
    REF_TOKEN_LOGPS,
    REWARDS,
    configure_grpo,
    grpo_metrics_row,
)
from kempnerforge.training.objectives.rollouts import (
    Rollouts,
    completion_seed,
    group_advantages,
    prompts_of,
    rollout_rows,
)
from kempnerforge.training.objectives.sampling import Decoding, decode_completions


def _hand_loss(logits, labels, old, adv, ref, cfg: GRPOConfig):
    """The GRPO loss token by token in plain Python arithmetic on 0-d tensors."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    total = torch.zeros((), dtype=torch.float32)
    for row in range(labels.shape[0]):
        for pos in range(labels.shape[1]):
            label = int(labels[row, pos])
            if label == IGNORE_INDEX:
                continue
            logp = log_probs[row, pos, label]
            ratio = torch.exp(logp - old[row, pos])
            a = float(adv[row])
            clipped = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
            term = -torch.minimum(ratio * a, clipped * a)
            if cfg.kl_beta:
                gap = ref[row, pos] - logp
                term = term + cfg.kl_beta * (torch.exp(gap) - gap - 1)
            total = total + term
    return total


def _fixed_batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rows, seq, vocab = 4, 7, 11
    logits = torch.randn(rows, seq, vocab, generator=gen)
    labels = torch.randint(0, vocab, (rows, seq), generator=gen)
    labels[:, :2] = IGNORE_INDEX  # the prompt
    labels[1, 5:] = IGNORE_INDEX  # a short completion
    with torch.no_grad():
        exact = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    # Old and reference log-probabilities near the policy's, some far enough to clip.
    mask = labels != IGNORE_INDEX
    old = (exact + 0.4 * torch.randn(rows, seq, generator=gen)) * mask
    ref = (exact + 0.3 * torch.randn(rows, seq, generator=gen)) * mask
    batch = {
        "labels": labels,
        OLD_LOGPS: old,
        ADVANTAGES: torch.tensor([1.5, -0.5, 0.0, -1.0]),
        REWARDS: torch.tensor([1.0, 0.0, 0.5, 0.0]),
        REF_TOKEN_LOGPS: ref,
    }
    return logits, batch


@pytest.mark.parametrize(
    "cfg",
    [
        GRPOConfig(),
        GRPOConfig(clip_low=0.1, clip_high=0.28, kl_beta=0.04),
        GRPOConfig(clip_low=0.0, clip_high=0.0, kl_beta=1.0),
    ],
    ids=["default", "dapo-clip-kl", "no-band"],
)
def test_the_loss_and_its_gradient_equal_the_hand_written_formula(cfg):
    logits, batch = _fixed_batch()
    objective = configure_grpo(cfg)
    ours_logits = logits.clone().requires_grad_(True)
    head = logits_head_loss(ours_logits, batch["labels"], 0.0, per_token_grad=True)
    ours = objective.loss(head, batch)
    ours.backward()
    hand_logits = logits.clone().requires_grad_(True)
    hand = _hand_loss(
        hand_logits, batch["labels"], batch[OLD_LOGPS], batch[ADVANTAGES],
        batch[REF_TOKEN_LOGPS], cfg,
    )  # fmt: skip
    hand.backward()
    # Same float32 operations in another order: a few ulps of the sum's terms (28 tokens).
    assert ours.item() == pytest.approx(hand.item(), rel=1e-5, abs=1e-5)
    assert ours_logits.grad is not None and hand_logits.grad is not None
    torch.testing.assert_close(ours_logits.grad, hand_logits.grad, rtol=1e-5, atol=1e-6)
    assert objective.count(batch) == int((batch["labels"] != IGNORE_INDEX).sum()) == 18


def test_the_metrics_are_the_rollouts_means():
    cfg = GRPOConfig(clip_low=0.1, clip_high=0.1, kl_beta=0.5)
    logits, batch = _fixed_batch(1)
    objective = configure_grpo(cfg)
    head = logits_head_loss(logits, batch["labels"], 0.0)
    assert objective.metric_sums is not None and objective.metrics_row is not None
    row = objective.metrics_row(objective.metric_sums(head, batch).tolist())
    rewards = batch[REWARDS].double()
    assert row["grpo/reward"] == pytest.approx(float(rewards.mean()))
    assert row["grpo/reward_std"] == pytest.approx(float(rewards.std(unbiased=False)))
    assert row["grpo/completion_tokens"] == pytest.approx(18 / 4)
    log_probs = torch.log_softmax(logits, -1)
    clipped = kl = 0.0
    for r in range(4):
        for p in range(7):
            label = int(batch["labels"][r, p])
            if label == IGNORE_INDEX:
                continue
            logp = float(log_probs[r, p, label])
            ratio = math.exp(logp - float(batch[OLD_LOGPS][r, p]))
            a = float(batch[ADVANTAGES][r])
            clipped += (ratio < 0.9 and a < 0) or (ratio > 1.1 and a > 0)
            gap = float(batch[REF_TOKEN_LOGPS][r, p]) - logp
            kl += math.exp(gap) - gap - 1
    assert 0 < clipped < 18
    assert row["grpo/clip_ratio"] == pytest.approx(clipped / 18)
    assert row["grpo/kl"] == pytest.approx(kl / 18, rel=1e-5)
    assert grpo_metrics_row([0.0] * 6)["grpo/reward"] == 0.0


def test_advantages_are_each_groups_standardised_rewards():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 3.0, 1.0, 2.0, 0.0])
    ours = group_advantages(rewards, 4, scale=True)
    for g in range(3):
        group = [float(x) for x in rewards[4 * g : 4 * g + 4]]
        mean = sum(group) / 4
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / 3)  # Bessel, as TRL's std
        for i, x in enumerate(group):
            assert float(ours[4 * g + i]) == pytest.approx((x - mean) / (std + 1e-4), rel=1e-6)
    assert torch.all(ours[4:8] == 0)  # equal rewards teach nothing
    centred = group_advantages(rewards, 4, scale=False)
    assert float(centred[8]) == pytest.approx(3.0 - 1.5)


def test_a_rollout_row_trains_on_its_completion_only():
    input_ids, labels = rollout_rows([[5, 6, 7], [5]], [[8, 9, 2], [4]], width=6, pad_id=0)
    assert input_ids.tolist() == [[5, 6, 7, 8, 9, 2], [5, 4, 0, 0, 0, 0]]
    i = IGNORE_INDEX
    assert labels.tolist() == [[i, i, 8, 9, 2, i], [4, i, i, i, i, i]]
    # A completion that runs to the window's end loses what does not fit.
    input_ids, labels = rollout_rows([[1, 2, 3, 4]], [[5, 6, 7]], width=5, pad_id=0)
    assert input_ids.tolist() == [[1, 2, 3, 4, 5]] and labels.tolist() == [[i, i, i, 5, i]]


def test_a_prompt_windows_prompt_ends_where_its_answer_begins():
    i = IGNORE_INDEX
    batch = {
        "input_ids": torch.tensor([[1, 2, 3, 40, 41, 0, 0]]),
        "labels": torch.tensor([[i, i, 40, 41, 42, i, i]]),
    }
    (prompt,) = prompts_of(batch)
    assert prompt.ids == [1, 2, 3] and prompt.answer_ids == [40, 41, 42]


def test_seeds_depend_on_the_prompt_and_numbers_not_on_the_batch():
    a = completion_seed(0, 3, [1, 2, 3], 0)
    assert a == completion_seed(0, 3, [1, 2, 3], 0)
    others = {completion_seed(0, 3, [1, 2, 3], 1), completion_seed(0, 4, [1, 2, 3], 0),
              completion_seed(1, 3, [1, 2, 3], 0), completion_seed(0, 3, [1, 2, 4], 0)}  # fmt: skip
    assert a not in others and len(others) == 4


def test_batched_decoding_samples_what_the_cached_generator_samples(tiny_job_config):
    """The rollout decoder re-runs the training forward over every row's window; the cached
    generator decodes one prompt at a time. With the same seed each completion is the same
    tokens (the generator leaves out the stop token, which the rollout keeps)."""
    torch.manual_seed(0)
    model = Transformer(tiny_job_config.model).eval()
    rng = random.Random(0)
    vocab = tiny_job_config.model.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(3, 12))] for _ in range(6)]
    seeds = [completion_seed(0, 0, p, i) for i, p in enumerate(prompts)]
    stop = 7
    decoding = Decoding(
        max_new_tokens=10, temperature=1.3, top_k=0, top_p=0.95, stop_ids=frozenset({stop}),
        pad_id=0, width=tiny_job_config.model.max_seq_len, rows_per_forward=4,
    )  # fmt: skip
    ours = decode_completions(model, prompts, seeds, decoding, torch.device("cpu"), None)
    for prompt, seed, completion in zip(prompts, seeds, ours, strict=True):
        expected = generate(model, prompt, 10, temperature=1.3, top_p=0.95, stop_id=stop, seed=seed)
        stopped = completion[-1:] == [stop]
        assert completion == expected + ([stop] if stopped else [])
    assert any(len(c) < 10 for c in ours) or all(len(c) == 10 for c in ours)


def test_grpo_job_rules_name_their_fields(tiny_overrides):
    def refusal(*extra: str) -> str:
        with pytest.raises(ConfigError) as raised:
            load_config(None, [*tiny_overrides, "--train.loss_fn=grpo", *extra]).validate(1)
        return str(raised.value)

    assert "grpo.group_size" in refusal("--train.batch_size=6", "--grpo.group_size=4")
    assert "train.z_loss_weight" in refusal("--train.z_loss_weight=1e-4")
    assert "grpo.clip_low" in refusal("--grpo.clip_low=1.0")
    assert "grpo.reward" in refusal("--grpo.reward= ")
    with pytest.raises(ConfigError, match="distributed.pp"):
        config = load_config(None, [*tiny_overrides, "--train.loss_fn=grpo", "--distributed.pp=2"])
        config.validate(2)


def _rollouts(layout: tuple[int, int, int]) -> Rollouts:
    decoding = Decoding(
        max_new_tokens=4, temperature=1.0, top_k=0, top_p=1.0, stop_ids=frozenset(),
        pad_id=0, width=16, rows_per_forward=4,
    )  # fmt: skip
    return Rollouts(
        model=torch.nn.Identity(), reference=None, cfg=GRPOConfig(iterations=2),
        reward=lambda completion, answer, prompt: 0.0, tokenizer=load_tokenizer("byte"),
        decoding=decoding, seed=0, layout=layout, device=torch.device("cpu"), group=None,
    )  # fmt: skip


def test_a_rollout_saved_mid_way_resumes_only_on_the_rank_that_sampled_it():
    saved = _rollouts((1, 2, 8))
    batch = {"input_ids": torch.zeros(4, 16, dtype=torch.long)}
    state = {"rollouts": 3, "read": 1, "rollout": [batch, batch], "layout": [1, 2, 8]}
    saved.load_state_dict(state)
    assert saved.state_dict()["read"] == 1 and saved.state_dict()["rollouts"] == 3
    with pytest.raises(DataError, match="rank 1 of 2 with 8 rows.*is 0 of 4 with 8"):
        _rollouts((0, 4, 8)).load_state_dict(state)
    # At a rollout's end (2 micro-batches x 2 iterations read) any layout takes it.
    finished = _rollouts((0, 4, 8))
    finished.load_state_dict({**state, "read": 4})
    assert finished.state_dict()["rollout"] == [] and finished.state_dict()["rollouts"] == 3


def test_a_bad_grpo_step_is_traced_to_the_prompts_of_its_rollout():
    """Fault attribution records the windows a step's data came from: for GRPO the
    rollout's prompts, batch_size / group_size per micro-batch, not batch_size windows."""
    from kempnerforge.config.train import TrainConfig
    from kempnerforge.training.faults.attribution import _rows_per_step

    train = TrainConfig(batch_size=16, grad_accum_steps=2)
    rollouts = _rollouts((0, 1, 32))  # group_size 4 (GRPOConfig's default)
    assert _rows_per_step(train, rollouts) == 2 * 16 // 4
    assert _rows_per_step(train, None) == 32
