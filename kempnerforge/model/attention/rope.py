"""Rotary position embedding: the cos/sin tables (plain, or with linear or YaRN frequency
scaling)
and their application to queries and keys."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kempnerforge.config.model import ModelConfig, yarn_mscale


@dataclass(frozen=True)
class RopeScaling:
    """How rope_tables stretches the frequencies (model.rope_scaling and its parameters)."""

    kind: str = "none"
    """model.rope_scaling: 'none', 'linear' or 'yarn'."""
    factor: float = 1.0
    original_max_seq_len: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale: float = 0.0
    """YaRN's ``mscale`` (model.rope_yarn_mscale); 0 unset."""
    mscale_all_dim: float = 0.0
    """YaRN's ``mscale_all_dim`` (model.rope_yarn_mscale_all_dim); 0 unset."""

    @classmethod
    def of(cls, cfg: ModelConfig) -> RopeScaling:
        """The scaling ``cfg`` asks for."""
        return cls(
            kind=cfg.rope_scaling,
            factor=cfg.rope_scaling_factor,
            original_max_seq_len=cfg.rope_original_max_seq_len,
            beta_fast=cfg.rope_yarn_beta_fast,
            beta_slow=cfg.rope_yarn_beta_slow,
            truncate=cfg.rope_yarn_truncate,
            mscale=cfg.rope_yarn_mscale,
            mscale_all_dim=cfg.rope_yarn_mscale_all_dim,
        )


def rope_tables(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    device: torch.device | str | None = None,
    *,
    scaling: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Build the fp32 cos and sin tables, each of shape (max_seq_len, head_dim // 2).

    Row p holds the angles p * theta ** (-2i / head_dim) for i in [0, head_dim / 2); under
    ``scaling`` 'linear' every inverse frequency is divided by its factor (positions
    interpolated), under 'yarn' p times yarn_frequencies' (and both tables times its
    attention factor, which scales every attention logit by its square, as the YaRN
    paper's temperature does). Positions count from the start of the sequence, not of
    each packed document, so a document's positions depend on where it sits in the
    window (the mask keeps documents apart; RoPE's scores depend on distances only).
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    magnitude = 1.0
    if scaling is not None and scaling.kind == "yarn":
        inv_freq, magnitude = yarn_frequencies(inv_freq, head_dim, theta, scaling)
    elif scaling is not None and scaling.kind == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling is not None and scaling.kind != "none":
        raise ValueError(f"RoPE scaling {scaling.kind!r}: expected 'none', 'linear' or 'yarn'")
    positions = torch.arange(max_seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq)
    return angles.cos() * magnitude, angles.sin() * magnitude


def yarn_frequencies(
    inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling
) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies and attention factor (Peng et al., 2023), as GPT-OSS and
    DeepSeek-V3 use them.

    A frequency pair that turns more than ``beta_fast`` times over the original length
    is kept (extrapolated); one that turns fewer than ``beta_slow`` times is divided by
    the factor (interpolated); a linear ramp over the channel index blends the two in
    between. The ramp's ends are the channels where those rotation counts fall (with
    ``truncate``, rounded outwards to whole channels). The attention factor is m(1) =
    0.1 * ln(factor) + 1 (1 for a factor of at most 1), or with both of DeepSeek's
    ``mscale`` and ``mscale_all_dim`` set m(mscale) / m(mscale_all_dim) (config/model.py's
    yarn_mscale); DeepSeek's other use of mscale_all_dim, on the attention logits, is
    ModelConfig.attention_logit_multiplier.
    """

    def channel(rotations: float) -> float:
        """The channel (of head_dim) whose frequency turns ``rotations`` times."""
        turns = scaling.original_max_seq_len / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(theta))

    low, high = channel(scaling.beta_fast), channel(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of one point would divide by zero
    index = torch.arange(head_dim // 2, dtype=torch.float32, device=inv_freq.device)
    interpolated_share = ((index - low) / (high - low)).clamp(0, 1)
    kept_share = 1 - interpolated_share
    scaled = inv_freq / scaling.factor * interpolated_share + inv_freq * kept_share
    factor = scaling.factor
    magnitude = yarn_mscale(factor)
    if scaling.mscale and scaling.mscale_all_dim:
        mscales = yarn_mscale(factor, scaling.mscale), yarn_mscale(factor, scaling.mscale_all_dim)
        magnitude = mscales[0] / mscales[1]
    return scaled, magnitude


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x of shape (batch, seq, heads, head_dim) by the first seq rows of the tables,
    or by tables of each row's own positions (batch, seq, head_dim // 2).

    Half-split convention (as in Hugging Face Llama checkpoints): channel i is paired with
    channel i + head_dim / 2, not with its neighbour. The rotation runs in fp32 even if x
    is lower precision, and the result has x's dtype. The tables arrive in fp32 in every
    layout (a sharded block does not cast them to its bf16 compute dtype, see
    distributed/fsdp.py); a lower-precision table would round the angles.
    """
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    if cos.dim() == 3:  # each row's own positions (batch, seq, half): a cached decoding step
        c, s = cos.float()[:, :, None, :], sin.float()[:, :, None, :]
    else:
        c = cos[: x.shape[1]].float()[None, :, None, :]
        s = sin[: x.shape[1]].float()[None, :, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def model_rope_tables(
    cfg: ModelConfig, device: torch.device | str | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (cos, sin) table of each RoPE kind of ``cfg`` (ModelConfig.layer_rope): the
    global one (model.rope_theta with model.rope_scaling), then, with
    model.rope_local_theta, the sliding layers' (unscaled)."""
    scaling = RopeScaling.of(cfg)
    dim = cfg.rope_dim
    tables = [rope_tables(dim, cfg.max_seq_len, cfg.rope_theta, device, scaling=scaling)]
    if cfg.rope_local_theta:
        tables.append(rope_tables(dim, cfg.max_seq_len, cfg.rope_local_theta, device))
    return tables
