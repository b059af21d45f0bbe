"""[optimizer]: which optimizer updates the weights, and its hyperparameters."""

from __future__ import annotations

from dataclasses import dataclass, field

from kempnerforge.config.checks import check_at_least, check_choice, check_positive
from kempnerforge.config.errors import ConfigError

IMPLEMENTATIONS = ("auto", "foreach", "fused", "for_loop")


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    """Optimizer by registered name: 'adamw', 'lion', 'muon' or 'schedule_free_adamw'
    (see docs/optimizers.md)."""
    lr: float = 3e-4
    """Peak learning rate; the scheduler scales it."""
    weight_decay: float = 0.1
    """Decoupled weight decay applied to matrices (see the two switches below for the rest)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam (beta1, beta2); Lion's interpolation and momentum coefficients; schedule-free
    AdamW's interpolation (beta1) and second-moment (beta2) coefficients."""
    eps: float = 1e-8
    """Adam epsilon."""
    decay_norms_and_biases: bool = False
    """Also apply weight decay to norm weights and biases (1-D parameters)."""
    decay_embeddings: bool = False
    """Also apply weight decay to the token embedding table."""
    implementation: str = "auto"
    """'auto' (fused on CUDA, foreach elsewhere), 'foreach', 'fused' or 'for_loop' (AdamW)."""
    muon_momentum: float = 0.95
    """Muon only: Nesterov momentum coefficient of the orthogonalised matrix updates."""
    muon_ns_steps: int = 5
    """Muon only: Newton-Schulz iterations that orthogonalise each matrix update."""
    muon_adam_lr: float = 0.0
    """Muon only: peak LR of the internal AdamW (embeddings, output head, 1-D parameters);
    0 means optimizer.lr."""
    schedule_free_warmup_steps: int = 0
    """Schedule-free AdamW only: steps of linear LR warmup inside the optimizer; 0 = none."""

    def __post_init__(self) -> None:
        check_positive("optimizer.lr", self.lr)
        check_at_least("optimizer.weight_decay", self.weight_decay, 0.0)
        check_positive("optimizer.eps", self.eps)
        check_choice("optimizer.implementation", self.implementation, IMPLEMENTATIONS)
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ConfigError("optimizer.muon_momentum", self.muon_momentum, "a number in [0, 1)")
        check_positive("optimizer.muon_ns_steps", self.muon_ns_steps)
        check_at_least("optimizer.muon_adam_lr", self.muon_adam_lr, 0.0)
        check_at_least("optimizer.schedule_free_warmup_steps", self.schedule_free_warmup_steps, 0)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError("optimizer.betas", self.betas, "two numbers in [0, 1)")
