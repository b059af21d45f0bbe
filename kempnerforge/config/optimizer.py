"""[optimizer]: which optimizer updates the weights, and its hyperparameters."""

from __future__ import annotations

from dataclasses import dataclass, field

from kempnerforge.config.checks import check_at_least, check_choice, check_positive
from kempnerforge.config.errors import ConfigError

IMPLEMENTATIONS = ("auto", "foreach", "fused", "for_loop")


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    """Optimizer by registered name (see docs/optimizers.md)."""
    lr: float = 3e-4
    """Peak learning rate; the scheduler scales it."""
    weight_decay: float = 0.1
    """Decoupled weight decay applied to matrices (see the two switches below for the rest)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam (beta1, beta2)."""
    eps: float = 1e-8
    """Adam epsilon."""
    decay_norms_and_biases: bool = False
    """Also apply weight decay to norm weights and biases (1-D parameters)."""
    decay_embeddings: bool = False
    """Also apply weight decay to the token embedding table."""
    implementation: str = "auto"
    """'auto' (fused on CUDA, foreach elsewhere), 'foreach', 'fused' or 'for_loop'."""

    def __post_init__(self) -> None:
        check_positive("optimizer.lr", self.lr)
        check_at_least("optimizer.weight_decay", self.weight_decay, 0.0)
        check_positive("optimizer.eps", self.eps)
        check_choice("optimizer.implementation", self.implementation, IMPLEMENTATIONS)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError("optimizer.betas", self.betas, "two numbers in [0, 1)")
