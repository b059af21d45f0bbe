"""train.float8: refused in one line where FP8 cannot run, and the swap of the blocks'
projections (torchao's Float8Linear runs on the CPU too, emulated, so the swap's
numerics and names are checked here; speed is measured on a GPU by bench/gpu/)."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from kempnerforge.cli import main
from kempnerforge.config.float8 import check_float8_config
from kempnerforge.config.loader import config_to_dict, load_config
from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.distributed.activation_checkpointing import apply_ac
from kempnerforge.model.transformer import build_model
from kempnerforge.training.float8 import (
    apply_float8,
    check_float8,
    check_torchao_installed,
    convert_projections,
)
from kempnerforge.training.resume_guard import check_config_changes, kind_of

DEBUG = "configs/train/debug.toml"
FP8_SHAPE = ["--model.dim=64", "--model.n_heads=4", "--model.multiple_of=16"]


def fp8_config(*overrides: str):
    return load_config(None, ["--train.float8=true", *FP8_SHAPE, *overrides])


def test_float8_on_the_cpu_is_refused_naming_the_field_and_why():
    with pytest.raises(ConfigError) as info:
        check_float8(fp8_config("--train.device=cpu").train)
    message = str(info.value)
    assert message.startswith("train.float8 = True: expected false on a cpu device")
    assert "compute capability 8.9" in message and "\n" not in message


def test_the_cli_refuses_float8_on_the_cpu_in_one_line_with_exit_2_before_building(
    tmp_path, capsys, package_logging
):
    run_dir = tmp_path / "run"
    code = main(
        ["train", DEBUG, "--train.float8=true", "--train.device=cpu", f"--train.run_dir={run_dir}"]
    )
    err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("kempnerforge:")]
    assert len(lines) == 1 and "Traceback" not in err
    assert lines[0].startswith("kempnerforge: error: train.float8 = True: expected false on a cpu")
    assert not run_dir.exists()  # refused before the run directory or the data


def test_float8_off_checks_nothing():
    check_float8(
        load_config(None, ["--train.device=cpu", "--model.dim=72", "--train.seq_len=9"]).train
    )


def test_a_missing_torchao_is_refused_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # what `import torchao` finds uninstalled
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ConfigError) as info:
        check_torchao_installed()
    assert str(info.value).startswith("train.float8 = True: expected false when torchao is not")
    assert "pip install 'kempnerforge[float8]'" in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["--model.dim=72", "--model.n_heads=4"], "model.dim = 72"),
        (["--model.dim=96", "--model.n_heads=8", "--model.n_kv_heads=2"], "model.n_kv_heads = 2"),
        (["--model.ffn_hidden_dim=100"], "model.ffn_hidden_dim = 100"),
        (["--train.seq_len=100"], "train.seq_len = 100"),
        (
            [
                "--model.num_experts=4",
                "--model.moe_shared_experts=1",
                "--model.moe_expert_hidden_dim=40",
            ],
            "model.moe_expert_hidden_dim = 40",
        ),
    ],
)
def test_a_dim_that_is_not_a_multiple_of_16_is_refused_naming_its_field(overrides, field):
    with pytest.raises(ConfigError) as info:
        check_float8_config(fp8_config(*overrides))
    assert str(info.value).startswith(f"{field}: expected a value that makes")
    assert "a multiple of 16 with train.float8 = true" in str(info.value)


def test_dims_that_are_multiples_of_16_pass():
    check_float8_config(fp8_config("--model.ffn_hidden_dim=160", "--train.seq_len=128"))


def test_float8_with_tensor_parallelism_or_a_vlm_is_refused():
    with pytest.raises(ConfigError, match=r"^train.float8 = True: expected false with distrib"):
        check_float8_config(fp8_config("--distributed.tp=2"))
    vlm = load_config("configs/train/vlm_debug.toml", ["--train.float8=true"])
    # A vision-language job's rules are its own (config/vlm.py's check_job).
    with pytest.raises(ConfigError, match=r"expected false for a vision-language job"):
        vlm.validate(1)


def test_the_build_refuses_a_cpu_device_too():
    with torch.device("meta"):
        model = build_model(ModelConfig(dim=64, n_heads=4, multiple_of=16))
    with pytest.raises(ConfigError, match=r"^train.float8 = True: expected false on a cpu"):
        apply_float8(model, torch.device("cpu"), compiled=True)
    assert not any(type(m).__name__ == "Float8Linear" for m in model.modules())


def _moe_config() -> ModelConfig:
    return ModelConfig(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        multiple_of=16,
        num_experts=4,
        moe_frequency=2,  # layer 0 dense, layer 1 MoE
        moe_shared_experts=1,
        moe_expert_hidden_dim=32,
        max_seq_len=64,
    )


def test_fp8_covers_the_block_projections_and_shared_experts_only():
    with torch.device("meta"):
        model = build_model(_moe_config())
    assert convert_projections(model) == 7 + 7  # 4 attention + 3 SwiGLU per block
    kinds = {name: type(m).__name__ for name, m in model.named_modules()}
    converted = sorted(n for n, kind in kinds.items() if kind == "Float8Linear")
    assert "layers.1.feed_forward.shared.w1" in converted
    assert "layers.0.feed_forward.w2" in converted and "layers.1.attention.wk" in converted
    assert kinds["layers.1.feed_forward.router.gate"] == "Linear"  # scores stay fp32
    assert kinds["layers.1.feed_forward.experts"] == "GroupedExperts"  # no nn.Linear
    assert kinds["output"] == "Linear"


def _materialized(convert: bool) -> nn.Module:
    """Built on meta, optionally converted, checkpointed, then materialised and drawn: the
    order of the training build."""
    with torch.device("meta"):
        model = build_model(_moe_config())
    if convert:
        convert_projections(model)
    apply_ac(model, "full", 2)
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    return model


def test_fp8_keeps_parameter_names_and_initial_values_and_trains_close_to_fp32():
    plain, fp8 = _materialized(False), _materialized(True)
    plain_state, fp8_state = plain.state_dict(), fp8.state_dict()
    assert list(plain_state) == list(fp8_state)  # checkpoints read the same
    assert all(torch.equal(plain_state[k], fp8_state[k]) for k in plain_state)
    ids = torch.randint(0, 259, (2, 32), generator=torch.Generator().manual_seed(0))
    losses, grads = [], []
    for model in (plain, fp8):
        logits = model(ids[:, :-1])
        assert isinstance(logits, torch.Tensor)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
        grads.append(dict(model.named_parameters())["layers.0.attention.wq.weight"].grad)
    assert losses[0] == pytest.approx(losses[1], rel=0.02)  # e4m3 keeps ~2 significant digits
    assert losses[0] != losses[1]  # the FP8 model did run FP8 matmuls
    cosine = nn.functional.cosine_similarity(grads[0].flatten(), grads[1].flatten(), dim=0)
    assert cosine > 0.95


def test_turning_float8_on_at_a_resume_applies_with_a_warning(log):
    config = fp8_config()
    saved = load_config(None, [*FP8_SHAPE])
    assert kind_of("train.float8") == "applied"
    check_config_changes(config, config_to_dict(saved), "runs/x/checkpoints/step_2")
    assert "train.float8 changed from False to True: the new value takes effect" in log.text
