"""An MoE layer whose experts' hidden features are split over a tensor-parallel group.

Every rank of the group holds the whole tokens and the whole (replicated) router, and a
slice of each expert's hidden features: the gate and up projections' columns, the down
projection's rows (the shared experts alike). A rank's output is then a partial sum that
the group adds up (distributed/moe_tensor_parallel.py does it, with the gathering of the
tokens), and the gradient the layer gives its input is this rank's share of the whole,
summed over the group the same way. Three things keep that exact while the routing
stays the one a single process computes, on every rank alike:

- the router's path back to the tokens carries 1/tp of its gradient (router_input): every
  rank computes all of it, and the group's sum must count it once;
- the gates' gradients are summed over the group (grad_identity.summed_grad, one
  all-reduce of tokens x top_k values): each rank's is the gates' product with its
  partial outputs, so the router's weights, whose other gradients are whole on every
  rank, get the same whole gradient everywhere;
- the experts' down biases are added by one rank only (added_once), whose gradient every
  rank still takes whole.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from kempnerforge.model.grad_identity import scaled_grad
from kempnerforge.model.mlp import SwiGLU


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's values of ``tensor``: the local shard of a DTensor, else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def router_input(tokens: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``tokens`` for the router: the same values, with the gradient divided by the group's
    size (the group's sum of the input gradients then counts the router's once)."""
    if group is None:
        return tokens
    return scaled_grad(tokens, 1.0 / dist.get_world_size(group))


def added_once(bias: torch.Tensor, here: bool) -> torch.Tensor:
    """``bias`` where this rank adds it (``here``), zeros elsewhere; the gradient is the
    whole one on every rank, as a replicated parameter's must be."""
    return bias if here else _ZeroForward.apply(bias)


def shared_partial(shared: SwiGLU, tokens: torch.Tensor) -> torch.Tensor:
    """The shared experts' output from this rank's slice of their hidden features: a
    partial sum over the tensor-parallel group."""
    w1, w3, w2 = (local(p.weight) for p in (shared.w1, shared.w3, shared.w2))
    return F.linear(shared.activation(F.linear(tokens, w1)) * F.linear(tokens, w3), w2)


class _ZeroForward(torch.autograd.Function):
    """Zeros like the input; the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad
