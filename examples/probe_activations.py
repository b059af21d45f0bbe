"""Example: what do captured activations know? A linear probe per layer.

First capture some layers of a trained byte-level model, then probe them:

    kempnerforge capture --checkpoint runs/debug/checkpoints/step_400 \\
        --layers tok_embeddings,layers.0,layers.1,layers.2,layers.3 --batches 8
    python examples/probe_activations.py runs/debug/checkpoints/step_400/activations.safetensors

For each captured layer it fits, by least squares on the first 80% of positions, a linear
map from the layer's output to "the *next* byte is a space or newline" and reports the
accuracy on the other 20%. The embedding cannot know the next byte beyond what the current
one implies; later layers, which have read the context, usually do better.
"""

from __future__ import annotations

import sys

import torch
from safetensors.torch import load_file

WHITESPACE = (9, 10, 32)  # tab, newline, space in the byte tokenizer


def probe_accuracy(features: torch.Tensor, target: torch.Tensor, train_share: float = 0.8) -> float:
    """Held-out accuracy of a least-squares linear probe (with a bias) for a 0/1 target."""
    x = torch.cat([features, torch.ones(len(features), 1)], dim=1).double()
    y = target.double()
    cut = int(len(x) * train_share)
    ridge = 1e-3 * torch.eye(x.shape[1], dtype=x.dtype)
    weights = torch.linalg.solve(x[:cut].T @ x[:cut] + ridge, x[:cut].T @ y[:cut])
    predicted = (x[cut:] @ weights) > 0.5
    return float((predicted == y[cut:].bool()).double().mean())


def main(path: str) -> None:
    tensors = load_file(path)
    ids = tensors.pop("input_ids")
    # Position t predicts byte t + 1: drop the last position, whose next byte is unknown.
    target = torch.isin(ids[:, 1:], torch.tensor(WHITESPACE)).reshape(-1)
    base_rate = float(target.double().mean())
    print(f"{len(target)} positions, next byte is whitespace at {base_rate:.1%} of them")
    for name, acts in tensors.items():
        features = acts[:, :-1].reshape(len(target), -1)
        accuracy = probe_accuracy(features, target)
        print(f"{name:<20} mean |x| {acts.abs().mean():8.4f}   probe accuracy {accuracy:.1%}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/probe_activations.py ACTIVATIONS.safetensors")
    main(sys.argv[1])
