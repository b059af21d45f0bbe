"""Multi-token prediction (model.mtp_depth) on two gloo ranks against one process: FSDP shards
each MTP module's block like the decoder's (its projection and norms with the root), and
expert parallelism splits the MTP block's experts; the loss, the gradient norm and the
logged mtp/loss match one process within fp32 reordering."""

from __future__ import annotations

import pytest

from kempnerforge.config.loader import load_config
from tests.support.metrics_rows import train_rows
from tests.support.tiny import SIGMOID_MOE, layout_run
from tests.support.tolerance import assert_layout_close, grad_norm_terms
from tests.support.train_run import train_ranks

pytestmark = pytest.mark.distributed

STEPS = 3
SEQ_LEN, TOKENS = 32, 4 * 32
MTP = ["--model.mtp_depth=2", "--model.mtp_loss_weight=0.3"]


@pytest.mark.parametrize(
    ("model", "layout"),
    [
        ([], ["--distributed.dp_shard=2"]),
        ([*SIGMOID_MOE], ["--distributed.dp_shard=2", "--distributed.ep=2"]),
    ],
    ids=["fsdp", "fsdp-ep-moe"],
)
def test_the_modules_train_under_fsdp_like_one_process(token_dirs, tmp_path, model, layout):
    base = layout_run(token_dirs, STEPS, *MTP, *model)
    one = train_ranks(base, tmp_path / "one", 1, "--train.batch_size=4")[0]
    two = train_ranks(base, tmp_path / "two", 2, *layout, "--train.batch_size=2")
    config = load_config(None, base)
    bound = dict(cfg=config.model, seq_len=SEQ_LEN, tokens=TOKENS)
    for record in two:
        assert record["losses"] == two[0]["losses"]
    assert_layout_close(two[0]["losses"], one["losses"], **bound)
    norm_terms = grad_norm_terms(config)
    assert_layout_close(two[0]["grad_norms"], one["grad_norms"], norm_terms=norm_terms, **bound)
    want = [row["mtp/loss"] for row in train_rows(tmp_path / "one")]
    got = [row["mtp/loss"] for row in train_rows(tmp_path / "two")]
    assert len(got) == STEPS
    assert_layout_close(got, want, **bound)
