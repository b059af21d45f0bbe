"""distributed.cp against the rest of the config: refused before any process group exists,
with the field, the value and what would work."""

from __future__ import annotations

import pytest

from kempnerforge.config.context_parallel import cp_degrees
from kempnerforge.config.loader import load_config
from kempnerforge.core.errors import ConfigError

# The default model has 4 query heads and 4 key/value heads; train.seq_len is 256 there.
GQA = ["--model.n_heads=4", "--model.n_kv_heads=2"]
ULYSSES = ["--distributed.cp=2", "--distributed.cp_attention=ulysses"]
# A vision-language job of 9 image tokens (a 3 x 3 grid) and 7 text tokens: 16 positions in
# the joint decoder, 7 in the cross-attention decoder.
VLM = [
    "--vision_encoder.type=random",
    "--vision_encoder.num_tokens=9",
    "--vision_encoder.image_size=36",
    "--vlm.max_text_len=7",
]


@pytest.mark.parametrize(
    ("overrides", "world_size", "message"),
    [
        (
            ["--distributed.cp=3", "--train.seq_len=256"],
            3,
            "distributed.cp = 3: expected a divisor of train.seq_len = 256",
        ),
        (
            [*ULYSSES, "--model.dim=96", "--model.n_heads=6", "--model.n_kv_heads=3"],
            2,
            "distributed.cp = 2: expected a divisor or a multiple of model.n_kv_heads = 3 "
            "(each Ulysses rank takes whole key/value heads, or one head",
        ),
        (
            [
                *GQA,
                "--distributed.cp=4",
                "--distributed.tp=2",
                "--distributed.cp_attention=ulysses",
            ],
            8,
            "distributed.cp = 4: expected a divisor of model.n_heads / distributed.tp = "
            "4 / 2 = 2 (attention gives each Ulysses rank whole query heads of the full "
            "sequence, so there can be at most as many as query heads; or "
            "distributed.cp_attention = 'ring' (or 'auto')",
        ),
        (
            [*GQA, "--distributed.cp=4", "--distributed.cp_ulysses=4", "--distributed.tp=2"],
            8,
            "distributed.cp = 4: expected a divisor of model.n_heads / distributed.tp",
        ),
        (
            [
                *GQA,
                "--distributed.cp=8",
                "--distributed.cp_attention=ring",
                "--distributed.cp_ulysses=4",
                "--distributed.tp=2",
            ],
            16,
            "distributed.cp_ulysses = 4: expected a divisor of model.n_heads / distributed.tp "
            "= 4 / 2 = 2",
        ),
        (
            ["--distributed.cp=4", "--distributed.cp_attention=ring", "--train.seq_len=36"],
            4,
            "distributed.cp = 4: expected a layout whose ring of 4 ranks (cp / cp_ulysses) "
            "cuts train.seq_len = 36 into 8 equal chunks",
        ),
        (
            [
                "--distributed.cp=2",
                "--distributed.dp_shard=1",
                "--distributed.ep=4",
                "--model.num_experts=4",
                "--model.moe_top_k=2",
            ],
            2,
            "distributed.ep = 4: expected a divisor of distributed.dp_shard * distributed.cp "
            "= 1 * 2 (expert-parallel ranks are data-parallel shard (and context-parallel)",
        ),
        (
            ["--distributed.cp=2", *VLM, "--vlm.max_text_len=10"],
            2,
            "distributed.cp = 2: expected a divisor of the joint decoder's sequence, image "
            "tokens + vlm.max_text_len = 9 + 10 = 19 (each context-parallel rank holds",
        ),
        (
            [
                "--distributed.cp=2",
                *VLM,
                "--vlm.max_text_len=8",
                "--adapter.type=pool",
                "--adapter.pool_window=3",
            ],
            2,
            "distributed.cp = 2: expected a divisor of the joint decoder's sequence, image "
            "tokens + vlm.max_text_len = 1 + 8 = 9",
        ),
        (
            ["--distributed.cp=2", *VLM, "--vlm.arch=cross_attention"],
            2,
            "distributed.cp = 2: expected a divisor of vlm.max_text_len = 7 (the "
            "cross-attention decoder's sequence)",
        ),
        (
            ["--distributed.cp=2", "--distributed.dp_shard=2"],
            2,
            "distributed.dp_shard = 2: expected dp_replicate * dp_shard * cp * tp * pp == "
            "world size 2",
        ),
    ],
)
def test_a_context_parallel_degree_the_job_cannot_run_is_a_config_error(
    overrides, world_size, message
):
    config = load_config(None, overrides)
    with pytest.raises(ConfigError) as info:
        config.validate(world_size)
    assert str(info.value).startswith(message)


def test_context_parallelism_leaves_the_data_parallel_degree_and_the_global_batch():
    config = load_config(None, [*GQA, "--distributed.cp=2", "--train.global_batch_size=16"])
    config.validate(4)  # dp_shard = -1 takes 2 of 4 ranks: cp peers read the same batches
    assert config.distributed.mesh_shape(4) == {
        "pp": 1,
        "dp_replicate": 1,
        "dp_shard": 2,
        "cp": 2,
        "tp": 1,
    }
    assert config.distributed.resolved_dp(4) == 2


def test_context_parallelism_runs_with_compiled_blocks_and_a_sequence_level_balancing_loss():
    load_config(None, [*GQA, "--distributed.cp=2", "--train.compile=true"]).validate(2)
    moe = ["--model.num_experts=4", "--model.moe_top_k=2", "--model.moe_aux_loss_level=sequence"]
    load_config(None, [*GQA, "--distributed.cp=2", *moe]).validate(2)


def test_a_negative_cp_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^distributed.cp = 0: expected"):
        load_config(None, ["--distributed.cp=0"])


@pytest.mark.parametrize(
    ("overrides", "world_size"),
    [
        ([*GQA, "--distributed.cp=4"], 4),  # 2 key/value heads, each shared by 2 ranks
        ([*GQA, "--distributed.cp=2", "--distributed.tp=2"], 4),  # 1 per tp rank, shared
        (["--model.n_heads=4", "--model.n_kv_heads=1", "--distributed.cp=4"], 4),
    ],
)
def test_fewer_key_value_heads_than_context_parallel_ranks_are_shared(overrides, world_size):
    load_config(None, overrides).validate(world_size)


def test_context_parallelism_splits_a_joint_decoder_sequence_the_text_alone_would_not():
    """cp 2 divides the joint decoder's 9 + 7 = 16 positions, not the 7 text tokens: the
    rule is on the sequence the decoder runs."""
    config = load_config(None, ["--distributed.cp=2", *VLM])
    config.validate(2)
    assert config.distributed.mesh_shape(2)["cp"] == 2


@pytest.mark.parametrize(
    ("overrides", "degrees"),
    [
        ([*GQA, "--distributed.cp=4"], (4, 1)),  # the heads allow Ulysses: no ring
        ([*GQA, "--distributed.cp=4", "--distributed.tp=2"], (2, 2)),  # 2 query heads a tp rank
        (["--model.n_heads=4", "--distributed.cp=3", "--train.seq_len=48"], (1, 3)),
        (["--model.n_heads=4", "--distributed.cp=8", "--train.seq_len=64"], (4, 2)),
        ([*GQA, "--distributed.cp=4", "--distributed.cp_attention=ring"], (1, 4)),
        ([*GQA, "--distributed.cp=4", "--distributed.cp_ulysses=2"], (2, 2)),
        ([*GQA, "--distributed.cp=4", "--distributed.cp_attention=ulysses"], (4, 1)),
    ],
)
def test_auto_exchanges_heads_where_they_allow_and_passes_the_rest_around_a_ring(
    overrides, degrees
):
    """(Ulysses ranks, ring ranks): 'auto' keeps the head exchange where the heads allow
    cp and takes the largest Ulysses group they allow inside a ring otherwise; 'ring' is a
    pure ring unless cp_ulysses says otherwise."""
    config = load_config(None, overrides)
    config.validate(config.distributed.cp * config.distributed.tp)
    assert cp_degrees(config) == degrees


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["--distributed.cp=4", "--distributed.cp_ulysses=3"],
            "distributed.cp_ulysses = 3: expected 0 or a divisor of distributed.cp = 4",
        ),
        (
            [
                "--distributed.cp=4",
                "--distributed.cp_attention=ulysses",
                "--distributed.cp_ulysses=2",
            ],
            "distributed.cp_ulysses = 2: expected 0 or 4 (distributed.cp) with cp_attention = "
            "'ulysses' (set cp_attention = 'ring' for Ulysses ranks inside a ring)",
        ),
        (
            ["--distributed.cp=4", "--distributed.cp_attention=ring", "--distributed.cp_ulysses=4"],
            "distributed.cp_ulysses = 4: expected a divisor of distributed.cp = 4 below it",
        ),
        (
            ["--distributed.cp_attention=rings"],
            "distributed.cp_attention = 'rings': expected one of 'auto', 'ulysses', 'ring' "
            "(did you mean 'ring'?)",
        ),
    ],
)
def test_a_context_parallel_attention_choice_that_does_not_fit_cp_is_a_config_error(
    overrides, message
):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert str(info.value).startswith(message)
