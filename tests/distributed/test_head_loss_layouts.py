"""The chunked head loss under tensor parallelism (vocabulary-parallel) and on the last
pipeline stage: the real build and loop on two gloo ranks, with a mixture's per-dataset
losses and the z-loss on, against one process; and neither layout computes whole logits."""

from __future__ import annotations

import pytest
import torch

from kempnerforge.config.job import JobConfig
from kempnerforge.config.loader import load_config
from kempnerforge.data.prepare.corpus import prepare_data
from kempnerforge.data.tokenizer import ByteTokenizer
from kempnerforge.distributed.runtime import init_runtime, world_size_from_env
from kempnerforge.training.build import build_session
from tests.support.data_files import write_jsonl
from tests.support.dist import run_distributed
from tests.support.tiny import layout_run
from tests.support.tolerance import assert_layout_close, grad_norm_terms
from tests.support.train_run import train_ranks

pytestmark = pytest.mark.distributed

STEPS = 3
SEQ_LEN, TOKENS = 32, 4 * 32
"""A window's length, and the tokens of a step's global batch (4 sequences): a step's loss
averages them, a per-dataset loss a part of them."""
CHUNK = ["--train.loss_chunk_tokens=24", "--train.z_loss_weight=0.01"]
"""24 tokens a chunk: a micro-batch of 2 or 4 rows of 32 tokens is walked in 3 to 6 chunks."""
TP = ["--distributed.tp=2", "--distributed.dp_shard=1", "--train.batch_size=4"]
PP = [
    "--distributed.pp=2",
    "--distributed.dp_shard=1",
    "--distributed.pp_schedule=1f1b",
    "--train.batch_size=2",
    "--train.grad_accum_steps=2",
]


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> str:
    """A TOML file of a two-source mixture (byte tokens), equal weights."""
    root = tmp_path_factory.mktemp("mix")
    dirs = []
    for name, letter in (("a", "x"), ("b", "y")):
        lines = [f"{letter * (5 + i % 7)} {name} {i}" for i in range(300)]
        src = write_jsonl(root / f"{name}.jsonl", lines)
        prepare_data([str(src)], str(root / name), ByteTokenizer())
        dirs.append(str(root / name))
    path = root / "mix.toml"
    path.write_text(
        f'[[data.datasets]]\nname = "a"\npath = "{dirs[0]}"\nweight = 1.0\n'
        f'[[data.datasets]]\nname = "b"\npath = "{dirs[1]}"\nweight = 1.0\n'
    )
    return str(path)


@pytest.fixture(scope="module")
def base() -> list[str]:
    return layout_run(None, STEPS, "--model.n_layers=4", "--data.document_masking=false", *CHUNK)


@pytest.fixture(scope="module")
def reference(base, mixture, tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("one")
    return train_ranks(base, run_dir, 1, "--train.batch_size=4", config_path=mixture)[0]


def _assert_matches(ranks: list[dict], reference: dict, config: JobConfig) -> None:
    """Within fp32 reordering of the model's chain of sums, the batch's tokens and the
    updates before each step (layout_atol)."""
    assert len(reference["losses"]) == STEPS
    bound = {"cfg": config.model, "seq_len": SEQ_LEN, "tokens": TOKENS}
    for record in ranks:
        assert_layout_close(record["losses"], reference["losses"], **bound)
        norms = record["grad_norms"], reference["grad_norms"]
        assert_layout_close(*norms, norm_terms=grad_norm_terms(config), **bound)
    # Rank 0 logs the metrics: its per-dataset losses are the one process's.
    got, want = ranks[0]["dataset_losses"], reference["dataset_losses"]
    assert all(set(step) == {"a", "b"} for step in want)
    for step, (got_step, want_step) in enumerate(zip(got, want, strict=True)):
        assert set(got_step) == set(want_step)
        for name, value in want_step.items():
            assert_layout_close([got_step[name]], [value], first_update=step, **bound)


@pytest.mark.parametrize("layout", [TP, PP], ids=["tp", "pp"])
def test_the_chunked_loss_trains_like_one_process_with_per_dataset_losses(
    base, mixture, reference, tmp_path, layout
) -> None:
    ranks = train_ranks(base, tmp_path / "two", 2, *layout, config_path=mixture)
    _assert_matches(ranks, reference, load_config(mixture, base))


def test_the_last_stage_of_a_tensor_parallel_pipeline_trains_like_one_process(
    base, mixture, reference, tmp_path
) -> None:
    """pp 2 x tp 2: the last stage's loss is vocabulary-parallel over plain (replicated)
    tensor parallelism, chunked, with the z-loss and per-dataset losses."""
    layout = [*PP, "--distributed.tp=2"]
    ranks = train_ranks(base, tmp_path / "four", 4, *layout, config_path=mixture, timeout_s=240.0)
    _assert_matches(ranks, reference, load_config(mixture, base))


def _head_calls(rank: int, world_size: int, overrides: list[str], config_path: str) -> int:
    """Calls of the head module's forward (whole, gathered logits) in one training step."""
    config = load_config(config_path, overrides)
    config.validate(world_size_from_env())
    runtime = init_runtime(config.distributed, "cpu")
    session = build_session(config, runtime)
    calls = [0]
    for module in session.model.modules():
        output = getattr(module, "output", None)
        if isinstance(output, torch.nn.Linear):
            output.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    with session.tracker:
        session.step_fn(session, 0)
    return calls[0]


@pytest.mark.parametrize("layout", [TP, PP], ids=["tp", "pp"])
def test_no_rank_computes_whole_logits_with_chunks_on(base, mixture, tmp_path, layout) -> None:
    overrides = [*base, f"--train.run_dir={tmp_path / 'run'}", *layout]
    assert run_distributed(_head_calls, 2, overrides, mixture) == [0, 0]
    # With loss_chunk_tokens = 0 the head runs, once per micro-batch (where it is held).
    whole = run_distributed(_head_calls, 2, [*overrides, "--train.loss_chunk_tokens=0"], mixture)
    assert sum(whole) > 0
