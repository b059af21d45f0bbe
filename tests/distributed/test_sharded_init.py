"""Sharded init on real gloo ranks: a rank draws only the tiles of its own shard and never
allocates a whole parameter, yet holds its slice of the single-process weights bitwise."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kempnerforge.distributed.parallelize import parallelize_model
from kempnerforge.distributed.runtime import init_runtime
from kempnerforge.model.transformer import Transformer, init_std
from kempnerforge.model.weight_init import TILE_ELEMENTS, fill_parameter, parameter_seed
from tests.support.dist import run_distributed
from tests.support.parallel import (
    SEED,
    job_config,
    max_diff,
    parallel_plan,
    reference_model,
    whole_params,
)

pytestmark = pytest.mark.distributed

VOCAB, DIM, EXPERTS, EXPERT_HIDDEN = 40_000, 128, 8, 4096
BIG = [f"--model.vocab_size={VOCAB}", f"--model.dim={DIM}", "--model.multiple_of=16"]
"""A 40,000 x 128 embedding and head: 5.1M elements each, five tiles of 8,192 rows."""
MOE = [
    f"--model.num_experts={EXPERTS}",
    f"--model.moe_expert_hidden_dim={EXPERT_HIDDEN}",
    "--model.moe_top_k=2",
]
"""Expert stacks of 8 x 128 x 4096 (4.2M elements, four tiles of two experts each)."""
LAYOUTS = {
    "fsdp": ["--distributed.dp_shard=2"],
    "ep_fsdp": ["--distributed.dp_shard=2", "--distributed.ep=2", *MOE],
}


class _Allocations(TorchDispatchMode):
    """Counts the elements normal_ fills and the largest tensor any op allocates (an
    output whose storage is none of its inputs': views and in-place results are not)."""

    def __init__(self) -> None:
        super().__init__()
        self.drawn = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.normal_.default:
            self.drawn += args[0].numel()
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
        return out


def _local_numel(param: torch.Tensor) -> int:
    return (param.to_local() if isinstance(param, DTensor) else param).numel()


def _init_on_rank(overrides: list[str]) -> dict[str, Any]:
    """Build as the trainer does (meta -> parallelize -> to_empty -> init_weights), counting
    what init allocates; then what each parameter's fill draws, and the weights' gap to the
    single-process model."""
    config = job_config(*BIG, *overrides)
    runtime = init_runtime(config.distributed, "cpu")
    with torch.device("meta"):
        model = Transformer(config.model)
    parallelize_model(model, runtime, parallel_plan(config))
    model.to_empty(device=runtime.device)
    with _Allocations() as init:
        model.init_weights(SEED)
    drawn = {}
    for name, param in model.named_parameters():
        with _Allocations() as one:
            fill_parameter(param, init_std(config.model, name), parameter_seed(SEED, name))
        drawn[name] = one.drawn
    return {
        "init": max_diff(whole_params(model), whole_params(reference_model(config))),
        "largest": init.largest,
        "drawn": drawn,
        "local": {name: _local_numel(p) for name, p in model.named_parameters()},
        "full": {name: p.numel() for name, p in model.named_parameters()},
        "rank": runtime.rank,
    }


def _all_layouts(rank: int, world_size: int) -> dict[str, Any]:
    return {name: _init_on_rank(overrides) for name, overrides in LAYOUTS.items()}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_distributed(_all_layouts, 2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_init_equals_the_single_process_weights_bitwise(two_ranks, layout):
    for result in two_ranks:
        assert result[layout]["init"] == 0.0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_rank_allocates_more_than_one_tile_while_initialising(two_ranks, layout):
    for result in two_ranks:
        biggest = max(result[layout]["full"].values())
        assert biggest > 4 * TILE_ELEMENTS  # the whole parameter would be several tiles
        assert result[layout]["largest"] <= TILE_ELEMENTS


def test_an_fsdp_rank_draws_only_the_tiles_its_rows_overlap(two_ranks):
    # FSDP splits the 40,000 vocabulary rows 20,000 / 20,000; tiles hold 8,192 rows, so
    # rank 0 draws tiles 0-2 and rank 1 tiles 2-4 (the last one 7,232 rows).
    tile = TILE_ELEMENTS // DIM
    want = {0: 3 * tile * DIM, 1: (2 * tile + VOCAB - 4 * tile) * DIM}
    for result in two_ranks:
        fsdp = result["fsdp"]
        rank = fsdp["rank"]
        for name in ("tok_embeddings.weight", "output.weight"):
            assert fsdp["local"][name] == VOCAB * DIM // 2
            assert fsdp["drawn"][name] == want[rank] < VOCAB * DIM


def test_an_expert_parallel_rank_draws_exactly_its_own_experts(two_ranks):
    for result in two_ranks:
        layout = result["ep_fsdp"]
        experts = [n for n in layout["drawn"] if ".experts.w" in n]
        assert len(experts) == 3 * 2  # w1, w2, w3 of both layers
        for name in experts:
            # Tiles of two experts each, four experts per rank: no tile is shared.
            assert layout["full"][name] == EXPERTS * DIM * EXPERT_HIDDEN
            assert layout["drawn"][name] == layout["local"][name] == layout["full"][name] // 2
