"""A replica group's live state as plain tensors, and the transport that moves it between
groups without running code from the network.

A group that rejoins takes the model, optimizer and loop state from a peer over torchft's
HTTP checkpoint transport. torchft reads what arrives with ``weights_only=False`` (it
unpickles anything); WeightsOnlyHTTPTransport reads it with torch's weights-only
unpickler, so a peer (or anything that answers in its place) can send tensors, numbers,
strings and containers, and nothing callable. Sharded values (DTensors) travel as this
rank's local shard: the peer with the same rank in its group holds the same shard.
"""

from __future__ import annotations

import urllib.request
from datetime import timedelta
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torchft.checkpointing._serialization import _streaming_load
from torchft.checkpointing.http_transport import HTTPTransport


class WeightsOnlyHTTPTransport(HTTPTransport):
    """torchft's HTTP checkpoint transport, whose receiving side unpickles weights-only.

    A payload holding anything but tensors, numbers, strings, None and plain containers
    fails the transfer with torch's UnpicklingError; torchft then reports the error, the
    step is discarded and the group retries its quorum.
    """

    @classmethod
    def _load_from_address(cls, address: str, timeout: timedelta) -> object:
        # Replaces torchft's loader, which passes weights_only=False.
        with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
            return _streaming_load(f, weights_only=True)


def to_local(value: Any) -> Any:
    """``value`` with every DTensor inside it (nested in dicts, lists, tuples) replaced by
    this rank's local shard, which shares its storage."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {k: to_local(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_local(v) for v in value)
    return value


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's share of the model's parameters and buffers, as plain tensors."""
    return to_local(model.state_dict())


def load_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a peer's model_state into this rank's shards, key by key.

    Raises KeyError naming a missing or unexpected key, and ValueError naming a key whose
    shape differs: the peer must run the same model and layout.
    """
    own = model.state_dict()
    if own.keys() != state.keys():
        diff = sorted(own.keys() ^ state.keys())
        raise KeyError(f"the peer's model state differs in keys: {', '.join(diff[:5])}")
    with torch.no_grad():
        for key, value in own.items():
            local = value.to_local() if isinstance(value, DTensor) else value
            incoming = state[key]
            if local.shape != incoming.shape:
                raise ValueError(
                    f"the peer's {key} has shape {tuple(incoming.shape)}, this rank's "
                    f"{tuple(local.shape)}: the groups must use the same layout"
                )
            local.copy_(incoming)


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state_dict with this rank's local shards in place of DTensors."""
    return to_local(optimizer.state_dict())


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a peer's optimizer_state: a local shard of a sharded parameter's state becomes a
    DTensor laid out as the parameter is, so the optimizer steps as if it had saved it."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    per_param: dict[Any, Any] = {}
    for index, values in state["state"].items():
        param = params[int(index)]
        per_param[index] = {
            name: _as_param_layout(value, param) for name, value in dict(values).items()
        }
    optimizer.load_state_dict({"state": per_param, "param_groups": state["param_groups"]})


def _as_param_layout(value: Any, param: torch.Tensor) -> Any:
    """A local shard of ``param``'s state as a DTensor like ``param``; others unchanged."""
    if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor):
        return value
    if value.dim() == 0 or value.shape != param.to_local().shape:
        return value  # a scalar such as Adam's step counter
    return DTensor.from_local(
        value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
    )
