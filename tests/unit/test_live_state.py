"""The live state a rejoining replica group takes from a peer: what travels, and that
nothing callable does."""

from __future__ import annotations

import copy
import pickle
from datetime import timedelta

import pytest
import torch

pytest.importorskip("torchft", reason="the live state travels over torchft (the ft extra)")
from torchft.checkpointing.http_transport import HTTPTransport  # noqa: E402

from kempnerforge.distributed.live_state import (  # noqa: E402
    WeightsOnlyHTTPTransport,
    load_model_state,
    load_optimizer_state,
    model_state,
    optimizer_state,
)

TIMEOUT = timedelta(seconds=10)


_RAN: list[str] = []


def _planted_code(message: str) -> None:
    _RAN.append(message)


class _Planted:
    """Unpickling this runs code: _planted_code, which records that it ran."""

    def __reduce__(self):
        return (_planted_code, ("planted code ran",))


def _serve(state: object) -> HTTPTransport:
    sender = HTTPTransport(TIMEOUT, num_chunks=0)
    sender.send_checkpoint(dst_ranks=[1], step=3, state_dict=state, timeout=TIMEOUT)
    return sender


def test_tensors_numbers_and_containers_arrive():
    state = {"user": {"w": torch.arange(4.0), "step": 3, "name": "x", "lrs": [0.1, None]}}
    sender = _serve(state)
    receiver = WeightsOnlyHTTPTransport(TIMEOUT, num_chunks=0)
    try:
        got = receiver.recv_checkpoint(0, sender.metadata(), 3, TIMEOUT)
    finally:
        sender.shutdown()
        receiver.shutdown()
    assert torch.equal(got["user"]["w"], state["user"]["w"])
    assert got["user"]["lrs"] == [0.1, None] and got["user"]["step"] == 3


def test_a_planted_callable_is_refused_and_never_runs():
    sender = _serve({"user": {"evil": _Planted()}})
    receiver = WeightsOnlyHTTPTransport(TIMEOUT, num_chunks=0)
    try:
        with pytest.raises(pickle.UnpicklingError, match="Unsupported global"):
            receiver.recv_checkpoint(0, sender.metadata(), 3, TIMEOUT)
        assert _RAN == []
        # torchft's own transport would have run it: the refusal is this class's doing.
        HTTPTransport(TIMEOUT, num_chunks=0).recv_checkpoint(0, sender.metadata(), 3, TIMEOUT)
        assert _RAN == ["planted code ran"]
    finally:
        sender.shutdown()
        receiver.shutdown()
        _RAN.clear()


def _trained_pair() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(5, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_a_fresh_model_and_optimizer_continue_exactly_as_the_peer():
    torch.manual_seed(0)
    peer, peer_opt = _trained_pair()
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    # Copied, as the transfer copies them: the two optimizers must not share tensors.
    load_model_state(fresh, copy.deepcopy(model_state(peer)))
    load_optimizer_state(fresh_opt, copy.deepcopy(optimizer_state(peer_opt)))
    batch = torch.randn(5, 4)
    for model, optimizer in ((peer, peer_opt), (fresh, fresh_opt)):
        model(batch).square().sum().backward()
        optimizer.step()
    for a, b in zip(peer.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_model_of_another_shape_is_refused_naming_the_key():
    small, large = torch.nn.Linear(4, 3), torch.nn.Linear(4, 5)
    with pytest.raises(ValueError, match="the peer's weight has shape \\(5, 4\\)"):
        load_model_state(small, model_state(large))
