"""The adapter (connector) of a vision-language model: image tokens of the encoder's width
-> tokens of the decoder's width, optionally average-pooled over the token grid first."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kempnerforge.config.vlm import AdapterConfig, VisionSpec
from kempnerforge.model.weight_init import fill_parameter, parameter_seed, zero_parameter

ACTIVATIONS: dict[str, type[nn.Module]] = {"gelu": nn.GELU, "silu": nn.SiLU, "relu": nn.ReLU}


class ImageAdapter(nn.Module):
    """Linear -> activation -> Linear on every image token, after pooling the token grid in
    pool_window x pool_window squares (pool_window 1: no pooling).

    Pooling first makes an image cost pool_window ** 2 times fewer tokens in the decoder
    and shrinks the MLP's work by as much. The input is cast to the adapter's own weight
    dtype, so an encoder that keeps another dtype (a bf16 tower) feeds an fp32 adapter.
    """

    def __init__(
        self,
        feature_dim: int,
        hidden_dim: int,
        out_dim: int,
        activation: str,
        grid: int,
        pool_window: int = 1,
    ) -> None:
        super().__init__()
        if grid % pool_window:
            raise ValueError(
                f"adapter.pool_window = {pool_window} must divide the token grid side {grid}"
            )
        self.grid = grid
        """Tokens along each side of the encoder's token grid."""
        self.pool_window = pool_window
        """Tokens averaged along each side of a pooling square; 1 for none."""
        self.num_output_tokens = (grid // pool_window) ** 2
        """Tokens per image after the adapter."""
        self.fc1 = nn.Linear(feature_dim, hidden_dim)
        """Encoder features -> hidden width."""
        self.act = ACTIVATIONS[activation]()
        """The nonlinearity between the two layers."""
        self.fc2 = nn.Linear(hidden_dim, out_dim)
        """Hidden width -> the decoder's width."""

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """(batch, grid ** 2, feature_dim) -> (batch, num_output_tokens, out_dim)."""
        x = features.to(self.fc1.weight.dtype)
        if self.pool_window > 1:
            x = pool_grid(x, self.grid, self.pool_window)
        # A Linear over (batch, tokens, dim) returns a view of its 2-D product; FSDP hooks
        # the backward of a unit's output, which an in-place op on a view would bypass
        # (torch warns about it), so the adapter returns a tensor of its own.
        return self.fc2(self.act(self.fc1(x))).clone()

    @torch.no_grad()
    def init_weights(self, seed: int, prefix: str = "") -> None:
        """Weights normal with std 1/sqrt(fan-in), biases zero; each weight drawn from
        ``seed`` and its name (``prefix`` + name, its name in the enclosing model).

        Fan-in scaling keeps each layer's output at its input's scale: the encoder's
        features have no fixed scale that a constant std would suit.
        """
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                zero_parameter(param)
            else:
                std = param.shape[-1] ** -0.5
                fill_parameter(param, std, parameter_seed(seed, prefix + name))


def pool_grid(tokens: torch.Tensor, grid: int, window: int) -> torch.Tensor:
    """Average (batch, grid * grid, dim) row-major grid tokens over window x window squares:
    (batch, (grid // window) ** 2, dim), still row-major."""
    batch, count, dim = tokens.shape
    if count != grid * grid:
        raise ValueError(
            f"the adapter got {count} image tokens per image; it pools a {grid} x {grid} grid"
        )
    image = tokens.transpose(1, 2).reshape(batch, dim, grid, grid)
    pooled = F.avg_pool2d(image, kernel_size=window, stride=window)
    return pooled.flatten(2).transpose(1, 2)


def build_adapter(cfg: AdapterConfig, spec: VisionSpec, out_dim: int) -> ImageAdapter:
    """The adapter ``cfg`` describes, from the encoder's token shape to width ``out_dim``."""
    window = cfg.pool_window if cfg.type == "pool" else 1
    return ImageAdapter(
        spec.feature_dim, cfg.hidden_dim or out_dim, out_dim, cfg.activation, spec.grid, window
    )
