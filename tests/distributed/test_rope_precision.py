"""The RoPE tables reach attention in fp32, bitwise the single-process tables, in every
sharded layout with bf16 parameters: FSDP, HSDP, TP x FSDP, pipeline stages under FSDP, and
the decoder blocks of both vision-language architectures."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kempnerforge.distributed.runtime import init_runtime
from kempnerforge.model.attention.rope import rope_tables
from kempnerforge.model.attention.self_attention import Attention
from kempnerforge.training.build import build_model_on_mesh
from kempnerforge.training.loss import cross_entropy_sum
from tests.support.dist import run_distributed
from tests.support.parallel import job_config

pytestmark = pytest.mark.distributed

SEQ = 16
BF16 = ["--train.mixed_precision=bf16", "--data.document_masking=false"]
VLM = ["--vision_encoder.type=random", "--vlm.max_text_len=12", "--model.max_seq_len=64"]
TWO_RANKS = {
    "fsdp": ["--distributed.dp_shard=2"],
    "hsdp": ["--distributed.dp_replicate=2", "--distributed.dp_shard=1"],
    "vlm_joint_decoder": [*VLM, "--vlm.arch=joint_decoder", "--distributed.dp_shard=2"],
    "vlm_cross_attention": [
        *VLM,
        "--vlm.arch=cross_attention",
        "--vlm.cross_attention_every_n_layers=1",
        "--distributed.dp_shard=2",
    ],
}
FOUR_RANKS = {
    "tp_fsdp": ["--distributed.tp=2", "--distributed.dp_shard=2"],
    "pp_fsdp": [
        "--distributed.pp=2",
        "--distributed.dp_shard=2",
        "--train.grad_accum_steps=2",
        "--train.batch_size=1",
        f"--train.seq_len={SEQ}",
    ],
}


def _tables_in_attention(overrides: list[str]) -> dict[str, Any]:
    """Build as training does with bf16 parameters, run one forward (a pipeline step for
    pp), and record the dtype of every table attention received and whether it equals the
    fp32 tables bitwise."""
    config = job_config(*BF16, *overrides)
    runtime = init_runtime(config.distributed, "cpu")
    model, pipeline = build_model_on_mesh(config, runtime, cross_entropy_sum)
    mc = config.model
    want = rope_tables(mc.head_dim, mc.max_seq_len, mc.rope_theta)
    seen: list[tuple[str, bool]] = []
    streams: set[str] = set()

    def record(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        streams.add(str(args[0].dtype))
        for table, full in zip(args[1:3], want, strict=True):
            exact = table.dtype == torch.float32 and torch.equal(table[0], full[: table.shape[1]])
            seen.append((str(table.dtype), exact))

    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    # Before the forward: FSDP leaves the last block's gathered bf16 weights in place after.
    param_dtypes = {str(p.dtype) for m in attentions for p in m.parameters()}
    for attention in attentions:
        attention.register_forward_pre_hook(record)
    ids = torch.randint(0, mc.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if pipeline is not None:
            pipeline.run(ids, ids, 1.0)
        elif config.is_vlm:
            size = config.vision_spec().image_size
            model(torch.rand(2, 3, size, size), ids[:, : config.vlm.max_text_len])  # type: ignore[union-attr]
        else:
            model(ids)
    return {
        "seen": seen,
        "streams": sorted(streams),
        "attentions": len(attentions),
        "params": sorted(param_dtypes),
    }


def _two(rank: int, world_size: int) -> dict[str, Any]:
    return {name: _tables_in_attention(overrides) for name, overrides in TWO_RANKS.items()}


def _four(rank: int, world_size: int) -> dict[str, Any]:
    return {name: _tables_in_attention(overrides) for name, overrides in FOUR_RANKS.items()}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_distributed(_two, 2)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_distributed(_four, 4)


def _check(results: list[dict[str, Any]]) -> None:
    for result in results:
        assert result["params"] == ["torch.float32"]  # the sharded weights stay fp32
        assert result["streams"] == ["torch.bfloat16"]  # attention computes in bf16
        # Every attention of the rank ran (a pipeline rank holds one layer), and each
        # received both tables in fp32, equal to the single-process tables.
        assert len(result["seen"]) >= 2 * result["attentions"] > 0
        assert set(result["seen"]) == {("torch.float32", True)}


@pytest.mark.parametrize("layout", TWO_RANKS)
def test_rope_tables_stay_fp32_on_two_ranks_with_bf16_parameters(two_ranks, layout):
    _check([r[layout] for r in two_ranks])


@pytest.mark.parametrize("layout", FOUR_RANKS)
def test_rope_tables_stay_fp32_on_four_ranks_with_bf16_parameters(four_ranks, layout):
    _check([r[layout] for r in four_ranks])
