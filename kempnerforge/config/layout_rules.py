"""The [distributed] layout's rules against the world size and the rest of the job: the
mesh, tensor and pipeline parallelism, experts, and what sharding excludes; run by
JobConfig.validate on every rank before any collective."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kempnerforge.config.context_parallel import check_context_parallel
from kempnerforge.config.pipeline_schedule import check_pipeline_schedule
from kempnerforge.core.errors import ConfigError

if TYPE_CHECKING:
    from kempnerforge.config.job import JobConfig


def check_parallel_layout(config: JobConfig, world_size: int) -> None:
    """The [distributed] mesh must fit the world size and the model; runs on every rank
    before any collective, so a bad layout fails the same way everywhere."""
    dist, train = config.distributed, config.train
    shape = dist.mesh_shape(world_size)
    product = math.prod(shape.values())
    if shape["dp_shard"] == 0 or product != world_size:
        named = " * ".join(f"{k} {v}" for k, v in shape.items() if k != "dp_shard")
        raise ConfigError(
            "distributed.dp_shard",
            dist.dp_shard,
            f"dp_replicate * dp_shard * cp * tp * pp == world size {world_size}",
            f"{named} leaves no whole dp_shard"
            if shape["dp_shard"] == 0
            else f"the mesh {shape} holds {product} processes",
        )
    if dist.tp > 1:
        check_tensor_parallel_sizes(config)
    check_context_parallel(config)
    check_pipeline_layout(config)
    check_pipeline_schedule(dist, train, dist.resolved_dp(world_size) * dist.cp)
    check_expert_layout(config, shape["dp_shard"])
    dp = dist.resolved_dp(world_size)
    if train.global_batch_size and train.global_batch_size % dp:
        raise ConfigError(
            "train.global_batch_size",
            train.global_batch_size,
            f"a multiple of the data-parallel degree {dp} (dp_replicate * dp_shard)",
            "the global batch does not split evenly over the data-parallel ranks",
        )


def check_tensor_parallel_sizes(config: JobConfig) -> None:
    """distributed.tp must divide every size it splits: the attention heads (a latent
    attention's key/value heads are its query heads), the dense feed-forward's hidden
    size where a layer has one, and the experts' hidden size in an MoE model."""
    dist, model = config.distributed, config.model
    for name, count in (("n_heads", model.n_heads), ("n_kv_heads", model.kv_heads)):
        if count % dist.tp:
            raise ConfigError(
                "distributed.tp",
                dist.tp,
                f"a divisor of model.{name} = {count}",
                "each tensor-parallel rank holds whole attention heads",
            )
    has_dense = any(not model.is_moe_layer(i) for i in range(model.n_layers))
    if has_dense and model.hidden_dim % dist.tp:
        raise ConfigError(
            "distributed.tp",
            dist.tp,
            f"a divisor of the feed-forward size {model.hidden_dim}",
            "set model.ffn_hidden_dim or model.multiple_of",
        )
    if model.is_moe and model.expert_hidden_dim % dist.tp:
        raise ConfigError(
            "distributed.tp",
            dist.tp,
            f"a divisor of the experts' hidden size {model.expert_hidden_dim}",
            "each tensor-parallel rank holds the same share of every expert's hidden "
            "features; set model.moe_expert_hidden_dim",
        )


def check_pipeline_layout(config: JobConfig) -> None:
    """Pipeline parallelism against the model and the job: split points only with pp > 1,
    a layer per stage, whole rounds of micro-batches. (A tied embedding and head on two
    stages is two copies kept equal: distributed/tied_head.py.)"""
    dist, model, train = config.distributed, config.model, config.train
    if dist.pp == 1:
        if dist.pp_split_points:
            raise ConfigError(
                "distributed.pp_split_points",
                dist.pp_split_points,
                "[] when distributed.pp = 1",
            )
        return
    stages = dist.num_stages
    if stages > model.n_layers:
        raise ConfigError(
            "distributed.pp",
            dist.pp,
            f"pp * stages per rank ({stages}) <= model.n_layers = {model.n_layers}",
            "every pipeline stage needs at least one layer",
        )
    points = dist.pp_split_points
    if points and (len(points) != stages - 1 or points[-1] >= model.n_layers):
        raise ConfigError(
            "distributed.pp_split_points",
            points,
            f"{stages - 1} increasing layer indices in [1, {model.n_layers - 1}] "
            f"(one per stage after the first, {stages} stages)",
        )
    if train.grad_accum_steps < dist.pp or train.grad_accum_steps % dist.pp:
        raise ConfigError(
            "train.grad_accum_steps",
            train.grad_accum_steps,
            f"a multiple of distributed.pp = {dist.pp}",
            "the pipeline's micro-batches are the step's micro-batches; each stage "
            "needs whole rounds of them",
        )


def check_expert_layout(config: JobConfig, dp_shard: int) -> None:
    """MoE against the layout: expert parallelism splits the experts over data-parallel
    shard and context-parallel ranks (of each pipeline stage); tensor parallelism splits
    each expert's hidden features (check_tensor_parallel_sizes), without expert
    parallelism."""
    dist, model = config.distributed, config.model
    if not model.is_moe:
        if dist.ep > 1:
            raise ConfigError(
                "distributed.ep",
                dist.ep,
                "1 for a dense model (model.num_experts = 0)",
                "expert parallelism splits the experts of MoE layers",
            )
        return
    if dist.tp > 1 and dist.ep > 1:
        raise ConfigError(
            "distributed.ep",
            dist.ep,
            "1 with distributed.tp > 1",
            "tensor parallelism splits each expert's hidden features over the tp ranks, "
            "expert parallelism the experts over data-parallel ranks; the two are not "
            "combined: choose distributed.tp or distributed.ep for the experts",
        )
    if model.num_experts % dist.ep:
        raise ConfigError(
            "distributed.ep",
            dist.ep,
            f"a divisor of model.num_experts = {model.num_experts}",
            "each expert-parallel rank holds the same number of whole experts",
        )
    # Context-parallel peers route their own tokens, so they count as shard ranks here.
    shard_ranks = dp_shard * dist.cp
    if shard_ranks % dist.ep:
        where = f"distributed.dp_shard = {dp_shard}"
        if dist.cp > 1:
            where = f"distributed.dp_shard * distributed.cp = {dp_shard} * {dist.cp}"
        raise ConfigError(
            "distributed.ep",
            dist.ep,
            f"a divisor of {where}",
            "expert-parallel ranks are data-parallel shard (and context-parallel) ranks "
            "that exchange tokens",
        )
