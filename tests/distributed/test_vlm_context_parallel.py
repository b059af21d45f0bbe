"""Context parallelism (distributed.cp) for vision-language models against one process: the
joint decoder's sequence (image tokens, then the text) and the cross-attention decoder's
text split over two gloo ranks, through the real build, loop, eval and end-of-run sample."""

from __future__ import annotations

import pytest
import torch

from kempnerforge.config.loader import load_config
from tests.support.dist import run_distributed
from tests.support.metrics_rows import eval_rows
from tests.support.tiny import tiny_run
from tests.support.tolerance import assert_layout_close, grad_norm_terms, vlm_terms
from tests.support.train_run import sample_on_ranks, train_on_ranks

pytestmark = pytest.mark.distributed

STEPS = 4
BATCH, EVAL_STEPS, EVAL_INTERVAL = 4, 2, 2
IMAGE_TOKENS = 16
"""The random encoder's tokens per image (the default 4 x 4 grid), kept by the mlp adapter."""
CP2 = ["--distributed.cp=2", "--distributed.dp_shard=1"]


def base(run_dir, *extra: str) -> list[str]:
    """Every group trains (the encoder too, so its gradient is checked as well), eval every
    two steps on the synthetic held-out pairs."""
    return tiny_run(
        run_dir,
        None,
        "--vision_encoder.type=random",
        "--vlm.synthetic_samples=64",
        "--vlm.freeze=[]",
        "--vlm.cross_attention_every_n_layers=1",
        f"--train.max_steps={STEPS}",
        "--train.sample_tokens=0",
        "--train.deterministic=true",
        "--scheduler.warmup_steps=1",
        "--optimizer.lr=2e-2",
        f"--eval.interval={EVAL_INTERVAL}",
        f"--eval.steps={EVAL_STEPS}",
        *extra,
    )


def _run(run_dir, world_size: int, *extra: str, **kwargs) -> list[dict]:
    return run_distributed(train_on_ranks, world_size, base(run_dir, *extra), kwargs)


def _bound(overrides: list[str], batches: int = 1) -> dict:
    """layout_atol's sizes: the model's chain, the encoder's and adapter's beside it, and
    the text tokens of ``batches`` global batches that a loss averages (at most)."""
    config = load_config(None, overrides)
    assert config.vlm is not None
    seq_len, extra = vlm_terms(config)
    tokens = batches * BATCH * config.vlm.max_text_len
    return {"cfg": config.model, "seq_len": seq_len, "tokens": tokens, "extra_terms": extra}


def _assert_matches(ranks: list[dict], reference: dict, overrides: list[str]) -> None:
    for record in ranks:
        assert record["losses"] == ranks[0]["losses"]
        assert record["grad_norms"] == ranks[0]["grad_norms"]
        assert len(record["losses"]) == STEPS
        # Each supervised text token is counted once, on the cp rank that holds it.
        assert record["tokens_seen"] == reference["tokens_seen"]
    # Within fp32 reordering of the chain, the tokens and the updates before each step.
    bound = _bound(overrides)
    assert_layout_close(ranks[0]["losses"], reference["losses"], **bound)
    norm_terms = grad_norm_terms(load_config(None, overrides))
    assert_layout_close(
        ranks[0]["grad_norms"], reference["grad_norms"], norm_terms=norm_terms, **bound
    )


@pytest.mark.parametrize(
    ("arch", "text_len", "text_held"),
    [
        # 16 image + 40 text positions, 28 a rank: rank 0 holds the image and 12 text ids.
        ("joint_decoder", 40, [(0, 12), (12, 40)]),
        # 16 + 16, 16 a rank: rank 0 holds the image alone, rank 1 the text alone.
        ("joint_decoder", 16, [(0, 0), (0, 16)]),
        # 16 + 8, 12 a rank: rank 0 holds 12 image tokens, rank 1 the last 4 and the text.
        ("joint_decoder", 8, [(0, 0), (0, 8)]),
        ("cross_attention", 40, [(0, 20), (20, 40)]),
    ],
    ids=[
        "joint-image-and-text-on-rank-0",
        "joint-image-only-on-rank-0",
        "joint-image-on-both-ranks",
        "cross-attention",
    ],
)
def test_two_context_parallel_ranks_train_and_evaluate_a_vlm_like_one_process(
    tmp_path, arch, text_len, text_held
) -> None:
    """Each cp rank encodes the whole images and keeps its positions of the decoder's
    sequence: the losses, gradient norms and eval losses are one process's, and the text
    ids each rank read are its part of the caption (none where it holds only image tokens)."""
    extra = (f"--vlm.arch={arch}", f"--vlm.max_text_len={text_len}")
    (one,) = _run(tmp_path / "one", 1, *extra, record_batches=True)
    ranks = _run(tmp_path / "cp", 2, *extra, *CP2, record_batches=True)
    _assert_matches(ranks, one, base(tmp_path / "one", *extra))
    for record, (first, stop) in zip(ranks, text_held, strict=True):
        for mine, whole in zip(record["batches"], one["batches"], strict=True):
            assert torch.equal(mine, whole[:, first:stop])
    evals = [[r["eval_loss"] for r in eval_rows(tmp_path / d)] for d in ("one", "cp")]
    assert len(evals[0]) == STEPS // 2
    bound = _bound(base(tmp_path / "one", *extra), EVAL_STEPS)
    assert_layout_close(*evals[::-1], first_update=EVAL_INTERVAL, every=EVAL_INTERVAL, **bound)


def test_a_joint_decoder_under_context_and_data_parallelism_on_four_ranks_trains_like_one_process(
    tmp_path,
) -> None:
    """cp 2 x dp_shard 2: each data-parallel pair of cp ranks reads half of the batch, and
    FSDP shards and averages the encoder, adapter and decoder over all four ranks."""
    extra = ("--vlm.max_text_len=40", "--eval.interval=0")
    (one,) = _run(tmp_path / "one", 1, *extra)
    layout = ["--distributed.cp=2", "--distributed.dp_shard=2", "--train.batch_size=2"]
    _assert_matches(_run(tmp_path / "cp-dp", 4, *extra, *layout), one, base(None, *extra))


def test_the_caption_sample_under_context_parallelism_is_one_process_sample(tmp_path) -> None:
    """The sample decodes whole windows on every cp rank (whole_sequences switches the
    vision-language model's split off, decoder and all)."""
    sample = ["--vlm.max_text_len=40", "--train.sample_tokens=8", "--eval.interval=0"]
    (one,) = run_distributed(sample_on_ranks, 1, base(tmp_path / "one", *sample))
    ranks = run_distributed(sample_on_ranks, 2, [*base(tmp_path / "cp", *sample), *CP2])
    assert one and ranks == [one, one]
