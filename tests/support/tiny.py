"""The tests' tiny job: a 2-layer byte-level model and the overrides of a short, quiet run."""

from __future__ import annotations

import os

TINY_MODEL = [
    "--model.dim=32",
    "--model.n_layers=2",
    "--model.n_heads=2",
    "--model.multiple_of=16",
    "--model.max_seq_len=64",
]
"""dim 32, 2 layers, 2 heads, 64 positions, the byte vocabulary."""

TINY_MOE = ["--model.num_experts=4", "--model.moe_top_k=2", "--model.moe_expert_hidden_dim=16"]
"""The tiny model with mixture-of-experts feed-forwards: 4 experts of hidden size 16, 2 a token."""
SIGMOID_MOE = [*TINY_MOE, "--model.moe_router=sigmoid", "--model.moe_bias_update_rate=0.01"]
"""TINY_MOE routed by sigmoid scores, balanced by updates of the routers' expert biases."""


def tiny_run(
    run_dir: str | os.PathLike[str] | None, data: tuple[str, str] | None, *extra: str
) -> list[str]:
    """Overrides of a short run of the tiny model that writes only what a test reads.

    4 sequences of 32 tokens per step, a 2-step warmup, every step logged, no progress
    line, no sample, no periodic checkpoint (a run still saves its last step). ``data``
    is (train_dir, eval_dir); None leaves data to ``extra`` (or to a config file).
    ``extra`` comes last, so it overrides any of these.
    """
    where = [] if run_dir is None else [f"--train.run_dir={run_dir}"]
    corpus = [] if data is None else [f"--data.path={data[0]}", f"--data.eval_path={data[1]}"]
    return [
        *TINY_MODEL,
        "--train.batch_size=4",
        "--train.seq_len=32",
        "--train.sample_prompt=",
        *where,
        "--scheduler.warmup_steps=2",
        "--metrics.progress=off",
        "--metrics.log_interval=1",
        "--checkpoint.interval=0",
        *corpus,
        *extra,
    ]


def layout_run(data: tuple[str, str] | None, steps: int, *extra: str) -> list[str]:
    """The tiny run (no run directory) that a layout test trains in one process and on
    several ranks: ``steps`` steps, 4 query heads over 2 key/value heads (grouped-query
    attention, which tensor and context parallelism split), deterministic kernels and a
    1-step warmup. ``extra`` comes last, so it overrides any of these."""
    return tiny_run(
        None,
        data,
        "--model.n_heads=4",
        "--model.n_kv_heads=2",
        f"--train.max_steps={steps}",
        "--train.deterministic=true",
        "--scheduler.warmup_steps=1",
        *extra,
    )


def preference_run(
    run_dir: str | os.PathLike[str], prefs: str | os.PathLike[str], seq_len: int, *extra: str
) -> list[str]:
    """The tiny run training DPO (train.loss_fn = "dpo") on the preference corpus ``prefs``
    in windows of ``seq_len``, no held-out set and no eval; ``extra`` comes last."""
    return tiny_run(
        run_dir, None, f"--data.path={prefs}", "--data.eval_path=", f"--train.seq_len={seq_len}",
        f"--model.max_seq_len={seq_len}", "--train.loss_fn=dpo", "--eval.interval=0", *extra,
    )  # fmt: skip
