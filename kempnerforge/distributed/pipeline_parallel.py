"""Pipeline parallelism: which layers each stage holds, the stage modules, and the schedule.

A pipeline rank builds one Transformer that keeps only the layers of its stages (so every
parameter keeps the whole model's name) plus one module per stage that runs that stage's
slice of it; ``build_pipeline`` wraps those in torch.distributed.pipelining stages and a
schedule, and ``PipelineBundle.run`` drives one optimizer step's micro-batches through it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kempnerforge.config.distributed import DistributedConfig
from kempnerforge.config.model import ModelConfig
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.distributed.schedules import build_schedule
from kempnerforge.model.attention import LayerMask
from kempnerforge.model.heads import HeadLoss, HeadLossSpec, head_loss
from kempnerforge.model.norm import RMSNorm
from kempnerforge.model.transformer import Transformer

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor | HeadLoss]


def stage_layer_ranges(
    n_layers: int, num_stages: int, split_points: list[int]
) -> list[tuple[int, int]]:
    """The layers of every pipeline stage, as ``(first, last)`` with ``last`` excluded.

    ``split_points`` are the layers where stages 1, 2, ... begin; empty splits evenly, the
    first ``n_layers % num_stages`` stages taking one layer more. The last stage is never
    among them: it also runs the final norm, the output head and the loss.
    """
    if not 1 <= num_stages <= n_layers:
        raise ValueError(f"{num_stages} pipeline stages need 1 to {n_layers} (n_layers) stages")
    if split_points:
        bounds = [0, *split_points, n_layers]
        if len(split_points) != num_stages - 1 or any(
            b <= a for a, b in zip(bounds, bounds[1:], strict=False)
        ):
            raise ValueError(
                f"split points {split_points} must be {num_stages - 1} increasing layer "
                f"indices in [1, {n_layers - 1}]"
            )
    else:
        base, extra = divmod(n_layers, num_stages)
        bounds = [0]
        for stage in range(num_stages):
            bounds.append(bounds[-1] + base + (1 if stage < extra else 0))
    return list(zip(bounds, bounds[1:], strict=False))


def stages_of_rank(
    pp_rank: int, pp_size: int, stages_per_rank: int, *, v_shaped: bool = False
) -> list[int]:
    """The stages pipeline rank ``pp_rank`` holds, in stage order.

    In loop order (default): pp_rank, pp_rank + pp_size, ... (the stage-to-rank mapping
    torch's interleaved schedules assume); stage 0 is on pipeline rank 0 and the last
    stage on rank pp_size - 1. ``v_shaped`` (the V schedules, two stages per rank):
    pp_rank and 2 * pp_size - 1 - pp_rank, so rank 0 holds both the first and the last
    stage and each rank's two stages pass activations down and back up the V.
    """
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pipeline rank {pp_rank} outside [0, {pp_size})")
    if v_shaped:
        if stages_per_rank != 2:
            raise ValueError(f"a V placement holds 2 stages per rank, not {stages_per_rank}")
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + k * pp_size for k in range(stages_per_rank)]


class _RankModelView:
    """What a stage reads of the rank model when it runs: the RoPE buffers (to_empty() and
    init_weights() replace and fill them after the stage modules exist) and its layers'
    masks. Not a Module, so a stage module holding one does not adopt the whole rank
    model as a child."""

    def __init__(self, model: Transformer) -> None:
        self._model = model

    def rope(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._model.rope(seq_len)  # under context parallelism, the slice's rows

    def masks(
        self, doc_ids: torch.Tensor | None, batch: int, seq_len: int, device: torch.device
    ) -> dict[str, LayerMask]:
        return self._model.attention_masks(doc_ids, batch, seq_len, device)


class StageModule(nn.Module):
    """One pipeline stage of a rank's Transformer: the embedding if it is the first stage,
    its layers in order, and the final norm and output head if it is the last.

    The submodules are the rank model's own (shared, not copied), registered under the
    same names (``layers.3.attention.wq.weight``), so sharding or materializing the rank
    model changes the stages too. A code path that replaces a block object (rather than
    changing it in place) must replace it in both ``model.layers`` and ``stage.layers``.
    """

    def __init__(
        self, model: Transformer, stage_id: int, num_stages: int, layers: tuple[int, int]
    ) -> None:
        super().__init__()
        self.stage_id = stage_id
        """Index of this stage in the whole pipeline."""
        self.tok_embeddings: nn.Embedding | None = model.tok_embeddings if stage_id == 0 else None
        """The token embedding (stage 0 only): token ids in, hidden states out."""
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in range(*layers)})
        """This stage's blocks, keyed by their index in the whole model."""
        is_last = stage_id == num_stages - 1
        self.norm: RMSNorm | None = model.norm if is_last else None
        """Final normalization (last stage only)."""
        self.output: nn.Linear | None = model.output if is_last else None
        """Output head (last stage only): returns logits instead of hidden states."""
        self.rank_model = _RankModelView(model)
        self.loss_spec: HeadLossSpec | None = None
        """How the last stage computes the loss from the labels it is given (set by
        build_pipeline); None: it returns logits for the schedule's loss function."""

    def forward(
        self,
        x: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> Any:
        """Token ids (batch, seq) on the first stage, hidden states (batch, seq, dim) on the
        others; returns hidden states, except on the last stage: logits, or with ``labels``
        and a loss_spec the HeadLoss computed chunk by chunk without whole logits (inside
        this forward, where FSDP has gathered the head's weight), as a plain tuple, the
        output type torch's pipelining stages handle. Other stages ignore ``labels``.
        ``doc_ids`` (batch, seq), given to every stage, masks packed documents as the
        whole model's forward does; each stage prepares its own layers' masks from them."""
        batch, seq_len = x.shape[:2]
        cos, sin = self.rank_model.rope(seq_len)
        masks = self.rank_model.masks(doc_ids, batch, seq_len, x.device)
        h = x if self.tok_embeddings is None else self.tok_embeddings(x)
        for index, layer in self.layers.items():
            h = layer(h, cos, sin, masks[index])
        if self.norm is None or self.output is None:
            return h
        if labels is not None and self.loss_spec is not None:
            return tuple(head_loss(self.norm(h), self.output, labels, self.loss_spec))
        return self.output(self.norm(h))


def build_stage_model(
    model_cfg: ModelConfig, stage_ids: list[int], ranges: list[tuple[int, int]]
) -> tuple[Transformer, list[StageModule]]:
    """This pipeline rank's model and one module per stage it holds.

    The model is built on the current default device (the meta device in the build) and
    keeps exactly the layers of ``stage_ids`` (``ranges`` from stage_layer_ranges, one per
    stage of the whole pipeline), the embedding only with stage 0 and the final norm and
    head only with the last stage; its parameter names are the whole model's. The stage
    modules share its submodules: parallelize, materialize and initialize the rank model
    (init_weights(seed) gives each kept parameter the whole model's value), then pass the
    stage modules to build_pipeline. The rank model's own forward is not a pipeline stage
    and is not meant to be called.
    """
    num_stages = len(ranges)
    kept = {i for stage in stage_ids for i in range(*ranges[stage])}
    model = Transformer(model_cfg)
    for index in list(model.layers):
        if int(index) not in kept:
            del model.layers[index]
    # A tied head whose embedding is on another rank is a parameter of its own there: the
    # embedding's copy (model/contract.py's tied_head_copy, distributed/tied_head.py).
    first, last = 0 in stage_ids, num_stages - 1 in stage_ids
    tied_apart = model_cfg.tie_embeddings and first != last
    model.tied_head_copy, model.embedding_copied = tied_apart and last, tied_apart and first
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = None
        model.output = None
    stages = [StageModule(model, s, num_stages, ranges[s]) for s in stage_ids]
    return model, stages


class _ScaledLoss:
    """The schedule's loss: the summed loss times ``scale``, keeping each unscaled value.

    The last stage's output is its HeadLoss (computed inside the stage) or logits, given to
    ``loss_fn``; a HeadLoss from either also leaves its per-token losses. The scale is set
    per step (the step's token normalisation); the unscaled values are what the step
    reports. The first step also calls it once for torch's shape inference, so a step's
    values are the last num_microbatches calls.
    """

    def __init__(self, loss_fn: LossFn) -> None:
        self.loss_fn = loss_fn
        self.scale: torch.Tensor | float | None = None
        self.values: list[torch.Tensor] = []
        self.token_losses: list[torch.Tensor] = []

    def __call__(self, output: Any, labels: torch.Tensor) -> torch.Tensor:
        # A tuple is the last stage's own HeadLoss (StageModule.forward), else logits.
        result = HeadLoss(*output) if isinstance(output, tuple) else self.loss_fn(output, labels)
        if isinstance(result, HeadLoss):
            self.token_losses.append(result.token_losses)
            result = result.loss_sum
        self.values.append(result.detach())
        return result if self.scale is None else result * self.scale


@dataclass
class PipelineBundle:
    """One rank's pipeline stages and the schedule that drives them.

    ``schedule`` is a torch.distributed.pipelining schedule built over ``stages`` (``stage``
    is the first of them); ``group`` is the pipeline process group. Call ``run`` once per
    optimizer step on every pipeline rank.
    """

    stage: Any
    """The first of ``stages`` (the only one without interleaving)."""
    schedule: Any
    """The torch.distributed.pipelining schedule over ``stages``."""
    pp_rank: int
    """This rank's index in the pipeline group."""
    pp_size: int
    """Ranks in the pipeline group (distributed.pp)."""
    group: Any = None
    """The pipeline process group the stages send activations and gradients over."""
    stages: list[Any] = field(default_factory=list)
    """Every stage this rank holds (several with an interleaved schedule), in stage order."""
    stage_ids: list[int] = field(default_factory=list)
    """The pipeline indices of ``stages``."""
    num_stages: int = 0
    """Stages in the whole pipeline (pp * stages per rank)."""
    num_microbatches: int = 1
    """Micro-batches per step: the whole-step batch is split into this many along dim 0."""
    loss: _ScaledLoss | None = None
    """The schedule's loss function (set by build_pipeline)."""
    head_loss: bool = False
    """Whether the last stage computes the loss itself from the labels (a loss_spec)."""
    token_losses: list[torch.Tensor] = field(default_factory=list)
    """After run, on the last stage: each micro-batch's per-token losses (batch, seq) when
    the loss gives them (a HeadLoss); [] otherwise."""

    @property
    def is_first(self) -> bool:
        """Whether this rank holds stage 0 (takes the token ids)."""
        return 0 in self.stage_ids if self.stage_ids else self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last stage (takes the labels, computes the loss)."""
        if self.stage_ids:
            return self.num_stages - 1 in self.stage_ids
        return self.pp_rank == self.pp_size - 1

    def run(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        loss_scale: torch.Tensor | float | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Forward and backward one step's micro-batches through the pipeline.

        ``inputs``, ``labels`` and ``doc_ids`` (None: no document mask) are the step's
        micro-batches concatenated along dim 0 (num_microbatches * batch_size rows, in
        micro-batch order); every pipeline rank passes them, each stage uses what it needs
        (every stage masks with the document ids). Gradients accumulate into the stage
        parameters as ``sum_i loss_fn(logits_i, labels_i) * loss_scale`` would give them
        (no extra division by the micro-batch count). Returns the unscaled per-micro-batch
        losses, detached, on the rank holding the last stage; [] on the others.
        Collective over the pipeline group.
        """
        assert self.loss is not None, "PipelineBundle.run needs build_pipeline's loss"
        self.loss.scale = loss_scale
        self.loss.values.clear()
        self.loss.token_losses.clear()
        extra = self._stage_kwargs(labels, doc_ids)
        # Outputs are not kept: the losses are all the step needs.
        if self.is_first and self.is_last:
            self.schedule.step(inputs, target=labels, return_outputs=False, **extra)
        elif self.is_first:
            self.schedule.step(inputs, return_outputs=False, **extra)
        elif self.is_last:
            self.schedule.step(target=labels, return_outputs=False, **extra)
        else:
            self.schedule.step(return_outputs=False, **extra)
        last = self.num_microbatches
        values = self.loss.values[-last:] if self.is_last else []
        self.token_losses = self.loss.token_losses[-last:] if self.is_last else []
        self.loss.values, self.loss.token_losses = [], []
        return values

    def _stage_kwargs(
        self, labels: torch.Tensor, doc_ids: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        """The keyword arguments this rank's stages get (the schedule splits them into
        micro-batches with the inputs and gives them to every stage of the rank, which
        ignores what it does not read): the document ids, and the labels on the last stage
        when it computes the loss itself."""
        extra = {"labels": labels} if self.head_loss and self.is_last else {}
        if doc_ids is not None:
            extra["doc_ids"] = doc_ids
        return extra

    @torch.no_grad()
    def score(
        self, inputs: torch.Tensor, labels: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Forward only: each micro-batch's per-token negative log-likelihoods (batch, seq),
        without the z-loss, on the rank holding the last stage; [] on the others.

        ``inputs``, ``labels`` and ``doc_ids`` are num_microbatches micro-batches
        concatenated along dim 0, as for ``run``; no gradient is computed or kept.
        Collective over the pipeline group."""
        assert self.loss is not None, "PipelineBundle.score needs build_pipeline's loss"
        self.loss.scale = None
        self.loss.values.clear()
        self.loss.token_losses.clear()
        extra = self._stage_kwargs(labels, doc_ids)
        with _without_z_loss(self):
            if self.is_first and self.is_last:
                self.schedule.eval(inputs, target=labels, return_outputs=False, **extra)
            elif self.is_first:
                self.schedule.eval(inputs, return_outputs=False, **extra)
            elif self.is_last:
                self.schedule.eval(target=labels, return_outputs=False, **extra)
            else:
                self.schedule.eval(return_outputs=False, **extra)
        last = self.num_microbatches
        token_losses = self.loss.token_losses[-last:] if self.is_last else []
        self.loss.values, self.loss.token_losses = [], []
        return token_losses


@contextlib.contextmanager
def _without_z_loss(bundle: PipelineBundle) -> Iterator[None]:
    """The bundle's loss, in its stages and in its loss function, with the z-loss weight at
    0 for the duration: scoring wants the cross-entropy alone."""
    assert bundle.loss is not None
    modules = [stage.submod for stage in bundle.stages]
    specs = [m.loss_spec if isinstance(m, StageModule) else None for m in modules]
    loss_fn = bundle.loss.loss_fn
    try:
        for module, spec in zip(modules, specs, strict=True):
            if spec is not None:
                module.loss_spec = dataclasses.replace(spec, z_loss_weight=0.0)
        if isinstance(loss_fn, functools.partial) and "z_loss_weight" in loss_fn.keywords:
            bundle.loss.loss_fn = functools.partial(
                loss_fn.func, *loss_fn.args, **{**loss_fn.keywords, "z_loss_weight": 0.0}
            )
        yield
    finally:
        for module, spec in zip(modules, specs, strict=True):
            if spec is not None:
                module.loss_spec = spec
        bundle.loss.loss_fn = loss_fn


@functools.cache
def _stage_class() -> type:
    """torch's PipelineStage without the start-up sends between two stages of one rank.

    torch 2.11's schedules open their first step with a batched send and receive between
    every two adjacent stages, also two on the same rank (the V-shaped schedules put
    stages 1 and 2 on one rank). gloo cannot send to its own rank ("Pair is not
    connected"), and two stages of one rank hand their tensors over in memory anyway, so
    those sends are left out. Later torch opens the step otherwise and never asks for them.
    Defined on first use: torch.distributed.pipelining imports the compiler stack, which a
    run without pipelining never needs.
    """
    from torch.distributed.pipelining import PipelineStage

    class _Stage(PipelineStage):
        def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
            ops = super()._get_init_p2p_neighbors_ops()
            return [op for op in ops if op.group_peer != self.group_rank]

    return _Stage


def build_pipeline(
    stage_modules: Sequence[nn.Module],
    stage_ids: list[int],
    runtime: RuntimeContext,
    distributed: DistributedConfig,
    loss_fn: LossFn,
    *,
    num_microbatches: int,
    loss_spec: HeadLossSpec | None = None,
) -> PipelineBundle:
    """Wrap this rank's stage modules in pipeline stages and build the configured schedule.

    The modules must be materialized and initialized (and, with FSDP, each a
    ``fully_shard`` root: the stage then runs the data-parallel gradient reduction once,
    after the step's last backward). The schedule is ``distributed.pp_schedule`` over
    ``num_microbatches`` micro-batches (the trainer's train.grad_accum_steps) with
    ``scale_grads=False``: ``loss_fn`` (summed loss of one micro-batch, as build_loss_fn
    gives) is scaled by ``run``'s loss_scale. With ``loss_spec`` the last stage computes the
    loss itself from the labels, chunked over tokens (and over the vocabulary under tensor
    parallelism), and ``loss_fn`` is not called.
    """
    num_stages = distributed.num_stages
    for module in stage_modules:
        if isinstance(module, StageModule):
            module.loss_spec = loss_spec
    group = runtime.group("pp")
    # Typed loosely: the schedules take a list of torch's private stage base class.
    stages: list[Any] = [
        _stage_class()(module, stage_id, num_stages, runtime.device, group=group)
        for module, stage_id in zip(stage_modules, stage_ids, strict=True)
    ]
    loss = _ScaledLoss(loss_fn)
    schedule = build_schedule(distributed.pp_schedule, stages, num_microbatches, loss)
    return PipelineBundle(
        stage=stages[0],
        schedule=schedule,
        pp_rank=runtime.pp_rank,
        pp_size=runtime.pp_size,
        group=group,
        stages=stages,
        stage_ids=list(stage_ids),
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        loss=loss,
        head_loss=loss_spec is not None,
    )
