"""DPO on two gloo ranks against one process: under FSDP each rank holds one of the step's
two pairs and runs the sharded reference on its own rows, under tensor parallelism both
ranks hold the same pairs; the loss, the gradient norm and the rewards and log-probabilities
logged (reduced over every data-parallel rank's pairs) match one process within fp32
reordering. The two ranks read stored reference log-probabilities (dpo.reference =
"stored"), which they computed first, each data-parallel rank its share: the values equal
those one process stores, and the run equals one process's with a live reference."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kempnerforge.config.loader import load_config
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.training.build import build_session
from tests.support.chat_files import example_preference_corpus
from tests.support.metrics_rows import train_rows
from tests.support.tiny import layout_run
from tests.support.tolerance import (
    assert_layout_close,
    assert_reordered_close,
    grad_norm_terms,
    transformer_terms,
)
from tests.support.train_run import train_ranks

pytestmark = pytest.mark.distributed

STEPS = 3
SEQ = 96
LOGGED = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen")


@pytest.mark.parametrize("layout", [["--distributed.dp_shard=2"], ["--distributed.tp=2"]],
                         ids=["fsdp", "tp"])  # fmt: skip
def test_dpo_trains_on_two_ranks_like_one_process(tmp_path, layout):
    prefs = example_preference_corpus(tmp_path, 16, SEQ)
    base = layout_run(
        None, STEPS, f"--data.path={prefs}", "--data.eval_path=", f"--train.seq_len={SEQ}",
        f"--model.max_seq_len={SEQ}", "--train.loss_fn=dpo", "--optimizer.lr=1e-2",
        "--eval.interval=0",
    )  # fmt: skip
    one = train_ranks(base, tmp_path / "one", 1, "--train.batch_size=4")[0]
    per_rank = "--train.batch_size=2" if "dp_shard" in layout[0] else "--train.batch_size=4"
    stored = ["--dpo.reference=stored", f"--dpo.reference_dir={tmp_path / 'two_refs'}"]
    two = train_ranks(base, tmp_path / "two", 2, *layout, per_rank, *stored)
    config = load_config(None, base)
    one_refs = load_config(None, [*base, "--dpo.reference=stored", f"--train.run_dir={tmp_path}",
                                  f"--dpo.reference_dir={tmp_path / 'one_refs'}"])  # fmt: skip
    build_session(one_refs, RuntimeContext()).tracker.close()  # one process's values
    (want_values,) = [np.load(p) for p in (tmp_path / "one_refs").glob("*.npy")]
    (got_values,) = [np.load(p) for p in (tmp_path / "two_refs").glob("*.npy")]
    assert got_values.shape == want_values.shape == (32,)
    terms = transformer_terms(config.model, SEQ, backward=False) + SEQ
    assert_reordered_close(torch.from_numpy(got_values), torch.from_numpy(want_values), terms=terms)
    # Each logged value sums whole responses' log-probabilities: the chain of a forward and
    # its response's tokens (SEQ at most), per pair of the step.
    bound: dict[str, Any] = dict(cfg=config.model, seq_len=SEQ, tokens=SEQ)
    for record in two:
        assert record["losses"] == two[0]["losses"]
    assert_layout_close(two[0]["losses"], one["losses"], **bound)
    norm_terms = grad_norm_terms(config)
    assert_layout_close(two[0]["grad_norms"], one["grad_norms"], norm_terms=norm_terms, **bound)
    want, got = train_rows(tmp_path / "one"), train_rows(tmp_path / "two")
    assert len(got) == len(want) == STEPS
    assert (
        [r["supervised_tokens"] for r in got] == [r["supervised_tokens"] for r in want] == [2] * 3
    )
    for key in LOGGED:
        assert_layout_close([r[key] for r in got], [r[key] for r in want], **bound)
    assert want[-1]["rewards/margins"] != 0.0
