"""ShardedSampler: rank shards, epochs, and exact resume through a StatefulDataLoader."""

from __future__ import annotations

import pytest

from kempnerforge.data.dataloader import build_train_loader, load_loader_state
from kempnerforge.data.sampling.permutation import KeyedPermutation, derive_key
from kempnerforge.data.sampling.sampler import ShardedSampler
from tests.support.data_files import IndexDataset


def _drain(sampler: ShardedSampler) -> list[int]:
    return list(iter(sampler))


@pytest.mark.parametrize("dp_size", [1, 2, 3])
@pytest.mark.parametrize("num_samples", [12, 13, 2])
def test_rank_shards_are_disjoint_equal_and_complete(dp_size, num_samples):
    shards = [_drain(ShardedSampler(num_samples, r, dp_size, seed=7)) for r in range(dp_size)]
    per_rank = num_samples // dp_size
    assert all(len(s) == per_rank for s in shards)
    union = [i for s in shards for i in s]
    assert len(set(union)) == len(union) == per_rank * dp_size
    # Together they are the keyed permutation of (seed, epoch) with its tail dropped.
    perm = KeyedPermutation(num_samples, derive_key("sampler", 7, 0))
    head = [perm(p) for p in range(per_rank * dp_size)]
    assert sorted(union) == sorted(head)
    for r, shard in enumerate(shards):
        assert shard == head[r::dp_size]


def test_order_is_seeded_per_epoch_and_reproducible():
    a, b = ShardedSampler(50, 0, 1, seed=1), ShardedSampler(50, 0, 1, seed=1)
    epoch0, epoch1 = _drain(a), _drain(a)
    assert (epoch0, epoch1) == (_drain(b), _drain(b))
    assert epoch0 != epoch1 and sorted(epoch0) == sorted(epoch1) == list(range(50))
    assert _drain(ShardedSampler(50, 0, 1, seed=2)) != epoch0
    assert derive_key("sampler", 0, 1) != derive_key("sampler", 1, 0)


def test_without_shuffle_the_order_is_sequential():
    assert _drain(ShardedSampler(7, 1, 2, seed=0, shuffle=False)) == [1, 3, 5]


def test_epoch_advances_when_an_epoch_runs_out():
    sampler = ShardedSampler(4, 0, 1, seed=0)
    assert sampler.epoch == 0
    it = iter(sampler)
    [next(it) for _ in range(4)]
    assert sampler.epoch == 0  # all drawn, but the epoch has not ended yet
    with pytest.raises(StopIteration):
        next(it)
    assert sampler.epoch == 1 and sampler.state_dict()["yielded"] == 0


def test_state_dict_resumes_a_bare_sampler_mid_epoch():
    sampler = ShardedSampler(20, 1, 2, seed=3)
    _drain(sampler)
    it = iter(sampler)
    head = [next(it) for _ in range(4)]
    state = sampler.state_dict()
    assert (state["epoch"], state["yielded"]) == (1, 4)
    resumed = ShardedSampler(20, 1, 2, seed=3)
    resumed.load_state_dict(state)
    assert head + _drain(resumed) == ShardedSampler(20, 1, 2, seed=3).rank_indices(1, 0, 10)
    assert resumed.epoch == 2


def test_resume_at_another_dp_size_continues_the_global_order():
    old = [ShardedSampler(24, r, 2, seed=5) for r in range(2)]
    iters = [iter(s) for s in old]
    consumed = [next(it) for _ in range(3) for it in iters]  # 3 per rank
    new = [ShardedSampler(24, r, 3, seed=5) for r in range(3)]
    for s in new:
        s.load_state_dict(old[0].state_dict())
    rest = [i for s in new for i in _drain(s)]
    # 6 of 24 consumed; 3 ranks now read 2 each of the rest: nothing read twice.
    perm = old[0].rank_indices(0, 0, 12) + old[1].rank_indices(0, 0, 12)
    assert set(consumed) | set(rest) == set(perm)
    assert not set(consumed) & set(rest)


def test_state_over_other_data_restarts_the_epoch():
    sampler = ShardedSampler(10, 0, 1, seed=0)
    it = iter(sampler)
    next(it)
    other = ShardedSampler(11, 0, 1, seed=0)
    other.load_state_dict(sampler.state_dict())
    assert len(_drain(other)) == 11


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((10, 2, 2, 0), r"dp_rank must be in \[0, 2\), got 2"),
        ((10, -1, 2, 0), r"dp_rank must be in \[0, 2\), got -1"),
        ((10, 0, 0, 0), "dp_size must be >= 1"),
        ((-1, 0, 1, 0), "num_samples must be >= 0"),
    ],
)
def test_invalid_arguments_are_rejected(args, message):
    with pytest.raises(ValueError, match=message):
        ShardedSampler(*args)


# --- exact resume through the loader ---------------------------------------------------------

NUM_SAMPLES, BATCH = 13, 2  # 6 batches per epoch at dp_size 1 (one sample dropped)


def _loader(num_workers: int, dp_rank: int = 0, dp_size: int = 1):
    sampler = ShardedSampler(NUM_SAMPLES, dp_rank, dp_size, seed=11)
    loader = build_train_loader(IndexDataset(NUM_SAMPLES), sampler, BATCH, num_workers, seed=11)
    return loader, sampler


def _epochs(loader, num_epochs: int) -> list[list[list[int]]]:
    """Run ``num_epochs`` passes of ``for batch in loader``; each pass's batches as lists."""
    return [[b.flatten().tolist() for b in loader] for _ in range(num_epochs)]


def _interrupted_state(num_workers: int, epoch: int, k: int | None, **kw) -> dict:
    """Loader state after ``k`` batches of pass ``epoch``; k=None: after the pass ended."""
    loader, _ = _loader(num_workers, **kw)
    _epochs(loader, epoch)
    if k is None:
        _epochs(loader, 1)
    else:
        it = iter(loader)
        for _ in range(k):
            next(it)
    return loader.state_dict()


def _assert_resumes_exactly(num_workers: int, epoch: int, k: int | None, **kw) -> None:
    reference = _epochs(_loader(num_workers, **kw)[0], 3)
    state = _interrupted_state(num_workers, epoch, k, **kw)
    resumed, _ = _loader(num_workers, **kw)
    resumed.load_state_dict(state)
    got = _epochs(resumed, 3 - epoch)
    if k is None:
        assert got[: 2 - epoch] == reference[epoch + 1 :]
    else:
        assert got == [reference[epoch][k:], *reference[epoch + 1 :]]


@pytest.mark.parametrize(
    ("epoch", "k"),
    [(0, 0), (0, 1), (0, 3), (0, 5), (0, 6), (0, None), (1, 2), (1, 6), (1, None)],
)
def test_resume_without_workers_matches_uninterrupted(epoch, k):
    _assert_resumes_exactly(0, epoch, k)


@pytest.mark.parametrize("k", [0, 2, 3])  # 3 batches per epoch on each of 2 ranks
def test_resume_on_a_second_rank_matches_uninterrupted(k):
    _assert_resumes_exactly(0, 0, k, dp_rank=1, dp_size=2)


@pytest.mark.parametrize(("epoch", "k"), [(0, 2), (0, 6), (0, None), (1, 4)])
def test_resume_with_two_workers_matches_uninterrupted(epoch, k):
    # The workers prefetch past the batches consumed: the saved state must not count those.
    _assert_resumes_exactly(2, epoch, k)


@pytest.mark.parametrize(("saved_workers", "new_workers"), [(0, 2), (2, 0)])
def test_resume_with_another_worker_count_matches_uninterrupted(saved_workers, new_workers):
    reference = _epochs(_loader(0)[0], 2)
    state = _interrupted_state(saved_workers, 0, 4)
    loader, sampler = _loader(new_workers)
    load_loader_state(loader, sampler, state)
    assert _epochs(loader, 2) == [reference[0][4:], reference[1]]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_new_iterator_mid_epoch_continues_the_epoch(num_workers):
    reference = _epochs(_loader(0)[0], 2)
    loader, _ = _loader(num_workers)
    it = iter(loader)
    head = [next(it).flatten().tolist() for _ in range(2)]
    rest = [b.flatten().tolist() for b in loader]  # a fresh iter(loader)
    assert [head + rest, *_epochs(loader, 1)] == reference
