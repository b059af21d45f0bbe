"""Dataset mixtures: config checks, proportions, ranks, exact resume, set_weights."""

from __future__ import annotations

import math

import pytest
import torch

from kempnerforge.config.data import DataConfig, DatasetSourceConfig
from kempnerforge.core.errors import ConfigError, DataError
from kempnerforge.data.dataloader import build_train_loader, load_loader_state
from kempnerforge.data.pipeline_build import build_data_pipeline
from kempnerforge.data.prepare.corpus import prepare_data
from kempnerforge.data.sampling.mixture import MixtureSampler, mixture_probabilities
from kempnerforge.data.tokenizer import ByteTokenizer, HFTokenizer
from tests.support.data_files import IndexDataset, make_hf_tokenizer, write_jsonl

SIZES = [40, 40]


def _sources(indices, sizes=SIZES) -> torch.Tensor:
    bounds = torch.tensor(sizes).cumsum(0)
    return torch.bucketize(torch.as_tensor(indices), bounds, right=True)


def _within(count: int, n: int, p: float, sigmas: float = 4.0) -> bool:
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p)) + 1


# --- probabilities and proportions ------------------------------------------------------------


def test_probabilities_follow_the_temperature_formula():
    assert mixture_probabilities([3, 1], 1.0) == pytest.approx([0.75, 0.25])
    flat = mixture_probabilities([3, 1], 2.0)  # sqrt(3) : 1
    assert flat == pytest.approx([math.sqrt(3) / (math.sqrt(3) + 1), 1 / (math.sqrt(3) + 1)])
    sharp = mixture_probabilities([3, 1], 0.5)  # 9 : 1
    assert sharp == pytest.approx([0.9, 0.1])
    assert mixture_probabilities([0, 2, 2], 0.5) == [0.0, 0.5, 0.5]


@pytest.mark.parametrize(("temperature", "p0"), [(1.0, 0.75), (2.0, None), (0.5, 0.9)])
def test_an_epoch_gives_each_source_its_exact_share(temperature, p0):
    sizes = [1000, 1000]
    p0 = p0 if p0 is not None else mixture_probabilities([3, 1], temperature)[0]
    sampler = MixtureSampler(sizes, [3, 1], temperature, 0, 1, seed=5)
    drawn = list(sampler)
    n = len(drawn)
    assert n == 2000
    # Not a random count: n * p0 rounded (1500, 1268, 1800).
    assert int((_sources(drawn, sizes) == 0).sum()) == round(n * p0)
    # Spread over the epoch, not in blocks: each half of it holds about its share.
    first_half = int((_sources(drawn[:1000], sizes) == 0).sum())
    assert _within(first_half, 1000, p0)


def test_a_zero_weight_source_is_never_drawn():
    sampler = MixtureSampler([30, 30, 30], [1, 0, 2], 0.5, 0, 1, seed=1)
    for _ in range(3):
        assert not (_sources(list(sampler), [30, 30, 30]) == 1).any()


def test_each_source_is_read_in_full_passes_without_repeats():
    sampler = MixtureSampler([5, 100], [1, 1], 1.0, 0, 1, seed=2)
    drawn = list(sampler)
    small = [i for i in drawn if i < 5]
    assert len(small) == 53  # its exact share of 105 positions (52.5, rounded up: lower index)
    # 10 full passes and 3 windows of an 11th: each window read 10 or 11 times.
    counts = sorted(small.count(w) for w in range(5))
    assert counts == [10, 10, 11, 11, 11]
    big = [i for i in drawn if i >= 5]
    assert len(big) == len(set(big)) == 52


@pytest.mark.parametrize("dp_size", [2, 3])
def test_ranks_are_equally_long_and_together_the_global_sequence(dp_size):
    sizes = [20, 13]
    ranks = [MixtureSampler(sizes, [2, 1], 1.0, r, dp_size, seed=4) for r in range(dp_size)]
    shards = [list(s) for s in ranks]
    per_rank = sum(sizes) // dp_size
    assert all(len(s) == per_rank == len(ranks[0]) for s in shards)
    sequence = [ranks[0].global_index(0, p) for p in range(per_rank * dp_size)]
    # The same global sequence at any dp_size: a single rank reads it from the start.
    assert list(MixtureSampler(sizes, [2, 1], 1.0, 0, 1, seed=4))[: len(sequence)] == sequence
    for r, shard in enumerate(shards):
        assert shard == sequence[r::dp_size]
    # Disjoint positions; with no source oversampled in one pass the windows differ too.
    even = [MixtureSampler([50, 50], [1, 1], 1.0, r, 2, seed=4) for r in range(2)]
    a, b = (list(s) for s in even)
    first = lambda s: {i for i in s if i < 50}  # noqa: E731
    if len([i for i in a + b if i < 50]) <= 50:
        assert not first(a) & first(b)


def test_order_is_deterministic_given_the_seed_and_differs_by_epoch():
    a, b = (MixtureSampler(SIZES, [3, 1], 1.0, 0, 1, seed=9) for _ in range(2))
    epoch0, epoch1 = list(a), list(a)
    assert (epoch0, epoch1) == (list(b), list(b))
    assert epoch0 != epoch1
    assert list(MixtureSampler(SIZES, [3, 1], 1.0, 0, 1, seed=10)) != epoch0


def test_update_weights_applies_from_the_next_draw_and_is_deterministic():
    def run() -> list[int]:
        sampler = MixtureSampler([200, 200], [1, 1], 1.0, 0, 1, seed=3)
        it = iter(sampler)
        head = [next(it) for _ in range(100)]
        sampler.update_weights([1, 0])
        return head + list(it)

    drawn = run()
    assert drawn == run()
    assert (_sources(drawn[:100], [200, 200]) == 1).any()
    assert not (_sources(drawn[100:], [200, 200]) == 1).any()
    plain = list(MixtureSampler([200, 200], [1, 1], 1.0, 0, 1, seed=3))
    assert drawn[:100] == plain[:100]


def test_the_next_epoch_starts_with_the_updated_weights_and_state_records_them():
    sampler = MixtureSampler(SIZES, [1, 1], 1.0, 0, 1, seed=3)
    it = iter(sampler)
    next(it)
    sampler.update_weights([0, 1])
    next(it)
    state = sampler.state_dict()
    assert state["weights"] == [0.0, 1.0] and state["changes"] == [[1, [0.0, 1.0]]]
    list(it)
    assert sampler.epoch == 1 and sampler.state_dict()["changes"] == []
    assert (_sources(list(sampler)) == 1).all()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([10], [1, 2], 1.0, 0, 1, 0), "one weight per source"),
        (([10, 10], [0, 0], 1.0, 0, 1, 0), "at least one weight must be > 0"),
        (([10, 10], [-1, 1], 1.0, 0, 1, 0), "weights must be >= 0"),
        (([10, 10], [1, 1], 0.0, 0, 1, 0), "temperature must be > 0"),
        (([10, 10], [1, 1], 1.0, 2, 2, 0), r"dp_rank must be in \[0, 2\)"),
    ],
)
def test_invalid_sampler_arguments_are_rejected(args, message):
    with pytest.raises(ValueError, match=message):
        MixtureSampler(*args)


# --- exact resume through the loader ----------------------------------------------------------

LOADER_SIZES, BATCH = [9, 6], 2  # 7 batches per epoch at dp_size 1


def _loader(num_workers: int, change_at: int | None = None):
    sampler = MixtureSampler(LOADER_SIZES, [2, 1], 1.0, 0, 1, seed=11)
    loader = build_train_loader(IndexDataset(15), sampler, BATCH, num_workers, seed=11)
    return loader, sampler


def _change(loader, sampler) -> None:
    """What DataPipeline.set_weights then BatchStream.reset do: switch at the consumed batch."""
    sampler.update_weights([1, 3])
    loader.load_state_dict(loader.state_dict())


def _run(num_workers: int, change_at: int | None, total: int = 16) -> list[list[int]]:
    """``total`` batches over epochs, switching weights after batch ``change_at``."""
    loader, sampler = _loader(num_workers)
    out: list[list[int]] = []
    while len(out) < total:
        for batch in loader:
            out.append(batch.flatten().tolist())
            if len(out) == change_at:
                _change(loader, sampler)
                break
            if len(out) == total:
                break
    return out


def _resumed(num_workers: int, change_at: int | None, stop: int, total: int = 16):
    loader, sampler = _loader(num_workers)
    out: list[list[int]] = []
    done = False
    while not done:
        for batch in loader:
            out.append(batch.flatten().tolist())
            if len(out) == change_at:
                _change(loader, sampler)
                break
            if len(out) == stop:
                done = True
                break
    state = loader.state_dict()
    new_loader, new_sampler = _loader(num_workers)
    load_loader_state(new_loader, new_sampler, state)
    while len(out) < total:
        for batch in new_loader:
            out.append(batch.flatten().tolist())
            if len(out) == total:
                break
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(("change_at", "stop"), [(None, 3), (None, 7), (2, 5), (4, 9)])
def test_resume_matches_uninterrupted(num_workers, change_at, stop):
    reference = _run(0, change_at)
    assert _run(num_workers, change_at) == reference
    assert _resumed(num_workers, change_at, stop) == reference


def test_a_weight_change_is_the_same_with_and_without_workers_and_takes_effect():
    reference = _run(0, 3)
    assert reference[:3] == _run(0, None)[:3]
    assert reference[3:7] != _run(0, None)[3:7]


def test_state_over_other_weights_restarts_the_epoch_with_the_configured_weights():
    sampler = MixtureSampler(SIZES, [3, 1], 1.0, 0, 1, seed=0)
    it = iter(sampler)
    next(it)
    other = MixtureSampler(SIZES, [1, 1], 1.0, 0, 1, seed=0)
    other.load_state_dict(sampler.state_dict())
    assert list(other) == list(MixtureSampler(SIZES, [1, 1], 1.0, 0, 1, seed=0))


# --- config -----------------------------------------------------------------------------------


def _cfg(*sources: tuple, **kw) -> DataConfig:
    return DataConfig(datasets=[DatasetSourceConfig(*s) for s in sources], **kw)


@pytest.mark.parametrize(
    ("sources", "kw", "field"),
    [
        ((("a", "/x", -1.0),), {}, "data.datasets[0].weight"),
        ((("a", "/x", 0.0), ("b", "/y", 0.0)), {}, "data.datasets[0].weight"),
        ((("a", "/x"), ("a", "/y")), {}, "data.datasets[1].name"),
        ((("a", "/x"), ("b c", "/y")), {}, "data.datasets[1].name"),
        ((("", "/x"),), {}, "data.datasets[0].name"),
        ((("a", "/x"), ("b", "")), {}, "data.datasets[1].path"),
        ((("a", "/x"),), {"path": "/z"}, "data.path"),
        ((("a", "/x"),), {"mix_temperature": 0.0}, "data.mix_temperature"),
    ],
)
def test_bad_mixture_config_names_the_field(sources, kw, field):
    with pytest.raises(ConfigError) as info:
        _cfg(*sources, **kw)
    assert info.value.field == field
    assert str(info.value).startswith(field + " = ")


def test_a_good_mixture_config_is_accepted():
    cfg = _cfg(("web", "/x", 3.0), ("code-1", "/y"), mix_temperature=2.0)
    assert cfg.is_mixture and [s.weight for s in cfg.datasets] == [3.0, 1.0]
    assert not DataConfig().is_mixture


# --- through build_data_pipeline ---------------------------------------------------------------

SEQ_LEN, PIPE_BATCH = 8, 4


@pytest.fixture(scope="module")
def mixture_dirs(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("mix")
    dirs = []
    for name, letter in (("a", "x"), ("b", "y")):
        src = write_jsonl(root / f"{name}.jsonl", [f"{letter * (5 + i % 7)}" for i in range(120)])
        prepare_data([str(src)], str(root / name), ByteTokenizer())
        dirs.append(str(root / name))
    return dirs[0], dirs[1]


def _pipe(dirs, weights=(3.0, 1.0), **kw):
    cfg = _cfg(("a", dirs[0], weights[0]), ("b", dirs[1], weights[1]), **kw)
    return build_data_pipeline(cfg, seq_len=SEQ_LEN, batch_size=PIPE_BATCH, seed=1)


def test_mixture_pipeline_batches_carry_dataset_idx(mixture_dirs):
    pipe = _pipe(mixture_dirs)
    batch = next(iter(pipe.dataloader))
    assert set(batch) == {"input_ids", "labels", "doc_ids", "dataset_idx"}
    assert batch["dataset_idx"].dtype == torch.int64 and batch["dataset_idx"].shape == (PIPE_BATCH,)
    assert batch["input_ids"].shape == (PIPE_BATCH, SEQ_LEN)
    x, y = ord("x"), ord("y")
    for row, source in zip(batch["input_ids"], batch["dataset_idx"], strict=True):
        assert (row == (x if source == 0 else y)).any()
    assert pipe.dataset_names == ["a", "b"]
    assert pipe.eval_datasets == {}  # no eval_path, no eval.sets: no eval data
    assert pipe.num_train_windows == sum(len(d) for d in pipe.dataset.datasets)


def test_a_bad_mixture_path_names_the_field(mixture_dirs, tmp_path):
    missing = str(tmp_path / "missing")
    cfg = _cfg(("a", mixture_dirs[0]), ("b", missing))
    with pytest.raises(ConfigError, match=r"^data\.datasets\[1\]\.path: ") as info:
        build_data_pipeline(cfg, seq_len=SEQ_LEN, batch_size=PIPE_BATCH, seed=1)
    assert info.value.field == "data.datasets[1].path" and info.value.value == missing
    assert isinstance(info.value, DataError) and f"{missing} is not a directory" in str(info.value)


def test_a_source_from_another_tokenizer_names_the_field_and_the_directory(mixture_dirs, tmp_path):
    other = tmp_path / "other"
    hf = HFTokenizer(make_hf_tokenizer(tmp_path / "tokenizer.json"))
    prepare_data([str(write_jsonl(tmp_path / "o.jsonl", ["some text"] * 50))], str(other), hf)
    cfg = _cfg(("a", mixture_dirs[0]), ("b", str(other)))
    with pytest.raises(ConfigError) as info:
        build_data_pipeline(cfg, seq_len=SEQ_LEN, batch_size=PIPE_BATCH, seed=1)
    assert info.value.field == "data.datasets[1].path"
    assert str(info.value).startswith(
        f"data.datasets[1].path: {other} was prepared with tokenizer '{hf.identity}', "
        "but this job uses 'byte'"
    )


def test_set_weights_changes_proportions_from_the_next_reset(mixture_dirs):
    pipe = _pipe(mixture_dirs, weights=(1.0, 1.0))
    it = iter(pipe.dataloader)
    before = [next(it)["dataset_idx"] for _ in range(3)]
    pipe.set_weights({"b": 0.0})
    assert pipe.sampler.weights == [1.0, 0.0]
    pipe.dataloader.load_state_dict(pipe.dataloader.state_dict())  # BatchStream.reset()
    it = iter(pipe.dataloader)
    after = torch.cat([next(it)["dataset_idx"] for _ in range(6)])
    assert (torch.cat(before) == 1).any()
    assert (after == 0).all()
    state = pipe.state_dict()
    resumed = _pipe(mixture_dirs, weights=(1.0, 1.0))
    resumed.load_state_dict(state)
    ref = next(it)
    got = next(iter(resumed.dataloader))
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_set_weights_rejects_unknown_names_and_all_zero(mixture_dirs):
    pipe = _pipe(mixture_dirs)
    with pytest.raises(ValueError, match=r"unknown dataset 'c'.*known datasets: a, b"):
        pipe.set_weights({"c": 1.0})
    with pytest.raises(ValueError, match="all 0 after the update"):
        pipe.set_weights({"a": 0.0, "b": 0.0})
    assert pipe.sampler.weights == [3.0, 1.0]


def test_a_single_dataset_pipeline_has_no_names_and_no_set_weights(mixture_dirs):
    pipe = build_data_pipeline(
        DataConfig(path=mixture_dirs[0]), seq_len=SEQ_LEN, batch_size=PIPE_BATCH, seed=1
    )
    assert pipe.dataset_names == []
    assert "dataset_idx" not in next(iter(pipe.dataloader))
    with pytest.raises(ValueError, match="needs a \\[\\[data.datasets\\]\\] mixture"):
        pipe.set_weights({"a": 1.0})


@pytest.mark.parametrize("chunk_tokens", [0, 48])
@pytest.mark.parametrize("z_loss_weight", [0.0, 0.01])
def test_per_dataset_losses_add_up_to_the_step_loss(
    mixture_dirs, tmp_path, z_loss_weight, chunk_tokens
):
    """loss/<name> is the same objective as the step's loss (z-loss included), so the
    token-weighted mean of the per-dataset losses is the step's loss, with the chunked
    head and with whole logits."""
    from kempnerforge.config.loader import load_config
    from kempnerforge.distributed.runtime import RuntimeContext
    from kempnerforge.training.build import build_session
    from kempnerforge.training.loop import text_step
    from tests.support.tiny import TINY_MODEL

    mix = tmp_path / "mix.toml"
    mix.write_text(
        f'[[data.datasets]]\nname = "a"\npath = "{mixture_dirs[0]}"\nweight = 1.0\n'
        f'[[data.datasets]]\nname = "b"\npath = "{mixture_dirs[1]}"\nweight = 1.0\n'
    )
    config = load_config(
        str(mix),
        [
            *TINY_MODEL,
            f"--train.z_loss_weight={z_loss_weight}",
            f"--train.loss_chunk_tokens={chunk_tokens}",
            "--train.batch_size=8",
            f"--train.seq_len={SEQ_LEN}",
            "--train.grad_accum_steps=2",
            f"--train.run_dir={tmp_path / 'run'}",
            "--metrics.progress=off",
        ],
    )
    config.validate(1)
    session = build_session(config, RuntimeContext())
    result = text_step(session, 0)
    counts = result.dataset_loss_counts
    assert all(counts[name] > 0 for name in ("a", "b"))  # both sources in the step
    total = sum(result.dataset_loss_sums.values()) / sum(counts.values())
    assert total == pytest.approx(result.loss, rel=1e-6)
