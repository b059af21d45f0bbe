"""Resume-test inputs and checks: a corpus of a few steps per epoch, sessions, state copies."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from kempnerforge.config.loader import load_config
from kempnerforge.data.bad_windows import read_bad_data
from kempnerforge.data.prepare.corpus import prepare_data
from kempnerforge.data.tokenizer import ByteTokenizer
from kempnerforge.data.tokens.shards import Shard
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.training.build import build_session
from kempnerforge.training.hooks import StepContext, TrainingHook
from kempnerforge.training.loop import TrainingSession, run_training_loop
from tests.support.faults import crash_at_step

WORDS = ["alpha", "beta", "gamma", "delta", "def", "return", "class", "import"]


def write_small_corpus(
    root: Path, num_docs: int, seed: int = 0, num_shards: int | None = None
) -> tuple[str, str]:
    """(train_dir, eval_dir) of byte-tokenized synthetic documents, prepared under root.

    Small on purpose: a few hundred tokens make an epoch only a handful of batches. With
    ``num_shards`` the documents are spread over two files per shard and prepared by one
    prepare-data call per shard: the same token streams, as sharded directories.
    """
    rng = random.Random(seed)
    texts = [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) + "\n"
        for _ in range(num_docs)
    ]
    num_files = 1 if num_shards is None else 2 * num_shards
    inputs = root / "inputs"
    inputs.mkdir()
    for k in range(num_files):
        part = texts[k * num_docs // num_files : (k + 1) * num_docs // num_files]
        with open(inputs / f"docs-{k:02d}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": text}) + "\n" for text in part)
    train, evald = str(root / "train"), str(root / "eval")
    shards = [None] if num_shards is None else [Shard(i, num_shards) for i in range(num_shards)]
    for shard in shards:
        prepare_data(
            [str(inputs)],
            train,
            ByteTokenizer(),
            eval_fraction=0.2,
            eval_output_dir=evald,
            shard=shard,
        )
    return train, evald


def make_session(overrides: list[str]) -> TrainingSession:
    """A validated single-process session over these command-line overrides."""
    config = load_config(None, overrides)
    config.validate(1)
    return build_session(config, RuntimeContext())


def bad_data_after_a_crash(session: TrainingSession, step: int) -> set[int]:
    """Run ``session`` until it crashes at ``step`` (crash_at_step), as a lost process does;
    the windows its bad-data record holds by then, which the resumed run must not read."""
    crash_at_step(session, step)
    with session.tracker, pytest.raises(RuntimeError, match="went away"):
        run_training_loop(session)
    return {w.window for w in read_bad_data(session.checkpointer.directory)}


def parameters_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def optimizer_state_of(optimizer: torch.optim.Optimizer) -> dict:
    """A deep copy of optimizer.state_dict(): later steps cannot change it."""
    sd = optimizer.state_dict()
    return {
        "state": {
            i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in sd["state"].items()
        },
        "param_groups": [dict(g) for g in sd["param_groups"]],
    }


def draw_from_every_generator() -> None:
    """Move python, numpy and torch off their seeded states, as a model with dropout would."""
    random.random()
    np.random.rand()
    torch.rand(3)


def rng_state_of() -> dict:
    """The process's python, numpy and torch CPU generator states, comparable with ==."""
    np_state = np.random.get_state(legacy=True)
    return {
        "python": random.getstate(),
        "numpy": (np_state[0], np_state[1].tolist(), *np_state[2:]),
        "torch": torch.get_rng_state().tolist(),
    }


def assert_tensors_bitwise_equal(
    got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str
) -> None:
    assert got.keys() == expected.keys(), what
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype, f"{what} {name}"
        assert torch.equal(got[name], tensor), f"{what} {name} differs"


def assert_optimizer_states_bitwise_equal(got: dict, expected: dict) -> None:
    """Same param groups, and every moment tensor (exp_avg, exp_avg_sq, step) bit for bit."""
    assert got["param_groups"] == expected["param_groups"]
    assert got["state"].keys() == expected["state"].keys()
    assert expected["state"], "the optimizer holds no state to compare"
    for index, state in expected["state"].items():
        assert got["state"][index].keys() == state.keys(), index
        for key, value in state.items():
            other = got["state"][index][key]
            if torch.is_tensor(value):
                assert torch.is_tensor(other) and other.dtype == value.dtype, (index, key)
                assert torch.equal(other, value), f"optimizer state {index}.{key} differs"
            else:
                assert other == value, (index, key)


class RecordLR(TrainingHook):
    """Records the learning rate each optimizer step used, by step."""

    def __init__(self) -> None:
        self.lrs: dict[int, float] = {}

    def on_step_end(self, ctx: StepContext) -> None:
        self.lrs[ctx.step] = ctx.lr
