"""Muon's sharded optimizer step against AdamW's, on the same FSDP layout at several rank counts.

For each rank count N of ``--ranks`` (default 1 2 4), starts N gloo processes on the CPU
(localhost, a free port; N = 1 is one process with no process group), each limited to
``--threads`` torch threads so the ranks share the cores alike at every N. Each rank builds
the model preset (configs/model/125m.toml by default) as training does (build_model_on_mesh:
meta -> parallelize_model with distributed.dp_shard = N -> to_empty -> init_weights), and
builds both optimizers over it through build_optimizer: Muon (lr 0.02) and AdamW. Per rank:

1. optimizer step: one forward/backward on a fixed batch, the same on every rank, gives
   every parameter a gradient (each rank its shard of it), kept for every step. The two
   optimizers then step in turn, first one then the other, alternating which goes first;
   ``--warmup`` untimed rounds, then the median of ``--steps`` timed ones: wall ms and
   process CPU ms (time.process_time: every thread of the rank, gloo's included).
2. bytes sent to other ranks by one optimizer step, counted by wrapping torch.distributed's
   collectives in the rank: all_to_all_single (its input splits less the rank's own block),
   all_gather_into_tensor / all_gather_single / all_gather (the input to each peer),
   reduce_scatter_tensor / reduce_scatter_single (the peers' blocks), all_reduce (what a
   ring sends, 2 (n-1)/n of the tensor) and broadcast (the tensor to each peer, from the
   source). DTensor's own redistributions run through functional collectives and are not
   counted; the sharded Muon exchange calls all_to_all_single and is. The wall time spent
   inside those calls (waiting for the peers included) is reported beside the bytes.
3. Newton-Schulz: kempnerforge.optim.muon.newton_schulz_orthogonalize is wrapped to count
   the matrices the rank orthogonalises per step and their summed wall and thread-CPU time
   (time.thread_time; the whole of it with --threads 1, only the calling thread's share
   otherwise). The one-process time is the baseline: each row gives the slowest rank's time
   over it. Expected: ceil(matrices / N) matrices per rank. With N processes on fewer cores
   the wall time is shared between them; the thread-CPU time is not.
4. training step: forward, backward, optimizer.step() and zero_grad() at a fixed batch per
   rank (``--batch`` sequences of ``--seq`` tokens; each rank its own tokens), the median
   wall ms of the timed rounds, and the bytes sent (FSDP's gathers and reductions too);
   the global batch is N x batch x seq tokens.

Prints one JSON line per (ranks, optimizer), the per-rank figures and the slowest rank's,
then a Markdown table. Further ``--section.field=value`` arguments override the config.

    python bench/muon_layouts.py [--ranks 1 2 4] [--model 125m] [--seq 256] [--batch 1]
                                 [--steps 5] [--warmup 1] [--threads 1]

On one thread per rank the 125m preset spends about 11 s of CPU per Muon step in
Newton-Schulz alone (84 matrices, one process), and every round steps each optimizer twice
(alone, then in a training step): ``--ranks 1 2 --steps 2`` took 3 minutes on 2 cores,
the defaults (--ranks 1 2 4 --steps 5) roughly 10 to 15 minutes, and ``--model debug
--ranks 1 2 --steps 2`` 15 to 20 s.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.multiprocessing.spawn import spawn

from kempnerforge.config.job import JobConfig
from kempnerforge.config.loader import load_config
from kempnerforge.distributed.runtime import (
    RuntimeContext,
    init_runtime,
    left_a_process_group,
    teardown_runtime,
)
from kempnerforge.optim import muon
from kempnerforge.optim.optimizer import build_optimizer
from kempnerforge.training.build import build_model_on_mesh
from kempnerforge.training.loss import LossFn, build_loss_fn

REPO = Path(__file__).resolve().parents[1]

OPTIMIZERS: dict[str, list[str]] = {
    "muon": ["--optimizer.name=muon", "--optimizer.lr=0.02", "--optimizer.muon_adam_lr=3e-4"],
    "adamw": ["--optimizer.name=adamw", "--optimizer.lr=3e-4"],
}
"""The overrides of each optimizer compared; the step time does not depend on the values."""

NS_GOAL_RATIO = {2: 0.6, 4: 0.35}
"""Newton-Schulz time per rank over the one-process time that the sharded exchange aims at."""

GRAD_SEED = 0
"""Seed of the batch whose gradients every optimizer step reuses: the same on every rank,
so each rank holds its shard of the one-process gradient."""

TRAIN_SEED = 1000
"""Seed of rank r's training batch is TRAIN_SEED + r: data-parallel ranks see their own data."""


@dataclass(frozen=True)
class Settings:
    """What every rank of every rank count runs with (picklable: handed to spawn)."""

    model: str
    seq: int
    batch: int
    steps: int
    warmup: int
    threads: int
    overrides: tuple[str, ...]

    def model_path(self) -> str:
        """A preset name of configs/model, or a path to a TOML file."""
        if self.model.endswith(".toml"):
            return self.model
        return str(REPO / "configs" / "model" / f"{self.model}.toml")

    def job_config(self, ranks: int, optimizer: str) -> JobConfig:
        return load_config(
            self.model_path(),
            [
                f"--distributed.dp_shard={ranks}",
                f"--model.max_seq_len={self.seq}",
                f"--train.seq_len={self.seq}",
                f"--train.batch_size={self.batch}",
                "--train.device=cpu",
                *OPTIMIZERS[optimizer],
                *self.overrides,
            ],
        )


@dataclass
class Tally:
    """What one rank did since the last reset: bytes its collectives sent to other ranks and
    the wall time spent in them, and the matrices it orthogonalised with their summed time."""

    bytes_sent: int = 0
    collective_s: float = 0.0
    ns_matrices: int = 0
    ns_wall_s: float = 0.0
    ns_thread_s: float = 0.0

    def reset(self) -> None:
        self.bytes_sent = 0
        self.collective_s = 0.0
        self.ns_matrices = 0
        self.ns_wall_s = 0.0
        self.ns_thread_s = 0.0


@dataclass
class Timings:
    """One optimizer's per-step figures on one rank, a list entry per timed step."""

    step_ms: list[float] = field(default_factory=list)
    step_cpu_ms: list[float] = field(default_factory=list)
    bytes_sent: list[int] = field(default_factory=list)
    collective_ms: list[float] = field(default_factory=list)
    ns_matrices: list[int] = field(default_factory=list)
    ns_wall_ms: list[float] = field(default_factory=list)
    ns_thread_ms: list[float] = field(default_factory=list)
    train_step_ms: list[float] = field(default_factory=list)
    train_bytes_sent: list[int] = field(default_factory=list)

    def medians(self) -> dict[str, float | int]:
        return {
            "step_ms": _median(self.step_ms),
            "step_cpu_ms": _median(self.step_cpu_ms),
            "bytes_sent": statistics.median_low(self.bytes_sent),
            "collective_ms": _median(self.collective_ms),
            "ns_matrices": statistics.median_low(self.ns_matrices),
            "ns_wall_ms": _median(self.ns_wall_ms),
            "ns_thread_ms": _median(self.ns_thread_ms),
            "train_step_ms": _median(self.train_step_ms),
            "train_bytes_sent": statistics.median_low(self.train_bytes_sent),
        }


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 2)


# --- counting collectives ------------------------------------------------------------------


def _group_size_and_rank(arguments: dict[str, Any]) -> tuple[int, int]:
    group = arguments.get("group")
    return dist.get_world_size(group), dist.get_rank(group)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _all_to_all_single_sent(arguments: dict[str, Any]) -> int:
    """The input's rows split over the group, less the block this rank keeps."""
    tensor: torch.Tensor = arguments["input"]
    size, me = _group_size_and_rank(arguments)
    rows = tensor.size(0) if tensor.dim() else 0
    if rows == 0:
        return 0
    splits = arguments.get("input_split_sizes") or [rows // size] * size
    return (sum(splits) - splits[me]) * (_nbytes(tensor) // rows)


def _gather_sent(arguments: dict[str, Any]) -> int:
    """This rank's block, to each of the others."""
    tensor = arguments.get("input_tensor", arguments.get("tensor"))
    assert isinstance(tensor, torch.Tensor)
    size, _ = _group_size_and_rank(arguments)
    return _nbytes(tensor) * (size - 1)


def _reduce_scatter_sent(arguments: dict[str, Any]) -> int:
    """The blocks of the input that the other ranks keep."""
    size, _ = _group_size_and_rank(arguments)
    return _nbytes(arguments["input"]) * (size - 1) // size


def _all_reduce_sent(arguments: dict[str, Any]) -> int:
    """What a ring all-reduce sends: a reduce-scatter and an all-gather of the tensor."""
    size, _ = _group_size_and_rank(arguments)
    return 2 * _nbytes(arguments["tensor"]) * (size - 1) // size


def _broadcast_sent(arguments: dict[str, Any]) -> int:
    """The tensor to each of the others, from the source rank; nothing from the rest."""
    size, me = _group_size_and_rank(arguments)
    group, source = arguments.get("group"), arguments.get("group_src")
    if source is None:  # given as a global rank, the same as the group rank in the world
        source = arguments["src"] if group is None else dist.get_group_rank(group, arguments["src"])
    return _nbytes(arguments["tensor"]) * (size - 1) if me == source else 0


SENT_BY_COLLECTIVE: dict[str, Callable[[dict[str, Any]], int]] = {
    "all_to_all_single": _all_to_all_single_sent,
    "all_gather_into_tensor": _gather_sent,
    "all_gather_single": _gather_sent,
    "all_gather": _gather_sent,
    "reduce_scatter_tensor": _reduce_scatter_sent,
    "reduce_scatter_single": _reduce_scatter_sent,
    "all_reduce": _all_reduce_sent,
    "broadcast": _broadcast_sent,
}
"""torch.distributed's collectives that are counted, and the bytes one call sends to peers."""


def _counted(
    original: Callable[..., Any], sent: Callable[[dict[str, Any]], int], tally: Tally
) -> Callable[..., Any]:
    """``original`` as it was, adding to ``tally`` what each call sends and its wall time."""
    signature = inspect.signature(original)

    def collective(*args: Any, **kwargs: Any) -> Any:
        tally.bytes_sent += sent(signature.bind(*args, **kwargs).arguments)
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:  # with async_op=True, only the launch
            tally.collective_s += time.perf_counter() - started

    return collective


def count_collectives(tally: Tally) -> None:
    """Wrap the collectives of SENT_BY_COLLECTIVE in this process, on torch.distributed and
    on distributed_c10d (where torch's own modules may look them up), to add what each call
    sends to ``tally``."""
    for name, sent in SENT_BY_COLLECTIVE.items():
        original = getattr(dist, name, None)
        if original is None:  # not in this torch
            continue
        wrapped = _counted(original, sent, tally)
        setattr(dist, name, wrapped)
        if getattr(c10d, name, None) is original:
            setattr(c10d, name, wrapped)


def time_newton_schulz(tally: Tally) -> None:
    """Wrap Muon's Newton-Schulz to count the matrices and add their time to ``tally``;
    Muon looks the function up on its module at each call, so the wrapper is what runs."""
    original = muon.newton_schulz_orthogonalize

    def timed(matrix: torch.Tensor, steps: int, eps: float = 1e-7) -> torch.Tensor:
        wall, thread = time.perf_counter(), time.thread_time()
        result = original(matrix, steps, eps)
        tally.ns_wall_s += time.perf_counter() - wall
        tally.ns_thread_s += time.thread_time() - thread
        tally.ns_matrices += 1
        return result

    muon.newton_schulz_orthogonalize = timed


# --- one rank ------------------------------------------------------------------------------


def token_batch(seed: int, batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) from their own generator: the same for the same seed anywhere."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def forward_backward(
    model: torch.nn.Module, loss_fn: LossFn, batch: tuple[torch.Tensor, torch.Tensor]
) -> None:
    input_ids, labels = batch
    logits = model(input_ids)
    (loss_fn(logits, labels) / labels.numel()).backward()


def synchronized(runtime: RuntimeContext) -> None:
    """Start a timed step on every rank together, so no rank times its wait for another."""
    if runtime.is_distributed:
        dist.barrier()


def timed(step: Callable[[], object]) -> tuple[float, float]:
    """Wall-clock and process CPU milliseconds of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    step()
    return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3


def round_order(round_: int) -> list[str]:
    """Which optimizer goes first alternates, so neither always follows the other."""
    names = list(OPTIMIZERS)
    return names if round_ % 2 == 0 else names[::-1]


def measure_optimizer_steps(
    optimizers: dict[str, torch.optim.Optimizer],
    settings: Settings,
    runtime: RuntimeContext,
    tally: Tally,
    timings: dict[str, Timings],
) -> None:
    """optimizer.step() alone, on the gradients already in place (steps leave them alone)."""
    for round_ in range(settings.warmup + settings.steps):
        for name in round_order(round_):
            synchronized(runtime)
            tally.reset()
            wall_ms, cpu_ms = timed(optimizers[name].step)
            if round_ < settings.warmup:
                continue
            figures = timings[name]
            figures.step_ms.append(wall_ms)
            figures.step_cpu_ms.append(cpu_ms)
            figures.bytes_sent.append(tally.bytes_sent)
            figures.collective_ms.append(tally.collective_s * 1e3)
            figures.ns_matrices.append(tally.ns_matrices)
            figures.ns_wall_ms.append(tally.ns_wall_s * 1e3)
            figures.ns_thread_ms.append(tally.ns_thread_s * 1e3)


def measure_training_steps(
    model: torch.nn.Module,
    loss_fn: LossFn,
    optimizers: dict[str, torch.optim.Optimizer],
    batch: tuple[torch.Tensor, torch.Tensor],
    settings: Settings,
    runtime: RuntimeContext,
    tally: Tally,
    timings: dict[str, Timings],
) -> None:
    """Forward, backward, step and zero_grad, as the training loop runs them."""
    model.zero_grad(set_to_none=True)
    for round_ in range(settings.warmup + settings.steps):
        for name in round_order(round_):
            optimizer = optimizers[name]

            def train_step(optimizer: torch.optim.Optimizer = optimizer) -> None:
                forward_backward(model, loss_fn, batch)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            synchronized(runtime)
            tally.reset()
            wall_ms, _ = timed(train_step)
            if round_ >= settings.warmup:
                timings[name].train_step_ms.append(wall_ms)
                timings[name].train_bytes_sent.append(tally.bytes_sent)


def muon_matrices(optimizer: torch.optim.Optimizer) -> int:
    """How many matrices Muon orthogonalises per step, over all ranks together."""
    return sum(len(g["params"]) for g in optimizer.param_groups if g.get("use_muon"))


def run_rank(rank: int, ranks: int, settings: Settings, port: int, out: str) -> None:
    """One rank: build the model and both optimizers, measure, write rank<r>.json to ``out``."""
    torch.set_num_threads(settings.threads)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(ranks),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    configs = {name: settings.job_config(ranks, name) for name in OPTIMIZERS}
    config = configs["muon"]
    config.validate(ranks)
    runtime = init_runtime(config.distributed, "cpu")
    tally = Tally()
    count_collectives(tally)
    time_newton_schulz(tally)

    loss_fn = build_loss_fn(config.train)
    model, _ = build_model_on_mesh(config, runtime, loss_fn)
    optimizers = {name: build_optimizer(model, cfg.optimizer) for name, cfg in configs.items()}
    vocab = config.model.vocab_size
    forward_backward(model, loss_fn, token_batch(GRAD_SEED, settings.batch, settings.seq, vocab))
    timings = {name: Timings() for name in OPTIMIZERS}
    measure_optimizer_steps(optimizers, settings, runtime, tally, timings)
    own_batch = token_batch(TRAIN_SEED + rank, settings.batch, settings.seq, vocab)
    measure_training_steps(model, loss_fn, optimizers, own_batch, settings, runtime, tally, timings)

    report = {
        "params": sum(p.numel() for p in model.parameters()),
        "muon_matrices": muon_matrices(optimizers["muon"]),
        "optimizers": {name: figures.medians() for name, figures in timings.items()},
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    teardown_runtime(runtime, together=True)
    if left_a_process_group():
        # A gloo thread may still drop its last reference while the interpreter finalises
        # (see runtime.left_a_process_group): end without finalising, the report written.
        os._exit(0)


# --- the rank counts -----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(ranks: int, settings: Settings) -> list[dict[str, Any]]:
    """Every rank's report at this rank count, in rank order."""
    with tempfile.TemporaryDirectory() as out:
        spawn(run_rank, args=(ranks, settings, free_port(), out), nprocs=ranks)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(ranks)]


@dataclass
class Baseline:
    """The one-process Newton-Schulz time per step that every rank count is compared to."""

    wall_ms: float
    thread_ms: float


def _ratio(value: float, baseline: float | None) -> float | None:
    return round(value / baseline, 3) if baseline else None


def summary_row(
    ranks: int,
    optimizer: str,
    reports: list[dict[str, Any]],
    settings: Settings,
    baseline: Baseline | None,
) -> dict[str, Any]:
    """One (ranks, optimizer) line: per-rank lists, and the slowest rank's figures (the one
    every other waits for at the step's next collective)."""
    per_rank = [r["optimizers"][optimizer] for r in reports]

    def each(key: str) -> list[Any]:
        return [figures[key] for figures in per_rank]

    total = reports[0]["muon_matrices"]
    row: dict[str, Any] = {
        "ranks": ranks,
        "optimizer": optimizer,
        "model": settings.model,
        "params": reports[0]["params"],
        "global_batch_tokens": ranks * settings.batch * settings.seq,
        "batch_per_rank": settings.batch,
        "seq": settings.seq,
        "step_ms": max(each("step_ms")),
        "step_ms_per_rank": each("step_ms"),
        "step_cpu_ms_per_rank": each("step_cpu_ms"),
        "bytes_sent_per_rank": each("bytes_sent"),
        "collective_ms_per_rank": each("collective_ms"),
        "train_step_ms": max(each("train_step_ms")),
        "train_step_ms_per_rank": each("train_step_ms"),
        "train_bytes_sent_per_rank": each("train_bytes_sent"),
    }
    if optimizer == "muon":
        wall, thread = max(each("ns_wall_ms")), max(each("ns_thread_ms"))
        row |= {
            "ns_matrices_total": total,
            "ns_matrices_goal": math.ceil(total / ranks),
            "ns_matrices_per_rank": each("ns_matrices"),
            "ns_wall_ms_per_rank": each("ns_wall_ms"),
            "ns_thread_ms_per_rank": each("ns_thread_ms"),
            "ns_wall_ratio": _ratio(wall, baseline.wall_ms if baseline else None),
            "ns_thread_ratio": _ratio(thread, baseline.thread_ms if baseline else None),
            "ns_ratio_goal": NS_GOAL_RATIO.get(ranks),
        }
    row |= {
        "steps": settings.steps,
        "warmup": settings.warmup,
        "threads": settings.threads,
        "torch": torch.__version__,
    }
    return row


TABLE_COLUMNS = (
    "ranks",
    "optimizer",
    "step ms",
    "step CPU ms",
    "sent MiB",
    "in collectives ms",
    "NS matrices (goal)",
    "NS wall ms",
    "NS thread ms",
    "NS wall / 1 proc",
    "NS thread / 1 proc (goal)",
    "train step ms",
    "global batch tokens",
)
"""The summary table's columns; per-rank figures are the slowest (largest) rank's."""


def _text(value: object) -> str:
    return "-" if value is None else str(value)


def table_cells(row: dict[str, Any]) -> list[str]:
    """One row's TABLE_COLUMNS; the Newton-Schulz columns are '-' for AdamW."""
    ns: list[object] = [None] * 5
    if row["optimizer"] == "muon":
        ns = [
            f"{max(row['ns_matrices_per_rank'])} ({row['ns_matrices_goal']})",
            max(row["ns_wall_ms_per_rank"]),
            max(row["ns_thread_ms_per_rank"]),
            row["ns_wall_ratio"],
            f"{_text(row['ns_thread_ratio'])} ({_text(row['ns_ratio_goal'])})",
        ]
    cells = [
        row["ranks"],
        row["optimizer"],
        row["step_ms"],
        max(row["step_cpu_ms_per_rank"]),
        f"{max(row['bytes_sent_per_rank']) / 2**20:.1f}",
        max(row["collective_ms_per_rank"]),
        *ns,
        row["train_step_ms"],
        row["global_batch_tokens"],
    ]
    return [_text(cell) for cell in cells]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = [" | ".join(TABLE_COLUMNS), " | ".join("---" for _ in TABLE_COLUMNS)]
    lines += [" | ".join(table_cells(row)) for row in rows]
    return "\n".join(f"| {line} |" for line in lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--model", default="125m", help="configs/model preset or a TOML path")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    parser.add_argument("--steps", type=int, default=5, help="timed rounds (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args, overrides = parser.parse_known_args()
    settings = Settings(
        args.model, args.seq, args.batch, args.steps, args.warmup, args.threads, tuple(overrides)
    )
    rows: list[dict[str, Any]] = []
    baseline: Baseline | None = None
    for ranks in sorted(args.ranks):
        started = time.perf_counter()
        reports = run_ranks(ranks, settings)
        if ranks == 1:
            figures = reports[0]["optimizers"]["muon"]
            baseline = Baseline(figures["ns_wall_ms"], figures["ns_thread_ms"])
        for optimizer in OPTIMIZERS:
            row = summary_row(ranks, optimizer, reports, settings, baseline)
            print(json.dumps(row), flush=True)
            rows.append(row)
        seconds = time.perf_counter() - started
        print(f"{ranks} rank(s): {seconds:.0f} s", file=sys.stderr, flush=True)
    print()
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
