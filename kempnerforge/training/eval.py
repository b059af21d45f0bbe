"""evaluate: mean held-out loss and perplexity over a fixed set of eval windows per set."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from kempnerforge.config.eval import EvalConfig
from kempnerforge.config.job import JobConfig
from kempnerforge.config.train import TrainConfig
from kempnerforge.data.dataset import IGNORE_INDEX
from kempnerforge.data.pipeline import DataPipeline
from kempnerforge.distributed.pipeline_parallel import PipelineBundle
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.evaluation.document_start import training_start
from kempnerforge.evaluation.tasks import LoadedTask, evaluate_task, load_tasks
from kempnerforge.model.heads import HeadLossSpec
from kempnerforge.training.families import family_of
from kempnerforge.training.forward import BatchLoss, training_autocast
from kempnerforge.training.layout import layout_of

# exp() of a diverged loss overflows a float; report perplexity as inf past this.
_MAX_LOG_PPL = 700.0


def perplexity(loss: float) -> float:
    """exp(loss), or inf once that would overflow."""
    return math.exp(loss) if loss < _MAX_LOG_PPL else math.inf


def eval_global_batch(ec: EvalConfig, tc: TrainConfig, dp_size: int) -> int:
    """Sequences per eval step over all data-parallel ranks: eval.batch_size, or when it is
    0 the training's global batch, train.batch_size * train.grad_accum_steps * ``dp_size``,
    which a resume on another number of ranks keeps."""
    return ec.batch_size or tc.batch_size * tc.grad_accum_steps * dp_size


def evaluate(
    model: torch.nn.Module, data: DataPipeline, config: JobConfig, runtime: RuntimeContext
) -> dict[str, float]:
    """Token-weighted mean cross-entropy over the first eval.steps global eval batches of
    each set.

    See evaluate_model; this is it for this rank's device, data-parallel group and the
    run's global eval batch (eval_global_batch); under context parallelism each rank
    evaluates its slice of every sequence and the sums are reduced over ``dp_cp``. The
    model must be whole on the rank
    (possibly sharded): a pipelined run has no such forward, so the loop does not call
    this there (ModelLayout.forward_refusal).
    """
    return evaluate_model(
        model,
        data,
        family_of(config).batch_loss(config),
        config.eval,
        config.train,
        runtime.device,
        group=runtime.group("dp_cp"),
        global_batch=eval_global_batch(config.eval, config.train, runtime.dp_size),
        batch_slice=data.batch_slice,
    )


@torch.no_grad()
def evaluate_model(
    model: torch.nn.Module,
    data: DataPipeline,
    batch_loss: BatchLoss,
    ec: EvalConfig,
    tc: TrainConfig,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    *,
    global_batch: int,
    batch_slice: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
) -> dict[str, float]:
    """``eval_loss``, ``eval_ppl`` and ``eval_tokens`` over every eval set; {} without eval data.

    Each set is evaluated on its first ``eval.steps * global_batch`` windows (wrapping
    around a short set): the same windows every time and in every layout, since
    ``global_batch`` (eval_global_batch) does not depend on the number of ranks. Each
    data-parallel rank evaluates its share of every eval step, in batches of at most
    train.batch_size sequences (the training's micro-batch, which fits), and the sums are
    reduced over ``group``, so every rank returns what one process would. The forward runs
    in eval mode (train mode restored after) under the training step's autocast
    (training_autocast), and draws no random numbers, so evaluating never perturbs the
    run. With train.loss_chunk_tokens > 0 the model computes the loss from labels in
    chunks, as in training, so eval never holds a batch's whole logits either.

    The overall loss is token-weighted over all sets. With ``[[eval.sets]]`` configured
    there are also ``eval_loss/<name>``, ``eval_ppl/<name>`` and ``eval_tokens/<name>``.
    ``batch_slice``, if given, turns each host batch into the part this rank evaluates
    (its context-parallel slice).
    """
    names = [s.name for s in ec.sets]
    if names and list(data.eval_datasets) != names:
        raise RuntimeError(
            f"eval.sets names {names} but the data pipeline holds {list(data.eval_datasets)}: "
            "build it with build_data_pipeline(..., eval_sets=config.eval.sets)"
        )
    if not data.eval_datasets:
        return {}
    spec = HeadLossSpec(tc.loss_chunk_tokens, z_loss_weight=0.0)
    was_training = model.training
    model.eval()
    per_set: dict[str, float] = {}
    total_loss, total_tokens = 0.0, 0
    try:
        for name in data.eval_datasets:
            sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss, tokens
            batches = data.eval_batches(ec.steps, global_batch, name, max_rows=tc.batch_size)
            for cpu_batch in batches:
                if batch_slice is not None:
                    cpu_batch = batch_slice(cpu_batch)
                batch = {k: v.to(device) for k, v in cpu_batch.items()}
                with training_autocast(tc, device):
                    loss = batch_loss(model, batch, cpu_batch, spec)
                sums[0] += loss.double()
                sums[1] += int((cpu_batch["labels"] != IGNORE_INDEX).sum())
            if group is not None:
                dist.all_reduce(sums, group=group)
            set_loss_sum, set_tokens = sums.tolist()
            num_tokens = int(set_tokens)
            total_loss += set_loss_sum
            total_tokens += num_tokens
            loss = set_loss_sum / max(num_tokens, 1)
            per_set[f"eval_loss/{name}"] = loss
            per_set[f"eval_ppl/{name}"] = perplexity(loss)
            per_set[f"eval_tokens/{name}"] = num_tokens
    finally:
        model.train(was_training)
    loss = total_loss / max(total_tokens, 1)
    metrics = {"eval_loss": loss, "eval_ppl": perplexity(loss), "eval_tokens": total_tokens}
    if ec.sets:
        metrics.update(per_set)
    return metrics


def load_job_tasks(config: JobConfig, data: DataPipeline) -> list[LoadedTask]:
    """The job's `[[eval.tasks]]`, read and packed into windows of train.seq_len with the
    data's tokenizer, texts starting as the training documents did (training_start),
    several requests to a row, kept apart by their document ids in every layout."""
    if not config.eval.tasks:
        return []
    return load_tasks(
        config.eval.tasks,
        data.tokenizer,
        training_start(data.tokenizer, config.data, data),
        config.train.seq_len,
    )


def tasks_due(
    ec: EvalConfig, max_steps: int, tasks: list[LoadedTask], step: int
) -> list[LoadedTask]:
    """The tasks to score after optimizer step ``step``: at their interval (eval.interval or
    the task's own), and after the last step (train.max_steps)."""
    due = []
    for task in tasks:
        interval = ec.task_interval(task.config)
        if interval and (step % interval == 0 or step == max_steps):
            due.append(task)
    return due


def evaluate_tasks(
    model: torch.nn.Module,
    data: DataPipeline,
    config: JobConfig,
    runtime: RuntimeContext,
    tasks: list[LoadedTask],
    global_batch: int = 0,
    pipeline: PipelineBundle | None = None,
) -> dict[str, float]:
    """Every task's metrics (evaluation/tasks.py), the same on every rank: each window is
    scored once, by one data-parallel rank, in batches of ``global_batch`` windows (by
    default the global eval batch, eval_global_batch) split over the ranks, under the
    training step's precision: forwards of at most train.batch_size rows of the whole
    model, or through ``pipeline``'s stages in its train.grad_accum_steps micro-batches of
    train.batch_size rows."""
    tc = config.train
    global_batch = global_batch or eval_global_batch(config.eval, tc, runtime.dp_size)
    scoring = layout_of(config.distributed).task_scoring(model, pipeline, data, tc, runtime)
    metrics: dict[str, float] = {}
    with training_autocast(tc, runtime.device):
        for task in tasks:
            metrics.update(
                evaluate_task(
                    model,
                    task,
                    scoring.token_losses,
                    device=runtime.device,
                    dp_rank=runtime.dp_rank,
                    dp_size=runtime.dp_size,
                    global_batch=global_batch,
                    rows_per_forward=scoring.rows_per_forward,
                    whole_forwards=scoring.whole_forwards,
                    groups=scoring.groups,
                )
            )
    return metrics
