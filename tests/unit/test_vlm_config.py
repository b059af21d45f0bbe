"""[vision_encoder], [adapter] and [vlm]: validation, the encoder's shape, and CLI exit codes."""

from __future__ import annotations

import json

import pytest

from kempnerforge.cli import main
from kempnerforge.config.loader import load_config
from kempnerforge.core.errors import ConfigError

VLM = ["--vision_encoder.type=random", "--vlm.max_text_len=8"]


def error_of(overrides: list[str], world_size: int = 1) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides).validate(world_size)
    return info.value


def write_tower(tmp_path, model_type="clip_vision_model", **fields) -> str:
    config = {"model_type": model_type, "image_size": 32, "patch_size": 8, "hidden_size": 24}
    config.update(fields)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_a_vlm_job_gets_a_default_adapter_and_is_vlm():
    config = load_config(None, VLM)
    config.validate(1)
    assert config.is_vlm and config.adapter is not None and config.adapter.type == "mlp"
    spec = config.vision_spec()
    assert (spec.image_size, spec.num_tokens, spec.feature_dim, spec.grid) == (32, 16, 64, 4)
    assert config.decoder_positions(spec) == 16 + 8
    assert not load_config(None, []).is_vlm


def test_sections_that_need_each_other():
    assert error_of(["--vlm.max_text_len=8"]).field == "vlm"
    assert error_of(["--vision_encoder.type=random"]).field == "vision_encoder"
    assert error_of(["--adapter.type=pool"]).field == "adapter"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["--distributed.pp=2", "--train.grad_accum_steps=2"], "distributed.pp"),
        (["--distributed.tp=2"], "distributed.tp"),
    ],
)
def test_pipeline_and_tensor_parallel_vlms_are_refused(overrides, field):
    error = error_of(VLM + overrides, world_size=2)
    assert error.field == field
    assert "vision-language" in str(error) and "dp_shard" in str(error)


def test_text_that_does_not_fit_the_decoder_names_max_text_len():
    error = error_of(VLM[:1] + ["--vlm.max_text_len=250", "--model.max_seq_len=256"])
    assert error.field == "vlm.max_text_len"
    assert "256 - 16" in str(error)
    # Cross-attention keeps images out of the sequence, so the same text fits.
    load_config(
        None,
        VLM[:1]
        + ["--vlm.max_text_len=250", "--model.max_seq_len=256", "--vlm.arch=cross_attention"]
        + ["--vlm.cross_attention_every_n_layers=1"],
    ).validate(1)
    # A pooling adapter shrinks the image's share: 16 tokens -> 4.
    load_config(
        None, VLM[:1] + ["--vlm.max_text_len=252", "--model.max_seq_len=256", "--adapter.type=pool"]
    ).validate(1)


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        (['--vlm.freeze=[{module="encodr"}]'], "vlm.freeze[0].module", "did you mean 'encoder'"),
        (
            ['--vlm.freeze=[{module="cross_attention"}]'],
            "vlm.freeze[0].module",
            "only vlm.arch = 'cross_attention'",
        ),
        (
            [
                "--vlm.freeze_schedule=[{start_step=5, specs=[{module='adapter'}]}, "
                "{start_step=5, specs=[{module='decoder'}]}]"
            ],
            "vlm.freeze_schedule[1].start_step",
            "after the previous stage's (5)",
        ),
        (["--vlm.freeze_schedule=[{start_step=0, specs=[{module='adapter'}]}]"], "", ">= 1"),
        (["--vlm.freeze_schedule=[{start_step=2}]"], "vlm.freeze_schedule[0].specs", "at least"),
        (["--vision_encoder.num_tokens=12"], "vision_encoder.num_tokens", "square number"),
        (["--adapter.type=pool", "--adapter.pool_window=3"], "adapter.pool_window", "grid"),
        (["--vlm.bad_images=ignore"], "vlm.bad_images", "'skip', 'fail'"),
        (["--vision_encoder.path=/x"], "vision_encoder.path", "empty for"),
    ],
)
def test_bad_vlm_settings_name_their_field(overrides, field, words):
    error = error_of(VLM + overrides)
    if field:
        assert error.field == field
    assert words in str(error)


def test_a_hugging_face_tower_shape_comes_from_its_config(tmp_path):
    path = write_tower(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({"image_mean": [0.1, 0.2, 0.3], "image_std": [0.5, 0.5, 0.5]})
    )
    clip = ["--vision_encoder.type=clip", "--vlm.max_text_len=8"]
    config = load_config(None, [f"--vision_encoder.path={path}", *clip])
    spec = config.vision_spec()
    assert (spec.image_size, spec.num_tokens, spec.feature_dim, spec.patch_size) == (32, 16, 24, 8)
    assert spec.mean == (0.1, 0.2, 0.3)
    # A whole CLIP model's config nests the tower's.
    whole = tmp_path / "whole"
    whole.mkdir()
    (whole / "config.json").write_text(
        json.dumps(
            {
                "model_type": "clip",
                "vision_config": json.loads((tmp_path / "config.json").read_text()),
            }
        )
    )
    spec = load_config(None, [f"--vision_encoder.path={whole}", *clip]).vision_spec()
    assert spec.feature_dim == 24


@pytest.mark.parametrize(
    ("extra", "field", "words"),
    [
        (["--vision_encoder.image_size=64"], "vision_encoder.image_size", "32 (or 0)"),
        (["--vision_encoder.feature_dim=25"], "vision_encoder.feature_dim", "24 (or 0)"),
        (["--vision_encoder.type=siglip"], "vision_encoder.type", "'clip_vision_model'"),
    ],
)
def test_a_tower_that_cannot_take_the_setting_is_refused_at_startup(tmp_path, extra, field, words):
    path = write_tower(tmp_path)
    error = error_of(
        [
            f"--vision_encoder.path={path}",
            "--vision_encoder.type=clip",
            "--vlm.max_text_len=8",
            *extra,
        ]
    )
    assert error.field == field and words in str(error)


def test_a_missing_or_broken_tower_directory_is_named(tmp_path):
    base = ["--vision_encoder.type=clip", "--vlm.max_text_len=8"]
    error = error_of([*base, f"--vision_encoder.path={tmp_path / 'nope'}"])
    assert error.field == "vision_encoder.path" and "existing local directory" in str(error)
    error = error_of([*base, f"--vision_encoder.path={tmp_path}"])
    assert "config.json" in str(error)
    (tmp_path / "config.json").write_text("{not json")
    error = error_of([*base, f"--vision_encoder.path={tmp_path}"])
    assert error.field == "vision_encoder.path" and "readable" in str(error)


def test_a_bad_vlm_config_exits_2_with_one_line(tmp_path, capsys):
    config = tmp_path / "job.toml"
    config.write_text(
        '[vlm]\nmax_text_len = 8\n[vision_encoder]\ntype = "clip"\npath = "/nowhere"\n'
    )
    code = main(["train", str(config), f"--train.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "vision_encoder.path" in err[0] and "Traceback" not in err[0]
