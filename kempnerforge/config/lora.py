"""[lora]: low-rank adapters on the decoder's projections, the base weights frozen
(model/lora.py). ``rank = 0`` (the default) trains every weight, as without the section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kempnerforge.config.checks import check_in_range, check_positive
from kempnerforge.core.errors import ConfigError, closest_name

if TYPE_CHECKING:
    from kempnerforge.config.job import JobConfig

PROJECTIONS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
"""The projections an adapter may go on: attention's query, key, value and output, and a
dense feed-forward's gate (w1), down (w2) and up (w3) projections."""

MAX_ALPHA = 1e6
"""lora.alpha's bound: alpha / rank scales the update, and no use needs it near float32's
range (common values are rank to 4 x rank)."""

HF_NAMES = {
    "q_proj": "wq",
    "k_proj": "wk",
    "v_proj": "wv",
    "o_proj": "wo",
    "gate_proj": "w1",
    "down_proj": "w2",
    "up_proj": "w3",
}
"""The Hugging Face module names (as peft's target_modules writes them) of PROJECTIONS."""


@dataclass
class LoRAConfig:
    rank: int = 0
    """The adapters' rank r; 0: no adapters, every weight trains."""
    alpha: float = 16.0
    """The update is scaled by alpha / rank (peft's lora_alpha)."""
    dropout: float = 0.0
    """Dropout on an adapter's input while training (peft's lora_dropout), in [0, 1)."""
    target_modules: list[str] = field(default_factory=lambda: list(PROJECTIONS))
    """The projections to adapt in every decoder block: wq, wk, wv, wo (attention), w1,
    w2, w3 (a dense feed-forward), or their Hugging Face names (q_proj, k_proj, v_proj,
    o_proj, gate_proj, down_proj, up_proj). An MoE layer's experts are not adapted."""

    def __post_init__(self) -> None:
        if self.rank:
            check_positive("lora.rank", self.rank, 2**16)
        check_positive("lora.alpha", self.alpha, MAX_ALPHA)
        check_in_range("lora.dropout", self.dropout, 0.0, 0.999)
        if not self.target_modules:
            raise ConfigError("lora.target_modules", [], f"one or more of {', '.join(PROJECTIONS)}")
        for name in self.target_modules:
            if name not in PROJECTIONS and name not in HF_NAMES:
                known = [*PROJECTIONS, *HF_NAMES]
                suggestion = closest_name(name, known)
                hint = f"; did you mean {suggestion!r}?" if suggestion else ""
                raise ConfigError(
                    "lora.target_modules",
                    self.target_modules,
                    f"names among {', '.join(known)}",
                    f"{name!r} is none of them{hint}",
                )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def projections(self) -> tuple[str, ...]:
        """target_modules in our names, each once, in PROJECTIONS order."""
        ours = {HF_NAMES.get(name, name) for name in self.target_modules}
        return tuple(p for p in PROJECTIONS if p in ours)


def check_lora_job(config: JobConfig) -> None:
    """[lora] against the rest of the job: a text model and no FP8 layers. Which of the
    named projections the model has is checked when it is built (model/lora.py add_adapters)."""
    lora = config.lora
    if not lora.enabled:
        return
    if config.is_vlm:
        raise ConfigError(
            "lora.rank",
            lora.rank,
            "0 for a vision-language job ([vlm])",
            "a [vlm] job trains by its freeze groups (vlm.freeze); adapters are for text models",
        )
    if config.train.float8:
        raise ConfigError(
            "train.float8",
            True,
            "false with lora.rank > 0",
            "FP8 layers replace the projections the adapters wrap; train in bf16 or fp32",
        )
