"""Generation: the KV cache against the full forward, sampling, and `kempnerforge generate`."""

from __future__ import annotations

import argparse
import shutil

import pytest
import torch

from kempnerforge.commands.generate import add_generate_arguments, run_generate
from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import CheckpointError, ConfigError
from kempnerforge.model import KVCache, Transformer, forward_cached, generate, generate_greedy
from kempnerforge.model.generation.generate import sample_token
from kempnerforge.model.moe.layer import MoEFeedForward, RouterStats
from kempnerforge.training.inference.prompt import data_starts_with_bos
from tests.support.tolerance import assert_reordered_close, transformer_terms

VOCAB = 97

CONFIGS = {
    "dense_gqa": dict(n_heads=4, n_kv_heads=2),
    "dense_mha": dict(n_heads=4),
    "dense_mqa_tied": dict(n_heads=4, n_kv_heads=1, tie_embeddings=True),
    "moe_softmax_gqa": dict(n_heads=4, n_kv_heads=2, num_experts=4, moe_top_k=2),
    "moe_sigmoid_shared": dict(
        n_heads=4, num_experts=4, moe_top_k=1, moe_router="sigmoid", moe_shared_experts=1
    ),
    "moe_every_other": dict(n_heads=4, n_kv_heads=2, num_experts=4, moe_frequency=2),
    # Sliding windows shorter than the sequences below, so they bind in the prompt, in the
    # chunks after it and one token at a time: every layer (Mistral), and alternating
    # window and whole past with grouped heads (Gemma 2, GPT-OSS), by the per-layer list.
    "window_every_layer": dict(n_heads=4, sliding_window=6),
    "window_alternating_gqa": dict(
        n_heads=4,
        n_kv_heads=2,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
    ),
}


def tiny_model(name: str = "dense_gqa", **overrides: object) -> Transformer:
    fields: dict = dict(dim=64, n_layers=2, vocab_size=VOCAB, max_seq_len=40, init_std=0.1)
    fields.update(CONFIGS[name])
    fields.update(overrides)
    torch.manual_seed(0)
    return Transformer(ModelConfig(**fields)).eval()


def random_ids(length: int, seed: int, batch: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=generator)


def stepwise_argmax(model: Transformer, prompt: list[int], new: int) -> list[int]:
    """The reference: the full forward over the whole sequence, argmax, for every token."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            logits = model(torch.tensor([tokens]))
            assert isinstance(logits, torch.Tensor)
            tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(prompt) :]


# --- The cache ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("chunks", [[23], [1] * 23, [5, 1, 1, 7, 9], [12, 11]])
def test_cached_logits_match_the_full_forward(name, chunks):
    model = tiny_model(name)
    ids = random_ids(sum(chunks), seed=len(chunks), batch=2)
    with torch.no_grad():
        full = model(ids)
    assert isinstance(full, torch.Tensor)
    cache = KVCache.for_model(model, batch=2)
    pieces, start = [], 0
    for size in chunks:
        pieces.append(forward_cached(model, ids[:, start : start + size], cache))
        start += size
        assert cache.position == start
    cached = torch.cat(pieces, dim=1)
    assert cached.shape == full.shape
    # Cached attention reads keys in pieces, so its sums run in another order.
    terms = transformer_terms(model.cfg, ids.shape[1], backward=False)
    assert_reordered_close(cached, full, terms=terms)


def test_last_only_gives_the_last_positions_logits():
    model = tiny_model()
    ids = random_ids(9, seed=3)
    every = forward_cached(model, ids, KVCache.for_model(model))
    last = forward_cached(model, ids, KVCache.for_model(model), last_only=True)
    assert last.shape == (1, 1, VOCAB)
    # The head on one row against all nine: other matmul kernels, dim terms each.
    assert_reordered_close(last[:, 0], every[:, -1], terms=model.cfg.dim)


def test_the_cache_holds_grouped_heads_and_refuses_overflow_and_stages():
    model = tiny_model("dense_gqa")
    cache = KVCache.for_model(model, 10, batch=3)
    assert len(cache.keys) == len(cache.values) == 2
    assert cache.keys[0].shape == (3, 2, 10, 16) and cache.max_len == 10 and cache.batch == 3
    forward_cached(model, random_ids(8, seed=0, batch=3), cache)
    with pytest.raises(ValueError, match="exceed the cache's 10 positions"):
        forward_cached(model, random_ids(3, seed=0, batch=3), cache)
    with pytest.raises(ValueError, match="batch of 1 rows"):
        forward_cached(model, random_ids(1, seed=0), cache)
    cache.reset()
    assert cache.position == 0
    with pytest.raises(ValueError, match="model.max_seq_len = 40"):
        KVCache.for_model(model, 41)
    model.keep_layers(0, 1)
    with pytest.raises(ValueError, match="whole model"):
        forward_cached(model, random_ids(2, seed=0), KVCache.for_model(model))


# --- Greedy decoding ----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize(("prompt_len", "new"), [(1, 20), (5, 12), (17, 23), (39, 1)])
def test_greedy_with_the_cache_is_the_stepwise_argmax(name, prompt_len, new):
    model = tiny_model(name)
    prompt = random_ids(prompt_len, seed=prompt_len)[0].tolist()
    expected = stepwise_argmax(model, prompt, new)
    assert generate(model, prompt, new, temperature=0) == expected
    assert generate(model, prompt, new, temperature=0, use_cache=False) == expected
    assert generate_greedy(model, prompt, new, max_seq_len=40) == expected


@pytest.mark.parametrize("name", ["dense_gqa", "moe_softmax_gqa"])
def test_top_k_one_tiny_top_p_and_temperature_zero_are_greedy(name):
    model = tiny_model(name)
    prompt = [3, 1, 4, 1, 5]
    greedy = stepwise_argmax(model, prompt, 15)
    assert generate(model, prompt, 15, temperature=0.0, seed=1) == greedy
    assert generate(model, prompt, 15, top_k=1, seed=2) == greedy
    assert generate(model, prompt, 15, temperature=2.0, top_k=1, seed=3) == greedy
    assert generate(model, prompt, 15, top_p=1e-6, seed=4) == greedy
    assert generate(model, prompt, 15, temperature=1.5, top_p=1e-6, seed=5) == greedy


# --- Sampling -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dense_gqa", "moe_sigmoid_shared"])
def test_sampling_repeats_with_a_seed_and_the_cache_does_not_change_it(name):
    model = tiny_model(name)
    prompt = [7, 8, 9]
    options = dict(temperature=1.3, top_k=40, top_p=0.95)
    first = generate(model, prompt, 30, seed=123, **options)
    assert len(first) == 30
    assert generate(model, prompt, 30, seed=123, **options) == first
    assert generate(model, prompt, 30, seed=123, use_cache=False, **options) == first
    others = {tuple(generate(model, prompt, 30, seed=seed, **options)) for seed in range(4)}
    assert len(others) > 1, "different seeds should draw different tokens"
    assert first != stepwise_argmax(model, prompt, 30)


def test_sample_token_keeps_to_the_top_k_and_the_nucleus():
    logits = torch.tensor([0.0, 3.0, 2.9, 1.0, 2.8, -1.0])
    generator = torch.Generator().manual_seed(0)
    drawn = {sample_token(logits, top_k=3, generator=generator) for _ in range(300)}
    assert drawn == {1, 2, 4}
    probs = torch.softmax(logits, 0)
    # The three likeliest hold about 0.87 of the probability: a nucleus of 0.8 needs all
    # three, one of 0.5 the first two.
    assert float(probs[[1, 2, 4]].sum()) > 0.8 > float(probs[[1, 2]].sum()) > 0.5
    drawn = {sample_token(logits, top_p=0.8, generator=generator) for _ in range(300)}
    assert drawn == {1, 2, 4}
    drawn = {sample_token(logits, top_p=0.5, generator=generator) for _ in range(300)}
    assert drawn == {1, 2}
    assert sample_token(logits, temperature=0.0) == 1
    assert sample_token(logits, temperature=1e-30, generator=generator) == 1
    tie = torch.tensor([1.0, 5.0, 5.0, 0.0])
    assert sample_token(tie, temperature=0) == 1 == sample_token(tie, top_k=1)
    assert sample_token(tie, top_p=1e-9, generator=generator) == 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
    ],
)
def test_bad_sampling_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        generate(tiny_model(), [1, 2], 3, **options)


# --- Stopping and the context length -------------------------------------------------------


@pytest.mark.parametrize("use_cache", [True, False])
def test_decoding_stops_before_the_stop_id(use_cache):
    model = tiny_model()
    prompt = [5, 6, 7]
    tokens = generate(model, prompt, 20, temperature=0, use_cache=use_cache)
    stop_id = tokens[6]
    stopped = generate(model, prompt, 20, temperature=0, stop_id=stop_id, use_cache=use_cache)
    assert stopped == tokens[: tokens.index(stop_id)]
    assert stop_id not in stopped


@pytest.mark.parametrize("use_cache", [True, False])
def test_decoding_stops_after_the_token_stop_when_accepts(use_cache):
    model = tiny_model()
    tokens = generate(model, [5, 6, 7], 20, temperature=0, use_cache=use_cache)
    seen: list[list[int]] = []

    def stop_when(new: list[int]) -> bool:
        seen.append(list(new))
        return len(new) == 4

    stopped = generate(
        model, [5, 6, 7], 20, temperature=0, use_cache=use_cache, stop_when=stop_when
    )
    assert stopped == tokens[:4]  # the accepted token is kept
    assert seen == [tokens[:n] for n in range(1, 5)]  # asked after every new token


def test_the_prompt_and_new_tokens_must_fit_max_seq_len():
    model = tiny_model()  # max_seq_len 40
    prompt = list(range(30))
    assert len(generate(model, prompt, 10, temperature=0)) == 10
    with pytest.raises(ValueError, match=r"30 tokens plus 11 new .* at most 10 new tokens fit"):
        generate(model, prompt, 11)
    with pytest.raises(ValueError, match="no new token fits"):
        generate(model, list(range(40)), 1)
    assert generate(model, list(range(40)), 0) == []
    with pytest.raises(ValueError, match="non-empty prompt"):
        generate(model, [], 3)


# --- Training state left alone -------------------------------------------------------------


def test_decoding_leaves_router_statistics_and_training_mode_alone():
    model = tiny_model("moe_sigmoid_shared").train()
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    assert layers
    sentinels = []
    for layer in layers:
        zero = torch.zeros(())
        stats = RouterStats(aux_loss=zero, z_loss=zero, load=torch.zeros(4), dropped=zero)
        layer.last = stats
        sentinels.append(stats)
        assert layer.router.expert_bias is not None
        layer.router.expert_bias.copy_(torch.tensor([0.1, -0.1, 0.0, 0.2]))
    biases = [layer.router.expert_bias.clone() for layer in layers]  # type: ignore[union-attr]
    generate(model, [1, 2, 3], 8, seed=0)
    generate(model, [1, 2, 3], 8, seed=0, use_cache=False)
    generate_greedy(model, [1, 2, 3], 8, max_seq_len=40)
    assert model.training
    for layer, stats, bias in zip(layers, sentinels, biases, strict=True):
        assert layer.last is stats
        assert layer.totals is None
        assert torch.equal(layer.router.expert_bias, bias)  # type: ignore[arg-type]


# --- The command ---------------------------------------------------------------------------


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_generate_arguments(parser)
    return parser.parse_args(list(argv))


def test_generate_arguments_and_their_defaults():
    args = parse("--checkpoint", "c", "--prompt", "hi")
    assert (args.checkpoint, args.prompt, args.config) == ("c", "hi", "")
    assert (args.max_new_tokens, args.temperature, args.top_k, args.top_p) == (128, 1.0, 0, 1.0)
    assert (args.seed, args.no_cache, args.bos) == (None, False, None)
    args = parse(
        "--checkpoint=c",
        "--prompt=x",
        "--config=a.toml",
        "--max-new-tokens=5",
        "--temperature=0",
        "--top-k=3",
        "--top-p=0.5",
        "--seed=7",
        "--no-cache",
        "--no-bos",
    )
    assert (args.max_new_tokens, args.temperature, args.top_k, args.top_p) == (5, 0.0, 3, 0.5)
    assert (args.seed, args.no_cache, args.bos, args.config) == (7, True, False, "a.toml")


def test_a_missing_or_incomplete_checkpoint_is_a_one_line_checkpoint_error(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(CheckpointError) as info:
        run_generate(parse("--checkpoint", str(missing), "--prompt", "x"), [])
    assert info.value.path == str(missing) and "does not exist" in str(info.value)
    assert "\n" not in str(info.value)
    step = tmp_path / "checkpoints" / "step_4"
    step.mkdir(parents=True)
    # No config.toml beside it, and no complete checkpoint to read its recorded config from.
    with pytest.raises(CheckpointError) as info:
        run_generate(parse("--checkpoint", str(step), "--prompt", "x"), [])
    assert info.value.path == str(step) and "complete.json is missing" in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--temperature", "-1"), ("--top-k", "-2"), ("--top-p", "0"), ("--max-new-tokens", "-1")],
)
def test_bad_sampling_flags_are_config_errors(tmp_path, flag, value):
    with pytest.raises(ConfigError) as info:
        run_generate(parse("--checkpoint", str(tmp_path), "--prompt", "x", f"{flag}={value}"), [])
    assert info.value.field == flag


def test_a_vision_language_job_is_refused(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text("")
    args = parse("--checkpoint", str(tmp_path), "--prompt", "x", "--config", str(config))
    with pytest.raises(ConfigError) as info:
        run_generate(args, ["--vision_encoder.type=random", "--vlm.max_text_len=8"])
    assert str(info.value) == (
        f"{config}: kempnerforge generate takes text models, not a vision-language model "
        "([vlm]): it continues text prompts; a vision-language model's caption sample is "
        "printed at the end of training"
    )


def test_bos_follows_the_training_data(tmp_path):
    from kempnerforge.config.loader import load_config
    from kempnerforge.data.prepare.corpus import prepare_data
    from kempnerforge.data.tokenizer import ByteTokenizer
    from kempnerforge.data.tokens.shards import Shard

    source = tmp_path / "docs.jsonl"
    source.write_text('{"text": "alpha beta"}\n{"text": "gamma"}\n')
    with_bos, without = str(tmp_path / "with"), str(tmp_path / "without")
    prepare_data([str(source)], with_bos, ByteTokenizer(), bos_per_document=True)
    prepare_data([str(source)], without, ByteTokenizer())
    sharded = str(tmp_path / "sharded")
    for index in range(2):
        prepare_data(
            [str(source)], sharded, ByteTokenizer(), bos_per_document=True, shard=Shard(index, 2)
        )

    def data(*overrides: str):
        return load_config(None, list(overrides)).data

    assert data_starts_with_bos(data(f"--data.path={with_bos}")) is True
    assert data_starts_with_bos(data(f"--data.path={without}")) is False
    assert data_starts_with_bos(data(f"--data.path={sharded}")) is True
    assert data_starts_with_bos(data()) is False
    assert data_starts_with_bos(data("--data.builtin_bos=true")) is True
    mixture = '--data.datasets=[{name="a", path="%s"}, {name="b", path="%s"}]'
    assert data_starts_with_bos(data(mixture % (with_bos, without))) is False
    assert data_starts_with_bos(data(mixture % (with_bos, with_bos))) is True
    assert data_starts_with_bos(data(f"--data.path={tmp_path / 'gone'}")) is None


@pytest.mark.slow
def test_generate_continues_a_prompt_with_a_trained_checkpoint(tmp_path, tiny_overrides, capsys):
    from kempnerforge.data.tokenizer import ByteTokenizer
    from kempnerforge.training.loop import run_training_loop
    from kempnerforge.training.workspace import record_config
    from tests.support.resume import make_session

    overrides = [
        *[o for o in tiny_overrides if not o.startswith("--checkpoint.interval")],
        "--model.n_heads=4",
        "--model.n_kv_heads=2",
        "--train.max_steps=4",
        "--checkpoint.interval=4",
    ]
    session = make_session(overrides)
    with session.tracker:
        run_training_loop(session)
    record_config(session.config)  # what `kempnerforge train` writes into the run directory
    run_dir = tmp_path / "run"
    step = run_dir / "checkpoints" / "step_4"
    assert (run_dir / "config.toml").is_file() and step.is_dir()

    tokenizer = ByteTokenizer()
    prompt = "def "
    model = session.model
    assert isinstance(model, Transformer)
    expected = generate_greedy(
        model, list(prompt.encode()), 20, max_seq_len=64, stop_id=tokenizer.eos_id
    )
    expected_text = prompt + tokenizer.decode(expected) + "\n"

    def run(*argv: str, checkpoint: str = str(step)) -> str:
        capsys.readouterr()
        code = run_generate(parse("--checkpoint", checkpoint, "--prompt", prompt, *argv), [])
        assert code == 0
        return capsys.readouterr().out

    greedy = ["--temperature=0", "--max-new-tokens=20"]
    assert run(*greedy) == expected_text
    assert run(*greedy, "--no-cache") == expected_text
    assert run(*greedy, checkpoint=str(run_dir / "checkpoints")) == expected_text
    sampled = run("--seed=5", "--top-k=20", "--top-p=0.9", "--max-new-tokens=30")
    assert sampled.startswith(prompt)
    assert run("--seed=5", "--top-k=20", "--top-p=0.9", "--max-new-tokens=30") == sampled
    # More new tokens than the context holds: cut to what fits (max_seq_len 64).
    long = run("--temperature=0", "--max-new-tokens=500", "--no-bos")
    assert long.startswith(prompt) and len(long) <= 64 + 1  # one character per byte token

    # A checkpoint moved away from its run rebuilds its model from the config it recorded,
    # or from --config.
    moved = tmp_path / "elsewhere" / "step_4"
    shutil.copytree(step, moved)
    assert run(*greedy, checkpoint=str(moved)) == expected_text
    args = parse("--checkpoint", str(moved), "--prompt", prompt, *greedy)
    args.config = str(run_dir / "config.toml")
    assert run_generate(args, []) == 0
    assert capsys.readouterr().out == expected_text
