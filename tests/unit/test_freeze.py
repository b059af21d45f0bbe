"""Freeze schedules: the state at each step, flipping groups, and the optimizer across it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kempnerforge.checkpoint.manager import CheckpointManager
from kempnerforge.config.checkpoint import CheckpointConfig
from kempnerforge.config.freeze import FreezeSpec, FreezeStage
from kempnerforge.config.job import JobConfig
from kempnerforge.config.loader import load_config
from kempnerforge.config.optimizer import OptimizerConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.optim.optimizer import build_optimizer
from kempnerforge.training.families import family_of
from kempnerforge.training.freeze import (
    FreezeSchedule,
    apply_freeze,
    canonical_freeze_meta,
    check_saved_freeze,
    effective_freeze,
)
from kempnerforge.training.loop import checkpoint_extra
from kempnerforge.training.phases import PhaseState

GROUPS = ("encoder", "adapter", "decoder")


class ThreeGroups(nn.Module):
    """Parameters under the three submodule names a joint-decoder VLM has."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(4, 4)
        self.adapter = nn.Linear(4, 4)
        self.decoder = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.adapter(self.encoder(x)))


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.ones(3, 4)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _vlm_config(*extra: str) -> JobConfig:
    return load_config(None, ["--vision_encoder.type=random", "--vlm.max_text_len=8", *extra])


def _schedule(config: JobConfig) -> FreezeSchedule:
    return family_of(config).freeze_schedule(config)


def test_effective_freeze_applies_stages_up_to_the_step_last_word_wins():
    base = [FreezeSpec("encoder", True)]
    schedule = [
        FreezeStage(3, [FreezeSpec("encoder", False), FreezeSpec("decoder", True)]),
        FreezeStage(5, [FreezeSpec("decoder", False)]),
    ]
    states = [effective_freeze(s, base, schedule, GROUPS) for s in (0, 2, 3, 4, 5, 100)]
    off = {"encoder": False, "adapter": False, "decoder": False}
    assert states[0] == states[1] == {**off, "encoder": True}
    assert states[2] == states[3] == {**off, "decoder": True}
    assert states[4] == states[5] == off


def test_freeze_meta_is_sorted_and_absent_for_text_jobs():
    config = _vlm_config()
    assert checkpoint_extra(config, 0, PhaseState())["vlm_freeze"] == [
        {"module": "adapter", "frozen": False},
        {"module": "decoder", "frozen": False},
        {"module": "encoder", "frozen": True},
    ]
    assert "vlm_freeze" not in checkpoint_extra(JobConfig(), 5, PhaseState())
    assert _schedule(JobConfig()).groups == ()


def test_apply_freeze_is_idempotent_and_drops_grads_and_optimizer_state():
    model = ThreeGroups()
    optimizer = build_optimizer(model, OptimizerConfig())
    _train_step(model, optimizer)
    assert model.encoder.weight in optimizer.state
    model(torch.ones(1, 4)).sum().backward()  # leaves gradients behind
    changed = apply_freeze(model, {"encoder": True, "adapter": False, "decoder": False}, optimizer)
    assert changed == {"-encoder": 20}
    assert not model.encoder.weight.requires_grad and model.encoder.weight.grad is None
    assert model.encoder.weight not in optimizer.state and model.encoder.bias not in optimizer.state
    assert model.adapter.weight in optimizer.state  # untouched groups keep theirs
    again = apply_freeze(model, {"encoder": True, "adapter": False, "decoder": False}, optimizer)
    assert again == {}


@pytest.mark.parametrize("name", ["adamw", "lion", "muon", "schedule_free_adamw"])
def test_a_group_frozen_when_the_optimizer_is_built_trains_once_unfrozen(name):
    model = ThreeGroups()
    apply_freeze(model, {"encoder": True, "adapter": False, "decoder": False})
    optimizer = build_optimizer(model, OptimizerConfig(name=name, lr=1e-2))
    known = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert {id(p) for p in model.parameters()} <= known  # frozen ones included
    before = model.encoder.weight.detach().clone()
    for _ in range(2):
        _train_step(model, optimizer)
    assert torch.equal(model.encoder.weight, before)  # no update, no weight decay
    assert not any(
        k in ("exp_avg", "momentum_buffer") for k in optimizer.state[model.encoder.weight]
    )
    apply_freeze(model, {"encoder": False, "adapter": False, "decoder": False}, optimizer)
    _train_step(model, optimizer)
    assert not torch.equal(model.encoder.weight, before)


def test_phase_state_fires_freeze_stages_once_and_skips_to_a_step():
    stages = [
        FreezeStage(2, [FreezeSpec("encoder", False)]),
        FreezeStage(4, [FreezeSpec("adapter", True)]),
    ]
    phases = PhaseState(freeze_stages=stages)
    assert phases.advance_freeze(1) == []
    assert phases.advance_freeze(2) == [stages[0]]
    assert phases.advance_freeze(2) == []
    assert phases.advance_freeze(9) == [stages[1]]
    restored = PhaseState(freeze_stages=stages)
    restored.skip_freeze_to(3)
    assert restored.advance_freeze(4) == [stages[1]]
    restored.load_state_dict(phases.state_dict())
    assert restored.freeze_index == 2


def test_a_resume_checks_the_schedule_against_the_saved_state():
    saved = canonical_freeze_meta({"encoder": False, "adapter": False, "decoder": False})
    unfreeze_at_3 = (
        '--vlm.freeze_schedule=[{start_step=3, specs=[{module="encoder", frozen=false}]}]'
    )
    check_saved_freeze(saved, _schedule(_vlm_config(unfreeze_at_3)), 3, "ckpt/step_3")
    # A stage still to come may be added or changed; the past may not.
    added = unfreeze_at_3.replace("}]}]", '}]}, {start_step=10, specs=[{module="adapter"}]}]')
    check_saved_freeze(saved, _schedule(_vlm_config(added)), 5, "ckpt/step_5")
    with pytest.raises(ConfigError) as info:
        check_saved_freeze(saved, _schedule(_vlm_config()), 3, "ckpt/step_3")
    assert info.value.field == "vlm.freeze_schedule"
    assert "encoder trainable there, frozen by this config" in str(info.value)
    assert "ckpt/step_3" in str(info.value)


def test_a_checkpoint_keeps_no_state_for_frozen_parameters_and_loads_back_exactly(tmp_path):
    def parts(seed: int):
        torch.manual_seed(seed)
        model = ThreeGroups()
        apply_freeze(model, {"encoder": True, "adapter": False, "decoder": False})
        optimizer = build_optimizer(model, OptimizerConfig(lr=1e-2))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        return model, optimizer, scheduler

    model, optimizer, scheduler = parts(0)
    for _ in range(2):
        _train_step(model, optimizer)
    manager = CheckpointManager(CheckpointConfig(), str(tmp_path / "ckpt"))
    path = manager.save(
        2, model=model, optimizer=optimizer, scheduler=scheduler, train_state={"tokens_seen": 0}
    )
    loaded_model, loaded_optimizer, loaded_scheduler = parts(1)
    manager.load(path, model=loaded_model, optimizer=loaded_optimizer, scheduler=loaded_scheduler)
    assert loaded_model.encoder.weight not in loaded_optimizer.state
    for a, b in zip(model.parameters(), loaded_model.parameters(), strict=True):
        assert torch.equal(a, b)
        assert (a in optimizer.state) == (b in loaded_optimizer.state)
        for key, value in optimizer.state.get(a, {}).items():
            assert torch.equal(value, loaded_optimizer.state[b][key])
    # Both continue identically, also after unfreezing the encoder.
    for m, o in ((model, optimizer), (loaded_model, loaded_optimizer)):
        apply_freeze(m, {"encoder": False, "adapter": False, "decoder": False}, o)
        _train_step(m, o)
    for a, b in zip(model.parameters(), loaded_model.parameters(), strict=True):
        assert torch.equal(a, b)
