"""The data order at scale (O(1) per index) and across versions (older orders refused)."""

from __future__ import annotations

import time
import tracemalloc

import pytest
import torch

from kempnerforge.cli import main
from kempnerforge.core.errors import DataError
from kempnerforge.data.dataloader import sampler_state_of
from kempnerforge.data.sampling.mixture import MixtureSampler
from kempnerforge.data.sampling.sampler import ORDER_VERSION, ShardedSampler
from tests.support.checksums import rerecord_checksums

RANKS = 1024


def test_a_trillion_windows_on_1024_ranks_need_no_epoch_in_memory():
    """Draws at 1e12 windows: a tensor of the epoch (8 TB) could not even be allocated, and
    tracemalloc sees that the Python side holds no more than a few kilobytes."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        sharded = ShardedSampler(10**12, RANKS - 1, RANKS, seed=3)
        it = iter(sharded)
        first = [next(it) for _ in range(16)]
        later = sharded.rank_indices(7, 0, 16)  # a later epoch, computed directly
        mixture = MixtureSampler([4 * 10**11, 6 * 10**11], [3, 1], 1.0, RANKS - 1, RANKS, seed=3)
        it = iter(mixture)
        head = [next(it) for _ in range(16)]
        mixture.update_weights([1, 3])  # a phase change: the rest of the epoch is re-planned
        tail = [next(it) for _ in range(16)]
        next_epoch = mixture.rank_indices(5, 0, 16)
        elapsed_s = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000
    assert elapsed_s < 1.0
    assert len(set(first)) == len(set(later)) == 16 and first != later
    assert all(0 <= i < 10**12 for i in first + later + head + tail + next_epoch)
    assert mixture.state_dict()["changes"] == [[16 * RANKS, [1.0, 3.0]]]
    # Rank 1023 reads global positions 1023, 2047, ...: any rank computes any position.
    assert first[3] == ShardedSampler(10**12, 0, 1, seed=3).global_index(0, 3 * RANKS + 1023)
    assert head[3] == mixture.global_index(0, 3 * RANKS + 1023)


def _old_state(sampler: ShardedSampler | MixtureSampler) -> dict:
    """A state as the torch.randperm order saved it: the same keys, no order_version."""
    state = sampler.state_dict()
    assert state.pop("order_version") == ORDER_VERSION
    return state


@pytest.mark.parametrize("kind", ["ShardedSampler", "MixtureSampler"])
def test_a_state_of_the_older_order_is_refused_with_one_line(kind):
    def build() -> ShardedSampler | MixtureSampler:
        if kind == "ShardedSampler":
            return ShardedSampler(20, 0, 1, seed=1)
        return MixtureSampler([10, 10], [1, 1], 1.0, 0, 1, seed=1)

    sampler = build()
    it = iter(sampler)
    [next(it) for _ in range(3)]
    with pytest.raises(DataError) as info:
        build().load_state_dict(_old_state(sampler))
    assert str(info.value) == (
        f"dataloader state ({kind}, epoch 0, 3 samples per rank drawn): its data order was "
        f"made by an older version (order version 1; this version computes order version "
        f"{ORDER_VERSION}), so this run cannot continue its data exactly: start a new run "
        "(another train.name) from this checkpoint's weights with "
        "--checkpoint.resume_from=<this checkpoint> --checkpoint.load_weights_only=true"
    )
    newer = {**sampler.state_dict(), "order_version": ORDER_VERSION + 1}
    with pytest.raises(DataError, match="made by a newer version"):
        build().load_state_dict(newer)
    resumed = build()
    resumed.load_state_dict(sampler.state_dict())  # this version's own state loads
    assert next(iter(resumed)) == next(it)


def test_the_cli_refuses_a_checkpoint_of_the_older_order_with_one_line(
    tiny_overrides, tmp_path, capsys
):
    config = tmp_path / "job.toml"
    config.write_text("")
    run = [*tiny_overrides, "--checkpoint.interval=2"]
    assert main(["train", str(config), *run, "--train.max_steps=2"]) == 0
    checkpoint = tmp_path / "run" / "checkpoints" / "step_2"
    state_file = checkpoint / "train_state_rank0.pt"
    state = torch.load(state_file, weights_only=False)
    sampler_state = sampler_state_of(state["dataloader"])
    assert sampler_state is not None and sampler_state.pop("order_version") == ORDER_VERSION
    torch.save(state, state_file)
    rerecord_checksums(checkpoint)
    capsys.readouterr()

    code = main(["train", str(config), *run, "--train.max_steps=4"])
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"kempnerforge: error: {checkpoint}: dataloader state (ShardedSampler, epoch 0, 8 "
        "samples per rank drawn): its data order was made by an older version (order "
        f"version 1; this version computes order version {ORDER_VERSION}), so this run "
        "cannot continue its data exactly: start a new run (another train.name) from this "
        "checkpoint's weights with --checkpoint.resume_from=<this checkpoint> "
        "--checkpoint.load_weights_only=true"
    )
