"""Context parallelism (distributed.cp) against one process: the attention exchange, the
real build and loop with document masking, GQA, gradient accumulation and compiled blocks,
FSDP beside it, eval, the end-of-run sample, and checkpoints resumed across cp and one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from kempnerforge.config.loader import load_config
from kempnerforge.config.model import ModelConfig
from kempnerforge.distributed.parallelize import apply_compile
from kempnerforge.distributed.runtime import init_runtime
from kempnerforge.model.attention.sequence_split import (
    SequenceSplit,
    set_sequence_split,
    whole_sequences,
)
from kempnerforge.model.transformer import Transformer
from tests.support.dist import run_distributed
from tests.support.metrics_rows import eval_rows, train_rows
from tests.support.tiny import SIGMOID_MOE, TINY_MOE, layout_run
from tests.support.tolerance import (
    assert_layout_close,
    assert_reordered_close,
    grad_norm_terms,
    transformer_terms,
)
from tests.support.train_run import sample_on_ranks, train_ranks

pytestmark = pytest.mark.distributed

STEPS = 4
SEQ_LEN, TOKENS = 32, 4 * 32
"""A window's length, and the tokens of a step's global batch (4 sequences)."""
EVAL_INTERVAL, EVAL_TOKENS = 2, 2 * TOKENS
"""Eval after every 2 updates, over 2 steps of the global batch."""
CP2 = ["--distributed.cp=2", "--distributed.dp_shard=1"]


def _exchange_matches_one_process(
    rank: int, world_size: int, backend: str | None, kv_heads: int = 2
) -> dict:
    """The same model, batch and summed loss run whole and as this rank's slice; with a
    ``backend``, the sliced blocks run compiled, and then whole again (whole_sequences)."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=kv_heads, vocab_size=64, max_seq_len=16
    )
    model = Transformer(cfg)
    ids = torch.randint(0, 64, (2, 16))
    doc_ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 11 + [1] * 5])
    model(ids, doc_ids).float().pow(2).sum().backward()
    whole_logits = model(ids, doc_ids).detach()
    whole_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    set_sequence_split(model, SequenceSplit(dist.group.WORLD, rank, world_size))
    if backend is not None:
        torch._dynamo.reset()
        apply_compile(model, backend=backend)
    local = 16 // world_size
    part = slice(rank * local, (rank + 1) * local)
    logits = model(ids[:, part], doc_ids)
    logits.float().pow(2).sum().backward()
    grads = {}
    for name, param in model.named_parameters():
        dist.all_reduce(param.grad)  # the cp ranks' gradients sum to the whole sequence's
        grads[name] = param.grad
    with torch.no_grad(), whole_sequences(model):
        unsplit = model(ids, doc_ids)
    return {
        "logits": (logits.detach(), whole_logits[:, part]),
        "unsplit": (unsplit, whole_logits),
        "grads": (grads, whole_grads),
        "graph_breaks": sum(counters["graph_break"].values()),
    }


@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_exchanged_attention_gives_each_rank_its_slice_of_one_process_with_packed_documents(
    backend,
):
    """GQA (4 query, 2 key/value heads) and three documents in a row: each cp rank's logits
    are its positions of the whole-sequence forward, and the gradients sum to its. Compiled
    blocks trace the all-to-alls into their graph (no graph break) and recompile when
    whole_sequences switches the split off."""
    for record in run_distributed(_exchange_matches_one_process, 2, backend):
        _assert_exchange_matches(record, 2)
        assert_reordered_close(*record["unsplit"], terms=_exchange_terms(2)[0])
        assert record["graph_breaks"] == 0


def test_one_key_value_head_shared_by_the_context_parallel_ranks_gives_one_process() -> None:
    """4 query heads and 1 key/value head over 2 cp ranks: the head is repeated to both
    (each rank's 2 query heads read it), and the copies' gradients sum back into it."""
    for record in run_distributed(_exchange_matches_one_process, 2, None, 1):
        _assert_exchange_matches(record, 1)


def _exchange_terms(kv_heads: int) -> tuple[int, int]:
    """The sums a rank's slice runs in another order than the whole sequence: the model's
    forward chain for a logit; for a gradient the forward and backward and the 2 x 16
    positions a weight's gradient sums (over the ranks' all-reduce too)."""
    cfg = ModelConfig(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=kv_heads, vocab_size=64, max_seq_len=16
    )
    return transformer_terms(cfg, 16, backward=False), transformer_terms(cfg, 16) + 2 * 16


def _assert_exchange_matches(record: dict, kv_heads: int) -> None:
    logit_terms, grad_terms = _exchange_terms(kv_heads)
    assert_reordered_close(*record["logits"], terms=logit_terms)
    grads, whole = record["grads"]
    for name, grad in grads.items():
        assert_reordered_close(grad, whole[name], terms=grad_terms)


@pytest.fixture(scope="module")
def base(token_dirs) -> list[str]:
    return layout_run(
        token_dirs, STEPS, "--data.document_masking=true", "--eval.interval=2", "--eval.steps=2"
    )


@pytest.fixture(scope="module")
def reference(base, tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("one")
    record = train_ranks(base, run_dir, 1, "--train.batch_size=4", record_batches=True)[0]
    record["eval"] = [r["eval_loss"] for r in eval_rows(run_dir)]
    return record


def _assert_matches(
    ranks: list[dict], reference: dict, overrides: list[str], steps: int = STEPS
) -> None:
    """Losses and gradient norms of the last ``steps`` steps within fp32 reordering of the
    model's chain of sums, the batch's tokens and the updates before each (layout_atol)."""
    for record in ranks:
        assert record["losses"] == ranks[0]["losses"]
        assert record["grad_norms"] == ranks[0]["grad_norms"]
        assert len(record["losses"]) == steps
    config = load_config(None, overrides)
    bound = {"first_update": len(reference["losses"]) - steps, "cfg": config.model}
    bound |= {"seq_len": SEQ_LEN, "tokens": TOKENS}
    assert_layout_close(ranks[0]["losses"], reference["losses"][-steps:], **bound)
    norms = ranks[0]["grad_norms"], reference["grad_norms"][-steps:]
    assert_layout_close(*norms, norm_terms=grad_norm_terms(config), **bound)


def _assert_evals_match(got: list[float], want: list[float], base: list[str]) -> None:
    """Eval losses after every EVAL_INTERVAL updates, over EVAL_TOKENS tokens."""
    model = load_config(None, base).model
    assert_layout_close(
        got,
        want,
        first_update=EVAL_INTERVAL,
        every=EVAL_INTERVAL,
        cfg=model,
        seq_len=SEQ_LEN,
        tokens=EVAL_TOKENS,
    )


def _one_process_and_cp2(base: list[str], tmp_path, *extra: str) -> tuple[dict, list[dict]]:
    """The same run (``extra``) trained by one process in tmp_path/one and by two cp ranks
    in tmp_path/cp: its record and theirs."""
    (one,) = train_ranks(base, tmp_path / "one", 1, *extra)
    return one, train_ranks(base, tmp_path / "cp", 2, *extra, *CP2)


def test_document_masking_changes_this_corpus_gradients(base, reference, tmp_path) -> None:
    """The comparisons below exercise the mask: the corpus's windows cross documents, so
    training without it gives other gradients."""
    unmasked_run = ["--data.document_masking=false", "--train.max_steps=2"]
    unmasked = train_ranks(base, tmp_path, 1, *unmasked_run)
    masked = reference["grad_norms"][:2]
    assert max(abs(a - b) for a, b in zip(unmasked[0]["grad_norms"], masked, strict=True)) > 1e-3


@pytest.mark.parametrize(
    ("per_rank", "accum", "extra"),
    [(4, 1, []), (2, 2, []), (4, 1, ["--distributed.activation_checkpointing=full"])],
    ids=["cp2", "cp2-accumulate", "cp2-recompute"],
)
def test_two_context_parallel_ranks_train_and_evaluate_like_one_process(
    base, reference, tmp_path, per_rank, accum, extra
) -> None:
    """With activation checkpointing, backward recomputes each block's forward, all-to-alls
    included, on both ranks in the same order."""
    split = [f"--train.batch_size={per_rank}", f"--train.grad_accum_steps={accum}"]
    ranks = train_ranks(base, tmp_path / "cp", 2, *CP2, *split, *extra, record_batches=True)
    _assert_matches(ranks, reference, base)
    # Each cp rank read the same sequences and kept its half of the positions.
    whole = torch.cat(reference["batches"]) if accum == 1 else None
    if whole is not None:
        for rank, record in enumerate(ranks):
            mine = torch.cat(record["batches"])
            assert torch.equal(mine, whole[:, rank * 16 : (rank + 1) * 16])
    evals = [r["eval_loss"] for r in eval_rows(tmp_path / "cp")]
    _assert_evals_match(evals, reference["eval"], base)


@pytest.mark.parametrize(
    "data_parallel",
    [["--distributed.dp_shard=2"], ["--distributed.dp_replicate=2", "--distributed.dp_shard=1"]],
    ids=["fsdp", "hsdp"],
)
def test_context_parallel_beside_data_parallel_on_four_ranks_trains_like_one_process(
    base, reference, tmp_path, data_parallel
) -> None:
    """cp 2 x dp_shard 2: FSDP shards and averages over all four ranks (dp_shard_cp); cp 2
    x dp_replicate 2: HSDP shards over each cp pair and replicates across the pairs. Each
    data-parallel pair of cp ranks reads its half of the batch."""
    layout = ["--distributed.cp=2", *data_parallel, "--train.batch_size=2"]
    ranks = train_ranks(base, tmp_path / "cp-dp", 4, *layout, "--eval.interval=0")
    _assert_matches(ranks, reference, base)


def test_an_moe_model_under_context_parallelism_trains_like_one_process(base, tmp_path) -> None:
    """Each cp rank routes its own slice's tokens; the token-level balancing loss and the
    sigmoid routers' bias updates count the load over dp_cp, as one process counts it."""
    moe = [*SIGMOID_MOE, "--model.moe_aux_loss_weight=0.01", "--eval.interval=0"]
    one, ranks = _one_process_and_cp2(base, tmp_path, *moe)
    _assert_matches(ranks, one, [*base, *moe])


def test_sliding_windows_under_context_parallelism_train_like_one_process(base, tmp_path) -> None:
    """Windows of 8 tokens in every other layer, with the corpus's packed documents: after
    the exchange each rank attends its heads over the whole sequence under the same rules
    as one process."""
    windows = ["--model.sliding_window=8", "--model.sliding_window_pattern=2"]
    one, ranks = _one_process_and_cp2(base, tmp_path, *windows, "--eval.interval=0")
    _assert_matches(ranks, one, [*base, *windows])


def _group_ranks(rank: int, world_size: int, overrides: list[str]) -> dict[str, list[int]]:
    config = load_config(None, overrides)
    config.validate(world_size)
    runtime = init_runtime(config.distributed, "cpu")
    groups = {name: runtime.group(name) for name in ("cp", "ep", "efsdp")}
    return {
        name: [rank] if group is None else dist.get_process_group_ranks(group)
        for name, group in groups.items()
    }


@pytest.mark.parametrize(
    ("ep", "ep_groups", "efsdp_groups"),
    [
        (2, [[0, 1], [0, 1], [2, 3], [2, 3]], [[0, 2], [1, 3], [0, 2], [1, 3]]),
        (4, [[0, 1, 2, 3]] * 4, [[0], [1], [2], [3]]),
    ],
    ids=["ep2", "ep4"],
)
def test_expert_parallel_ranks_split_the_shard_and_context_parallel_ranks(
    ep, ep_groups, efsdp_groups
) -> None:
    """cp 2 x dp_shard 2 on 4 ranks (rank = 2 * shard + cp): the ep peers are consecutive
    ranks of dp_shard x cp, so ep 2 exchanges tokens within each cp pair and FSDP shards
    the experts across the pairs, and ep 4 spans all four."""
    overrides = [
        "--model.num_experts=4",
        "--model.moe_top_k=2",
        "--distributed.cp=2",
        "--distributed.dp_shard=2",
        f"--distributed.ep={ep}",
    ]
    ranks = run_distributed(_group_ranks, 4, overrides)
    assert [r["cp"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["ep"] for r in ranks] == ep_groups
    assert [r["efsdp"] for r in ranks] == efsdp_groups


@pytest.mark.parametrize(
    "layout",
    [
        ["--distributed.dp_shard=1", "--distributed.ep=2"],
        ["--distributed.dp_shard=2", "--distributed.ep=2", "--train.batch_size=2"],
        ["--distributed.dp_shard=2", "--distributed.ep=4", "--train.batch_size=2"],
    ],
    ids=["cp2-ep2", "cp2-dp2-ep2", "cp2-dp2-ep4"],
)
def test_an_moe_model_with_expert_parallelism_under_context_parallelism_trains_like_one_process(
    base, tmp_path, layout
) -> None:
    """Each cp rank routes its own slice's tokens and exchanges them with its ep peers:
    the ep ranks are consecutive ranks of dp_shard x cp (the cp pair; or every rank, across
    the data-parallel pair), and FSDP shards the experts over the rest. The balancing
    loss is the sequence-level one, so its counts are summed over cp beside the exchange."""
    moe = [
        *SIGMOID_MOE,
        "--model.moe_aux_loss_level=sequence",
        "--model.moe_aux_loss_weight=0.1",
        "--eval.interval=0",
    ]
    (one,) = train_ranks(base, tmp_path / "one", 1, *moe)
    world = 2 if "--distributed.dp_shard=1" in layout else 4
    ranks = train_ranks(base, tmp_path / "cp", world, *moe, "--distributed.cp=2", *layout)
    _assert_matches(ranks, one, [*base, *moe])


def test_a_sequence_level_balancing_loss_under_context_parallelism_trains_like_one_process(
    base, tmp_path
) -> None:
    """Each cp rank holds half of every sequence: the loss's per-sequence expert shares
    are summed over the cp pair (one all-reduce per layer), so the logged balancing loss,
    the losses and the gradient norms are one process's."""
    moe = [
        *TINY_MOE,
        "--model.moe_aux_loss_level=sequence",
        "--model.moe_aux_loss_weight=0.5",
        "--eval.interval=0",
    ]
    one, ranks = _one_process_and_cp2(base, tmp_path, *moe)
    aux = [[r["moe/aux_loss"] for r in train_rows(d)] for d in (tmp_path / "one", tmp_path / "cp")]
    # The balancing loss is a forward value: the model's forward chain and the tokens its
    # shares count, after each step's updates, as a loss is.
    bound = {"cfg": load_config(None, [*base, *moe]).model, "seq_len": SEQ_LEN, "tokens": TOKENS}
    assert_layout_close(aux[1], aux[0], **bound)
    _assert_matches(ranks, one, [*base, *moe])


def test_context_parallel_beside_tensor_parallel_on_four_ranks_trains_like_one_process(
    base, tmp_path
) -> None:
    """cp 2 x tp 2: tensor parallelism splits the heads, then cp exchanges each tp rank's
    heads over its cp peers (4 query heads, 2 key/value heads: each tp rank holds one
    key/value head, which its two cp ranks share)."""
    gqa = ["--eval.interval=0", "--train.max_steps=3"]
    (one,) = train_ranks(base, tmp_path / "one", 1, *gqa)
    layout = ["--distributed.cp=2", "--distributed.tp=2", "--distributed.dp_shard=1"]
    ranks = train_ranks(base, tmp_path / "cp-tp", 4, *gqa, *layout)
    _assert_matches(ranks, one, base, steps=3)


def test_context_parallel_beside_a_pipeline_on_four_ranks_trains_like_one_process(
    base, tmp_path
) -> None:
    """cp 2 x pp 2 (1f1b, 2 micro-batches): every stage's attention rotates its slice by
    the slice's global positions and exchanges heads over its cp peers."""
    plain = ["--data.document_masking=false", "--eval.interval=0", "--train.max_steps=3"]
    (one,) = train_ranks(base, tmp_path / "one", 1, *plain)
    layout = ["--distributed.cp=2", "--distributed.pp=2", "--distributed.dp_shard=1"]
    split = ["--train.batch_size=2", "--train.grad_accum_steps=2"]
    ranks = train_ranks(base, tmp_path / "cp-pp", 4, *plain, *layout, *split)
    _assert_matches(ranks, one, base, steps=3)


@pytest.mark.parametrize(
    ("saved", "resumed"),
    [(CP2, []), ([], CP2)],
    ids=["cp2-to-one-process", "one-process-to-cp2"],
)
def test_a_checkpoint_resumes_across_context_parallelism_at_the_exact_data_position(
    base, reference, tmp_path, saved, resumed
) -> None:
    run = tmp_path / "run"
    train_ranks(base, run, 2 if saved else 1, *saved, "--train.max_steps=2")
    ranks = train_ranks(base, run, 2 if resumed else 1, *resumed, record_batches=True)
    assert {r["start_step"] for r in ranks} == {2}
    _assert_matches(ranks, reference, base, steps=STEPS - 2)
    width = 32 // len(ranks)
    for rank, record in enumerate(ranks):
        for mine, whole in zip(record["batches"], reference["batches"][2:], strict=True):
            assert torch.equal(mine, whole[:, rank * width : (rank + 1) * width])


def test_the_end_of_run_sample_under_context_parallelism_is_one_process_sample(
    base, tmp_path
) -> None:
    sample = [
        "--train.sample_prompt=def",
        "--train.sample_tokens=12",
        "--train.max_steps=12",
        "--eval.interval=0",
        "--optimizer.lr=0.01",
    ]
    (one,) = run_distributed(
        sample_on_ranks, 1, [*base, *sample, "--train.run_dir=" + str(tmp_path / "one")]
    )
    ranks = run_distributed(
        sample_on_ranks, 2, [*base, *sample, *CP2, "--train.run_dir=" + str(tmp_path / "cp")]
    )
    assert one and ranks == [one, one]


def test_compiled_blocks_under_context_parallelism_train_like_one_process(
    base, reference, tmp_path
) -> None:
    """train.compile with cp 2: each block compiles with its four all-to-alls inside the
    graph (functional collectives), and training and eval equal one eager process."""
    layout = [*CP2, "--train.compile=true"]
    ranks = train_ranks(base, tmp_path / "cp", 2, *layout, timeout_s=600)
    _assert_matches(ranks, reference, base)
    evals = [r["eval_loss"] for r in eval_rows(tmp_path / "cp")]
    _assert_evals_match(evals, reference["eval"], base)
