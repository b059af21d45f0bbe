"""distributed.pp_schedule: stages per rank, V placement and what each schedule asks of
[train], refused before any process group exists."""

from __future__ import annotations

import pytest

from kempnerforge.config.distributed import DistributedConfig
from kempnerforge.config.loader import load_config
from kempnerforge.core.errors import ConfigError
from kempnerforge.distributed.pipeline_parallel import stages_of_rank
from kempnerforge.distributed.schedules import MULTI_STAGE, SINGLE_STAGE

PIPELINE = ["--distributed.pp=2", "--data.document_masking=false"]


def test_every_configurable_schedule_has_a_torch_schedule():
    from kempnerforge.config.distributed import PP_SCHEDULES

    assert sorted(PP_SCHEDULES) == sorted([*SINGLE_STAGE, *MULTI_STAGE])


@pytest.mark.parametrize(
    ("schedule", "per_rank", "v_shaped"),
    [
        ("1f1b", 1, False),
        ("interleaved_1f1b", 2, False),
        ("interleaved_zb", 2, False),
        ("zbv", 2, True),
        ("dualpipev", 2, True),
    ],
)
def test_schedules_default_to_their_stages_per_rank(schedule, per_rank, v_shaped):
    config = DistributedConfig(pp=2, pp_schedule=schedule)
    assert (config.stages_per_rank, config.v_shaped) == (per_rank, v_shaped)
    assert config.num_stages == 2 * per_rank


@pytest.mark.parametrize(
    ("schedule", "per_rank", "message"),
    [
        ("interleaved_zb", 1, "distributed.pp_stages_per_rank = 1: expected 0 or at least 2"),
        ("zbv", 3, "distributed.pp_stages_per_rank = 3: expected 0 or 2 with pp_schedule = 'zbv'"),
        ("dualpipev", 1, "distributed.pp_stages_per_rank = 1: expected 0 or 2"),
        ("gpipe", 2, "distributed.pp_stages_per_rank = 2: expected 0 or 1"),
    ],
)
def test_stages_per_rank_the_schedule_cannot_run_are_refused(schedule, per_rank, message):
    with pytest.raises(ConfigError) as info:
        DistributedConfig(pp=2, pp_schedule=schedule, pp_stages_per_rank=per_rank)
    assert str(info.value).startswith(message)


def test_interleaved_zero_bubble_takes_more_stages_per_rank():
    config = DistributedConfig(pp=2, pp_schedule="interleaved_zb", pp_stages_per_rank=3)
    assert config.num_stages == 6 and not config.v_shaped


def test_v_placement_puts_the_first_and_last_stage_on_rank_zero():
    assert [stages_of_rank(r, 2, 2, v_shaped=True) for r in range(2)] == [[0, 3], [1, 2]]
    assert [stages_of_rank(r, 4, 2, v_shaped=True) for r in range(4)] == [
        [0, 7],
        [1, 6],
        [2, 5],
        [3, 4],
    ]
    with pytest.raises(ValueError, match="2 stages per rank"):
        stages_of_rank(0, 2, 3, v_shaped=True)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["--distributed.pp_schedule=dualpipev", "--train.grad_accum_steps=2"],
            "train.grad_accum_steps = 2: expected at least the 4 pipeline stages",
        ),
        (
            ["--distributed.pp_schedule=zbv", "--train.grad_accum_steps=2", "--train.compile=true"],
            "train.compile = True: expected false with distributed.pp_schedule = 'zbv'",
        ),
        (
            [
                "--distributed.pp_schedule=interleaved_zb",
                "--train.grad_accum_steps=2",
                "--train.compile=true",
            ],
            "train.compile = True: expected false with distributed.pp_schedule = 'interleaved_zb'",
        ),
    ],
)
def test_train_fields_a_schedule_cannot_run_are_refused(overrides, message):
    config = load_config(None, [*PIPELINE, *overrides])
    with pytest.raises(ConfigError) as info:
        config.validate(2)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("schedule", ["interleaved_zb", "zbv", "dualpipev"])
@pytest.mark.parametrize("sharding", [[], ["--distributed.cp=2"]])
def test_zero_bubble_schedules_are_refused_where_fsdp_wraps_the_stages(schedule, sharding):
    """FSDP shards the stages over the data-parallel ranks, or over the context-parallel
    ones (which train as one process otherwise: cp=2 with zbv once lost the last stage's
    gradients without a word)."""
    overrides = [f"--distributed.pp_schedule={schedule}", "--train.grad_accum_steps=4"]
    config = load_config(None, [*PIPELINE, *overrides, *sharding])
    with pytest.raises(ConfigError) as info:
        config.validate(4)  # dp_shard = -1 takes the 2 ranks pp leaves, or cp takes them
    assert str(info.value).startswith(
        f"distributed.pp_schedule = {schedule!r}: expected 'gpipe', '1f1b' or "
        "'interleaved_1f1b' with data or context parallelism "
        "(dp_replicate * dp_shard * cp = 2)"
    )
    load_config(None, [*PIPELINE, *overrides, "--distributed.tp=2"]).validate(4)


def test_schedules_accept_what_they_can_run():
    for schedule, accum in (("dualpipev", 4), ("zbv", 2), ("interleaved_zb", 2)):
        overrides = [f"--distributed.pp_schedule={schedule}", f"--train.grad_accum_steps={accum}"]
        load_config(None, [*PIPELINE, *overrides]).validate(2)
    compiled = ["--train.grad_accum_steps=2", "--train.compile=true"]
    load_config(None, [*PIPELINE, *compiled]).validate(2)
