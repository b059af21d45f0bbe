"""[optimizer]: which optimizer updates the weights, and its hyperparameters."""

from __future__ import annotations

from dataclasses import dataclass, field

from kempnerforge.config.checks import (
    MAX_LR,
    MAX_STEPS,
    check_at_least,
    check_choice,
    check_positive,
)
from kempnerforge.core.errors import ConfigError

IMPLEMENTATIONS = ("auto", "foreach", "fused", "for_loop")
FUSED_OPTIMIZERS = ("adamw",)
"""Built-in optimizers that take implementation = 'fused'."""
NON_FUSED_OPTIMIZERS = ("lion", "muon", "schedule_free_adamw")
"""Built-in optimizers without a fused kernel: 'fused' is refused for them at startup."""


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    """Optimizer by registered name: 'adamw', 'lion', 'muon' or 'schedule_free_adamw'
    (see docs/optimizers.md)."""
    lr: float = 3e-4
    """Peak learning rate; the scheduler scales it. > 0 and at most 10."""
    weight_decay: float = 0.1
    """Decoupled weight decay applied to matrices (see the two switches below for the rest);
    0 to 10."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam (beta1, beta2); Lion's interpolation and momentum coefficients; schedule-free
    AdamW's interpolation (beta1) and second-moment (beta2) coefficients."""
    eps: float = 1e-8
    """Adam epsilon, added to the root of the second moment; > 0 and at most 1."""
    decay_norms_and_biases: bool = False
    """Also apply weight decay to norm weights and biases (1-D parameters, and the experts'
    biases stacked per expert)."""
    decay_embeddings: bool = False
    """Also apply weight decay to the token embedding table."""
    implementation: str = "auto"
    """How the optimizer steps its parameters: 'for_loop' (one parameter at a time),
    'foreach' (each operation as one multi-tensor call over a parameter group), 'fused'
    (AdamW only: torch's one-kernel AdamW, for floating-point parameters on a device it
    supports, CPU and CUDA included) or 'auto', the fastest measured: AdamW fused where
    supported, else foreach; Lion, Muon and schedule-free AdamW the loop for CPU tensors
    and foreach on accelerators and for DTensors, with Muon's internal AdamW fused on CPU.
    All agree to float rounding; a resumed run resolves 'auto' the same way on the same
    devices. Step times: docs/optimizers.md."""
    muon_momentum: float = 0.95
    """Muon only: Nesterov momentum coefficient of the orthogonalised matrix updates."""
    muon_ns_steps: int = 5
    """Muon only: Newton-Schulz iterations that orthogonalise each matrix update; 1 to 100."""
    muon_adam_lr: float = 0.0
    """Muon only: peak LR of the internal AdamW (embeddings, output head, MoE routers, 1-D
    parameters); 0 means optimizer.lr; at most 10."""
    schedule_free_warmup_steps: int = 0
    """Schedule-free AdamW only: steps of linear LR warmup inside the optimizer; 0 = none;
    at most 2**62 - 1."""

    def __post_init__(self) -> None:
        check_positive("optimizer.lr", self.lr, MAX_LR)
        # Each step scales weights by 1 - lr * weight_decay; usual values are 0 to 0.1 (Lion
        # up to about 1), and above 10 the decay flips weights' signs at any usual lr.
        check_at_least("optimizer.weight_decay", self.weight_decay, 0.0, 10.0)
        # Epsilon guards a division by a gradient scale of ~1e-3 and below; above 1 it
        # would swamp every update.
        check_positive("optimizer.eps", self.eps, 1.0)
        check_choice("optimizer.implementation", self.implementation, IMPLEMENTATIONS)
        if self.implementation == "fused" and self.name in NON_FUSED_OPTIMIZERS:
            raise fused_unsupported(self.name)
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ConfigError("optimizer.muon_momentum", self.muon_momentum, "a number in [0, 1)")
        # Five iterations converge; each costs matmuls of every weight matrix per step.
        check_positive("optimizer.muon_ns_steps", self.muon_ns_steps, 100)
        check_at_least("optimizer.muon_adam_lr", self.muon_adam_lr, 0.0, MAX_LR)
        check_at_least(
            "optimizer.schedule_free_warmup_steps", self.schedule_free_warmup_steps, 0, MAX_STEPS
        )
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError("optimizer.betas", self.betas, "two numbers in [0, 1)")


def fused_unsupported(name: str) -> ConfigError:
    """The error for optimizer.implementation = 'fused' with an optimizer that has no fused
    kernel."""
    return ConfigError(
        "optimizer.implementation",
        "fused",
        "'auto', 'foreach' or 'for_loop' for optimizer.name = " + repr(name),
        "'fused' exists for " + ", ".join(FUSED_OPTIMIZERS) + " only",
    )
