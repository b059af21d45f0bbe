"""[grpo]: group relative policy optimisation with verifiable rewards (train.loss_fn = "grpo"):
how many completions the policy samples per prompt and how, the reward that scores them, the
clipped importance ratio, the KL pull towards a reference, and how many optimizer steps
reuse one batch of rollouts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kempnerforge.config.checks import check_at_least, check_in_range, check_positive
from kempnerforge.core.errors import ConfigError

if TYPE_CHECKING:
    from kempnerforge.config.job import JobConfig


@dataclass
class GRPOConfig:
    group_size: int = 4
    """Completions sampled per prompt (G): a prompt's advantages are its completions' rewards
    against their group's mean. A rank's micro-batches of a step hold train.batch_size x
    train.grad_accum_steps completions, so that many / G prompts per rank and rollout. 2 to
    1024."""
    iterations: int = 1
    """Optimizer steps that reuse one batch of rollouts (mu): 1 samples afresh every step
    (the importance ratio is then 1 and only the advantages weigh the tokens); more steps
    move the policy away from the one that sampled, which the clipped ratio bounds. 1 to
    1024."""
    max_new_tokens: int = 32
    """Most tokens a completion may have (fewer where the prompt leaves less room in the
    window of train.seq_len). A completion ends at the chat template's end of turn or EOS,
    which it keeps as its last target so the policy learns to stop. 1 to 1,048,576."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts, in (0, 100]."""
    top_k: int = 0
    """Sample among the k most likely tokens only; 0 keeps every token."""
    top_p: float = 1.0
    """Nucleus sampling's mass, in (0, 1]; 1 keeps every token."""
    reward: str = "exact_answer"
    """The reward of a completion: "exact_answer" (1 when its last number equals the
    prepared answer's), "regex" (1 when grpo.reward_pattern matches it, and its group,
    if it has one, equals the answer), or "module:function", a function of the user's
    called as fn(completion, answer, prompt) -> float (importing it runs its module's
    code: name only modules you trust)."""
    reward_pattern: str = ""
    """The regular expression of reward = "regex"."""
    scale_rewards: bool = True
    """Divide a group's centred rewards by their standard deviation (GRPO); false keeps
    them centred only (Dr. GRPO's advice against favouring groups of near-equal rewards)."""
    clip_low: float = 0.2
    """The ratio's lower clip is 1 - clip_low, in [0, 1)."""
    clip_high: float = 0.2
    """The ratio's upper clip is 1 + clip_high, in [0, 10] (DAPO raises it above clip_low)."""
    kl_beta: float = 0.0
    """Weight of the per-token KL estimate to a frozen reference (the starting weights),
    k3 = exp(ref - logp) - (ref - logp) - 1. 0 builds no reference; above 0 one more copy
    of the weights and one more forward per rollout. In [0, 100]."""

    def __post_init__(self) -> None:
        check_at_least("grpo.group_size", self.group_size, 2, 1024)
        check_at_least("grpo.iterations", self.iterations, 1, 1024)
        check_at_least("grpo.max_new_tokens", self.max_new_tokens, 1, 1 << 20)
        check_positive("grpo.temperature", self.temperature, 100.0)
        check_at_least("grpo.top_k", self.top_k, 0, 1 << 31)
        check_positive("grpo.top_p", self.top_p, 1.0)
        check_in_range("grpo.clip_low", self.clip_low, 0.0, 0.9999)
        check_in_range("grpo.clip_high", self.clip_high, 0.0, 10.0)
        check_in_range("grpo.kl_beta", self.kl_beta, 0.0, 100.0)
        if not self.reward.strip():
            raise ConfigError(
                "grpo.reward",
                self.reward,
                "exact_answer, regex or module:function",
                "name a built-in reward or a function of yours as module:function",
            )


def check_grpo_job(config: JobConfig) -> None:
    """train.loss_fn = "grpo" against the rest of the job: a text model, whole sequences on
    every rank (no pipeline, no context parallelism), no z-loss or multi-token prediction
    (they would join the log-probabilities), whole groups in a rank's step."""
    if config.train.loss_fn != "grpo":
        return
    train, dist, grpo = config.train, config.distributed, config.grpo
    rows = train.batch_size * train.grad_accum_steps
    rules = [
        (config.is_vlm, "train.loss_fn", "grpo", "a text model", "GRPO trains text models"),
        (dist.pp > 1, "distributed.pp", dist.pp, "1 with train.loss_fn = 'grpo'",
         "rollouts decode through the whole model's forward; use FSDP or tensor parallelism"),
        (dist.cp > 1, "distributed.cp", dist.cp, "1 with train.loss_fn = 'grpo'",
         "a completion is decoded from its whole sequence on one rank"),
        (train.z_loss_weight > 0, "train.z_loss_weight", train.z_loss_weight,
         "0 with train.loss_fn = 'grpo'", "the z-loss would join the log-probabilities"),
        (config.model.mtp_depth > 0, "model.mtp_depth", config.model.mtp_depth,
         "0 with train.loss_fn = 'grpo'",
         "multi-token prediction would train on the completions' later tokens as targets"),
        (rows % grpo.group_size != 0, "grpo.group_size", grpo.group_size,
         f"a divisor of train.batch_size x train.grad_accum_steps = {rows}",
         "a rank's step holds whole groups: every completion of a prompt is sampled and "
         "trained on the same rank"),
        (config.fault_tolerance.enabled and grpo.iterations > 1, "grpo.iterations",
         grpo.iterations, "1 with fault_tolerance.enabled",
         "a replica group samples the prompts of the slots each step's quorum assigns it, "
         "so a rollout cannot outlive its step"),
    ]  # fmt: skip
    for failed, field, value, expected, hint in rules:
        if failed:
            raise ConfigError(field, value, expected, hint)
