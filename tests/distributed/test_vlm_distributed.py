"""A vision-language model sharded with FSDP2 on two gloo ranks, against one process:
the same per-step loss and gradient norm through a freeze stage, with a pretrained tower,
and after a resume on two ranks across the stage."""

from __future__ import annotations

import pytest

from kempnerforge.config.loader import load_config
from tests.support.dist import run_distributed
from tests.support.tiny import tiny_run
from tests.support.tolerance import assert_layout_close, grad_norm_terms, vlm_terms
from tests.support.train_run import train_on_ranks
from tests.support.vision_towers import save_tiny_clip

pytestmark = pytest.mark.distributed

STEPS = 5
BATCH = 4
# The decoder trains from step 3 (its stage applies after step 2); the encoder never.
FREEZE = '[{module="encoder", frozen=true}, {module="decoder", frozen=true}]'
SCHEDULE = '[{start_step=2, specs=[{module="decoder", frozen=false}]}]'


def base(run_dir, *extra: str) -> list[str]:
    return tiny_run(
        run_dir,
        None,
        "--vision_encoder.type=random",
        "--vlm.max_text_len=40",
        "--vlm.synthetic_samples=64",
        f"--vlm.freeze={FREEZE}",
        f"--vlm.freeze_schedule={SCHEDULE}",
        f"--train.max_steps={STEPS}",
        "--train.sample_tokens=0",
        "--train.deterministic=true",
        "--scheduler.warmup_steps=1",
        "--optimizer.lr=3e-3",
        "--eval.interval=0",
        *extra,
    )


def one_process(overrides: list[str]) -> dict:
    return run_distributed(train_on_ranks, 1, [*overrides, "--train.batch_size=4"], {})[0]


def two_ranks(overrides: list[str], **kwargs) -> list[dict]:
    layout = ["--train.batch_size=2", "--distributed.dp_shard=2"]
    return run_distributed(train_on_ranks, 2, [*overrides, *layout], kwargs)


def assert_matches(
    ranks: list[dict], reference: dict, overrides: list[str], first: int = 0
) -> None:
    """Within fp32 reordering of the model's chain (the encoder's and adapter's beside it),
    the global batch's text tokens and the updates before each step (layout_atol)."""
    for record in ranks:
        assert record["losses"] == ranks[0]["losses"]
        assert record["grad_norms"] == ranks[0]["grad_norms"]
    config = load_config(None, overrides)
    assert config.vlm is not None
    seq_len, extra = vlm_terms(config)
    bound = {"cfg": config.model, "seq_len": seq_len, "extra_terms": extra, "first_update": first}
    bound["tokens"] = BATCH * config.vlm.max_text_len
    assert_layout_close(ranks[0]["losses"], reference["losses"][first:], **bound)
    norms = ranks[0]["grad_norms"], reference["grad_norms"][first:]
    assert_layout_close(*norms, norm_terms=grad_norm_terms(config), **bound)


@pytest.mark.parametrize("arch", ["joint_decoder", "cross_attention"])
def test_sharded_vlm_through_a_freeze_stage_matches_one_process(tmp_path, arch):
    extra = (f"--vlm.arch={arch}", "--vlm.cross_attention_every_n_layers=1")
    reference = one_process(base(tmp_path / "one", *extra))
    ranks = two_ranks(base(tmp_path / "two", *extra))
    assert len(reference["losses"]) == STEPS
    assert_matches(ranks, reference, base(None, *extra))
    # The decoder's unfreezing shows in the loss: it falls faster from step 3 on.
    assert reference["losses"][-1] < reference["losses"][1]


def test_sharded_vlm_with_a_pretrained_tower_matches_one_process(tmp_path):
    tower = save_tiny_clip(tmp_path / "clip")
    extra = ("--vision_encoder.type=clip", f"--vision_encoder.path={tower}")
    reference = one_process(base(tmp_path / "one", *extra))
    assert_matches(two_ranks(base(tmp_path / "two", *extra)), reference, base(None, *extra))


def test_sharded_vlm_resumed_after_its_freeze_stage_matches_one_process(tmp_path):
    reference = one_process(base(tmp_path / "one"))
    overrides = base(tmp_path / "two", "--checkpoint.interval=0")
    stopped = two_ranks(overrides, stop_after=3)
    # Ranks agree on a stop at a step boundary (one step later when distributed).
    at = stopped[0]["step"]
    assert 2 < at < STEPS, "the stop must fall after the freeze stage and before the end"
    assert_matches(
        stopped,
        {"losses": reference["losses"][:at], "grad_norms": reference["grad_norms"][:at]},
        overrides,
    )
    resumed = two_ranks(overrides)
    assert resumed[0]["start_step"] == at and resumed[0]["step"] == STEPS
    assert_matches(resumed, reference, overrides, first=at)


def dtypes_seen_under_bf16(rank: int, world_size: int, overrides: list[str]) -> dict:
    """Train two bf16 steps; the dtypes the encoder and the adapter computed with."""
    from kempnerforge.config.loader import load_config
    from kempnerforge.distributed.runtime import init_runtime
    from kempnerforge.training.build import build_session
    from kempnerforge.training.loop import run_training_loop

    config = load_config(None, overrides)
    config.validate(world_size)
    session = build_session(config, init_runtime(config.distributed, "cpu"))
    seen: dict[str, str] = {}
    model = session.model

    def note(name: str):
        def hook(module, args, output):
            seen[f"{name} input"] = str(args[0].dtype)
            seen[f"{name} output"] = str(output.dtype)

        return hook

    model.encoder.register_forward_hook(note("encoder"))  # type: ignore[union-attr]
    model.adapter.register_forward_hook(note("adapter"))  # type: ignore[union-attr]
    with session.tracker:
        step, _ = run_training_loop(session)
    return {"step": step, **seen}


def test_an_fp32_tower_gets_fp32_pixels_under_bf16_sharding(tmp_path):
    tower = save_tiny_clip(tmp_path / "clip")
    overrides = [
        *base(tmp_path / "run", "--vision_encoder.type=clip", f"--vision_encoder.path={tower}"),
        "--train.mixed_precision=bf16",
        "--train.max_steps=2",
        "--vlm.freeze_schedule=[]",
        "--train.batch_size=2",
        "--distributed.dp_shard=2",
    ]
    for record in run_distributed(dtypes_seen_under_bf16, 2, overrides):
        assert record["step"] == 2
        # The encoder is not rounded to bf16, neither its weights nor the pixels it reads;
        # the adapter computes in bf16 like the decoder.
        assert record["encoder input"] == record["encoder output"] == "torch.float32"
        assert record["adapter output"] == "torch.bfloat16"
